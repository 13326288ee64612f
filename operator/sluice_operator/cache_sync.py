"""The operator's I/O for shared model caches (model_cache.py says what they are): read their state, create
them once, co-own them, and let go of the ones an endpoint no longer uses.

Shared objects are never server-side applied: a Job's pod template is immutable, a claim cannot shrink, and
several endpoints would fight over one field manager's ownerReferences. So each is created if absent, and each
endpoint adds its own ownerReference with a strategic merge patch (entries merged by uid: concurrent writers
never remove each other's).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .apply import POD_KIND, STRATEGIC_CONTENT_TYPE, ApiError, Kind, KubeApi
from .meta import MANAGED_BY
from .model_cache import (
    COMPLETE_ANNOTATION,
    COMPONENT,
    MODEL_CACHE_LABEL,
    CacheState,
    cache_key,
    cache_state,
    claim_complete,
    job_complete,
    shared_cache_name,
    sharing_reference,
    uses_shared_cache,
)
from .model_source import FETCH_CONTAINER
from .spec import InferenceEndpoint

CLAIM_KIND = Kind("v1", "PersistentVolumeClaim", "persistentvolumeclaims")
JOB_KIND = Kind("batch/v1", "Job", "jobs")
SHARED_KINDS = {(k.api_version, k.kind): k for k in (CLAIM_KIND, JOB_KIND)}
SHARED_SELECTOR = {"app.kubernetes.io/component": COMPONENT, "app.kubernetes.io/managed-by": MANAGED_BY}
LOG_TAIL_LINES = 20
WORKLOAD_KINDS = (Kind("apps/v1", "Deployment", "deployments"),
                  Kind("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "leaderworkersets"))

Logger = logging.Logger | logging.LoggerAdapter


@dataclass(frozen=True, slots=True)
class SharedCache:
    state: CacheState
    hold: bool  # keep the workloads at zero: the download is not complete and nothing serves yet


def is_shared(manifest: dict[str, Any]) -> bool:
    return (manifest["apiVersion"], manifest["kind"]) in SHARED_KINDS and \
        MODEL_CACHE_LABEL in (manifest["metadata"].get("labels") or {})


async def observe(api: KubeApi, ep: InferenceEndpoint, logger: Logger) -> SharedCache | None:
    """The endpoint's shared cache as it is now; None without one. Records a finished download on the claim."""
    if not uses_shared_cache(ep):
        return None
    name = shared_cache_name(ep.spec.model)
    claim, job = await api.get(CLAIM_KIND, ep.namespace, name), await api.get(JOB_KIND, ep.namespace, name)
    log = None
    if claim is not None and not claim_complete(claim) and job_complete(job):
        # The claim, not the Job, remembers: a deleted Job is then never run again.
        await api.patch(CLAIM_KIND, ep.namespace, name, {"metadata": {"annotations": {COMPLETE_ANNOTATION: "true"}}})
        logger.info("model cache %s complete (%s)", name, ep.spec.model.uri)
        claim = {**claim, "metadata": {**claim["metadata"], "annotations": {
            **(claim["metadata"].get("annotations") or {}), COMPLETE_ANNOTATION: "true"}}}
    elif job is not None and not claim_complete(claim):
        log = await _fetch_log(api, ep.namespace, cache_key(ep.spec.model))
    state = cache_state(name, claim, job, log)
    return SharedCache(state, hold=not state.complete and not await _serving(api, ep))


async def _fetch_log(api: KubeApi, namespace: str, key: str) -> str | None:
    """The newest fetch pod's last log lines (its progress), or None."""
    try:
        pods = await api.list(POD_KIND, namespace, {MODEL_CACHE_LABEL: key}) or []
    except ApiError:
        return None
    if not pods:
        return None
    newest = max(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "")
    return await api.read_log(namespace, newest["metadata"]["name"], FETCH_CONTAINER, LOG_TAIL_LINES)


async def _serving(api: KubeApi, ep: InferenceEndpoint) -> bool:
    """Whether the endpoint's serving workload has a ready replica (a live endpoint switched to a shared cache
    keeps serving from its old pods while the new ones wait for the download)."""
    for kind in WORKLOAD_KINDS:
        try:
            live = await api.get(kind, ep.namespace, ep.name)
        except ApiError:
            continue
        if live and int((live.get("status") or {}).get("readyReplicas") or 0) > 0:
            return True
    return False


async def ensure(api: KubeApi, manifest: dict[str, Any], cache: SharedCache | None, logger: Logger) -> None:
    """Create the shared object if absent, else add this endpoint's ownerReference to it."""
    kind = SHARED_KINDS[manifest["apiVersion"], manifest["kind"]]
    meta = manifest["metadata"]
    live = await api.get(kind, meta["namespace"], meta["name"])
    if live is None:
        if kind is JOB_KIND and cache is not None and cache.state.complete:
            return  # the claim holds the model: the download never runs again
        try:
            await api.create(kind, manifest)
            logger.info("created %s %s for %s", kind.kind, meta["name"], meta["annotations"])
            return
        except ApiError as e:
            if e.status != 409:  # 409: another endpoint's pass created it meanwhile
                raise
    (ref,) = meta["ownerReferences"]
    if live is not None and any(r.get("uid") == ref["uid"] for r in live["metadata"].get("ownerReferences") or []):
        return
    await api.patch(kind, meta["namespace"], meta["name"], {"metadata": {"ownerReferences": [ref]}},
                    STRATEGIC_CONTENT_TYPE)


async def release_unused(api: KubeApi, ep: InferenceEndpoint, manifests: list[dict[str, Any]],
                         logger: Logger) -> None:
    """Let go of the shared objects this endpoint co-owns but no longer uses: drop its ownerReference, or
    delete the object when it is the last owner (the garbage collector ignores an object with no owners)."""
    uid = ep.metadata.uid
    if not uid:
        return
    wanted = {(m["kind"], m["metadata"]["name"]) for m in manifests if is_shared(m)}
    ours = sharing_reference(ep)
    for kind in SHARED_KINDS.values():
        for obj in await api.list(kind, ep.namespace, SHARED_SELECTOR) or []:
            meta = obj["metadata"]
            refs = meta.get("ownerReferences") or []
            if (kind.kind, meta["name"]) in wanted or not any(r.get("uid") == uid for r in refs):
                continue
            if all(r.get("uid") == uid for r in refs):
                if await api.delete_unchanged(kind, ep.namespace, meta["name"], meta.get("resourceVersion", "")):
                    logger.info("deleted %s %s: %s was its last user", kind.kind, meta["name"], ours["name"])
                continue  # changed meanwhile (another endpoint took it up): the next pass looks again
            await api.patch(kind, ep.namespace, meta["name"],
                            {"metadata": {"ownerReferences": [{"$patch": "delete", "uid": uid}]}},
                            STRATEGIC_CONTENT_TYPE)
            logger.info("%s no longer uses %s %s", ours["name"], kind.kind, meta["name"])
