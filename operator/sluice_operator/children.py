"""Applying an endpoint's children safely: only objects it owns, replica counts handed over, errors kept.

- Ownership: an object of a child's name that exists without the endpoint's controller ownerReference
  (its uid) belongs to someone else. It is left untouched (no apply, so no selector, labels or ownerReference
  of ours, and the garbage collector never deletes it with the endpoint) and reported as a NameConflict.
- Replica handover: when the autoscaler takes a workload over (`replicas` -> `scaling`), the operator stops
  applying spec.replicas. Under server-side apply a field its only owner drops is removed, and the API server
  defaults it to 1: every loaded replica but one would die. So, as the Kubernetes documentation describes
  ("Transferring ownership"), a second field manager first applies just the live count, without force; the
  operator's apply then drops the field while the handover manager still owns it, and the value stays. KEDA's
  HPA takes the field over at its first write, and the handover manager, owning nothing, disappears.
- Errors: a child the API server refuses is reported (ApplyFailed, with the API server's message); the other
  children are still applied, and the caller retries the pass with backoff.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from .apply import FIELD_MANAGER, ApiError, Kind, KubeApi, kind_of

Object = dict[str, Any]
HANDOVER_MANAGER = f"{FIELD_MANAGER}-replicas-handover"
WORKLOAD_KINDS = ("Deployment", "LeaderWorkerSet")
NAME_CONFLICT, APPLY_FAILED = "NameConflict", "ApplyFailed"


@dataclass(frozen=True, slots=True)
class Problem:
    """A child the pass could not apply."""

    reason: str  # NameConflict | ApplyFailed
    kind: str
    name: str
    message: str


@dataclass
class Applied:
    missing: set[str] = field(default_factory=set)  # optional kinds the cluster does not serve (no CRD)
    problems: list[Problem] = field(default_factory=list)


def owned_by(obj: Object, uid: str | None) -> bool:
    """Whether `obj` carries a controller ownerReference to the object with this uid."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return uid is not None and any(r.get("controller") and r.get("uid") == uid for r in refs)


def _owner_text(obj: Object) -> str:
    ref = next((r for r in (obj.get("metadata") or {}).get("ownerReferences") or [] if r.get("controller")), None)
    return f"controlled by {ref.get('kind')} {ref.get('name')} (uid {ref.get('uid')})" if ref else "with no controller"


def conflict_message(kind: str, namespace: str, name: str, other: Object) -> str:
    return (f"{kind} {namespace}/{name} already exists, {_owner_text(other)}, not this endpoint: the operator "
            "leaves it untouched; delete or rename that object, or rename the endpoint")


def applies_replicas(obj: Object, manager: str = FIELD_MANAGER) -> bool:
    """Whether `manager`'s server-side applies own spec.replicas of the live object (metadata.managedFields)."""
    for entry in (obj.get("metadata") or {}).get("managedFields") or []:
        if entry.get("manager") == manager and entry.get("operation") == "Apply":
            if "f:replicas" in ((entry.get("fieldsV1") or {}).get("f:spec") or {}):
                return True
    return False


def replicas_handover(manifest: Object, live: Object) -> Object | None:
    """The handover manager's apply (just the live replica count) when `manifest` leaves spec.replicas to
    an autoscaler but the operator's earlier applies own it; None when there is nothing to hand over."""
    if manifest["kind"] not in WORKLOAD_KINDS or "replicas" in manifest["spec"]:
        return None
    count = (live.get("spec") or {}).get("replicas")
    if count is None or not applies_replicas(live):
        return None
    meta = manifest["metadata"]
    return {"apiVersion": manifest["apiVersion"], "kind": manifest["kind"],
            "metadata": {"name": meta["name"], "namespace": meta["namespace"]}, "spec": {"replicas": count}}


async def apply_children(api: KubeApi, uid: str | None, manifests: list[Object],
                         logger: logging.Logger | logging.LoggerAdapter) -> Applied:
    """Apply every child the endpoint (uid) owns or that does not exist yet; report the rest."""
    out = Applied()
    for manifest in manifests:
        kind, meta = kind_of(manifest), manifest["metadata"]
        try:
            live = await api.get(kind, meta["namespace"], meta["name"])
            if live is not None and not owned_by(live, uid):
                message = conflict_message(manifest["kind"], meta["namespace"], meta["name"], live)
                logger.warning("not applying %s", message)
                out.problems.append(Problem(NAME_CONFLICT, manifest["kind"], meta["name"], message))
                continue
            handover = replicas_handover(manifest, live) if live is not None else None
            if handover is not None:
                await _hand_over(api, handover, logger)
            await api.apply(manifest)
        except ApiError as e:
            # A real API server answers 404 to an apply only when the resource type is unknown.
            if e.status == 404 and kind.optional:
                logger.warning("skipping %s %s: the cluster does not serve %s (its CRD is not installed)",
                               manifest["kind"], meta["name"], manifest["apiVersion"])
                out.missing.add(manifest["kind"])
                continue
            logger.warning("could not apply %s %s: %s", manifest["kind"], meta["name"], e)
            out.problems.append(Problem(APPLY_FAILED, manifest["kind"], meta["name"],
                                        f"{manifest['kind']} {meta['name']}: {e.message}"))
    return out


async def create_once(api: KubeApi, kind: Kind, manifest: Object,
                      logger: logging.Logger | logging.LoggerAdapter) -> Problem | None:
    """Create `manifest` unless an object of its name exists (409: kept as it is, never read or changed); a
    refusal is reported like a failed apply."""
    meta = manifest["metadata"]
    try:
        await api.create(kind, manifest)
        logger.info("created %s %s", manifest["kind"], meta["name"])
    except ApiError as e:
        if e.status == 409:
            return None
        logger.warning("could not create %s %s: %s", manifest["kind"], meta["name"], e)
        return Problem(APPLY_FAILED, manifest["kind"], meta["name"], f"{manifest['kind']} {meta['name']}: {e.message}")
    return None


async def _hand_over(api: KubeApi, handover: Object, logger: logging.Logger | logging.LoggerAdapter) -> None:
    try:
        await api.apply(handover, field_manager=HANDOVER_MANAGER, force=False)
        logger.info("handed spec.replicas (%s) of %s %s over to the autoscaler", handover["spec"]["replicas"],
                    handover["kind"], handover["metadata"]["name"])
    except ApiError as e:
        if e.status != 409:
            raise
        # A conflict: another manager (the HPA) already set the field; it keeps it when the operator drops it.
