"""status: the live children of an endpoint -> its status. Pure: the caller passes the objects and the clock.

Phases: Pending (no serving pod yet), Loading (pods exist, none ready: the model is loading), Ready (at least
one replica serves; Progressing says when more are coming), Idle (scaled to zero), Degraded (serving, but the
workload reports a failure), Failed (nothing serves and the workload reports a failure, or the spec is invalid).
"""

from __future__ import annotations

from typing import Any

from .config import OperatorConfig
from .meta import ENDPOINT_LABEL, POOL_LABEL
from .reconcile import service_url
from .spec import InferenceEndpoint

# Workload conditions that mean "this will not fix itself": a Deployment past its progress deadline, or pods
# the controller cannot create (quota, admission). Types other controllers (LWS) report are read the same way.
FAILURE_CONDITIONS = {("Progressing", "False", "ProgressDeadlineExceeded"), ("ReplicaFailure", "True", None)}

Object = dict[str, Any]


def condition(type_: str, status: str, reason: str, message: str, generation: int | None,
              previous: list[Object], now: str) -> Object:
    """A condition whose lastTransitionTime moves only when its status does."""
    old = next((c for c in previous if c.get("type") == type_), None)
    since = old.get("lastTransitionTime") if old and old.get("status") == status else None
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": since or now, "observedGeneration": generation}


def workload_failure(obj: Object | None) -> Object | None:
    """The workload's own condition that reports a failure, if any."""
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        for type_, status, reason in FAILURE_CONDITIONS:
            if c.get("type") == type_ and c.get("status") == status and reason in (None, c.get("reason")):
                return c
    return None


def _count(obj: Object | None, field: str) -> int:
    return int(((obj or {}).get("status") or {}).get(field) or 0)


def desired_replicas(ep: InferenceEndpoint, serving: Object | None) -> int:
    live = ((serving or {}).get("spec") or {}).get("replicas")
    if live is not None:  # the autoscaler's choice when scaling is set
        return int(live)
    fixed = ep.spec.fixed_replicas
    return 1 if fixed is None else fixed  # the API server defaults an unset count to 1


def _rollout_pending(serving: Object, desired: int) -> bool:
    meta, st = serving.get("metadata") or {}, serving.get("status") or {}
    stale = meta.get("generation") is not None and (st.get("observedGeneration") or 0) < meta["generation"]
    updated = st.get("updatedReplicas")
    return stale or (updated is not None and updated < desired)


def endpoint_status(ep: InferenceEndpoint, *, serving: Object | None, standby: Object | None = None,
                    scaled_object: Object | None = None, previous: Object | None = None, now: str,
                    cfg: OperatorConfig | None = None) -> Object:
    """The endpoint's status from its live serving workload (and warm pool, and KEDA ScaledObject)."""
    cfg = cfg or OperatorConfig()
    gen, prev = ep.metadata.generation, list((previous or {}).get("conditions") or [])
    desired, ready = desired_replicas(ep, serving), _count(serving, "readyReplicas")
    pods = _count(serving, "replicas")
    failure = workload_failure(serving)
    what = f"{ready}/{desired} replicas ready"

    if serving is None:
        phase, reason, message = "Pending", "WorkloadMissing", "the serving workload does not exist yet"
    elif desired == 0:
        phase, reason, message = "Idle", "ScaledToZero", "scaled to zero; a request brings a replica back"
    elif ready > 0:
        phase, reason, message = ("Degraded" if failure and ready < desired else "Ready"), "ReplicasReady", what
    elif failure:
        phase, reason, message = "Failed", failure.get("reason") or failure["type"], failure.get("message") or what
    elif pods > 0:
        phase, reason, message = "Loading", "ModelLoading", f"{what}: loading the model"
    else:
        phase, reason, message = "Pending", "NoPods", f"{what}: no pod created yet"

    serves = phase in ("Ready", "Degraded")
    conditions = [condition("Ready", "True" if serves else "False", reason, message, gen, prev, now)]
    if failure:
        progressing = ("False", failure.get("reason") or failure["type"], failure.get("message") or "")
    elif serving is not None and (ready < desired or _rollout_pending(serving, desired)):
        progressing = ("True", "RollingOut" if _rollout_pending(serving, desired) else "ScalingUp", what)
    else:
        progressing = ("False", "Complete", what)
    conditions.append(condition("Progressing", *progressing, gen, prev, now))
    if failure:
        degraded = ("True", failure.get("reason") or failure["type"], failure.get("message") or "")
    else:
        degraded = ("False", "AsExpected", "")
    conditions.append(condition("Degraded", *degraded, gen, prev, now))
    if ep.spec.scaling is not None:
        conditions.append(condition("AutoscalerReady", *_autoscaler(scaled_object), gen, prev, now))

    replicas: Object = {"desired": desired, "ready": ready}
    if ep.spec.scaling is not None and ep.spec.scaling.warm_pool is not None:
        replicas["standby"] = _count(standby, "readyReplicas")
    return {
        "observedGeneration": gen,
        "phase": phase,
        "url": service_url(ep, cfg),
        "replicas": replicas,
        "selector": f"{ENDPOINT_LABEL}={ep.name},{POOL_LABEL}=serving",
        "conditions": conditions,
    }


def _autoscaler(scaled_object: Object | None) -> tuple[str, str, str]:
    """KEDA's own Ready condition on the ScaledObject, passed through."""
    for c in ((scaled_object or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return (c.get("status") or "Unknown", c.get("reason") or "KedaReady", c.get("message") or "")
    return ("Unknown", "AwaitingKeda", "KEDA has not reported on the ScaledObject yet")


def invalid_status(generation: int | None, message: str, previous: Object | None, now: str) -> Object:
    """An endpoint the operator cannot serve as written: Failed, with the validation message."""
    prev = list((previous or {}).get("conditions") or [])
    return {
        "observedGeneration": generation,
        "phase": "Failed",
        "conditions": [condition("Ready", "False", "InvalidSpec", message, generation, prev, now)],
    }


def changed(new: Object, old: Object | None) -> bool:
    """Whether writing `new` changes anything (kopf's own bookkeeping under status.kopf is ignored)."""
    old = {k: v for k, v in (old or {}).items() if k != "kopf"}
    return any(old.get(k) != v for k, v in new.items())
