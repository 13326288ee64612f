"""status: the live children of an endpoint -> its status, and the events worth posting. Pure: the caller passes
the objects (workloads, the ScaledObject, the serving pods) and the clock.

Phases: Pending (no serving pod yet, or none can be scheduled), Loading (pods run, none ready: the model is
loading), Ready (at least one replica serves; Progressing says when more are coming), Idle (scaled to zero),
Degraded (serving, but the workload reports a failure), Failed (nothing serves and the workload reports a
failure, a kind the endpoint needs is not installed, the spec is invalid, or the operator's policy forbids it).

Conditions, each with observedGeneration: Ready, ModelReady (the download, from the pods' fetch init containers
or the shared cache's Job, then the engines' model load), Scheduled (InsufficientCapacity when serving pods
cannot be placed), Progressing, Degraded, Reconciled (NameConflict or ApplyFailed when a child could not be
applied, with the API server's message), and with
`scaling`: AutoscalerReady, AutoscalerActive and AutoscalerFallback (KEDA's Ready, Active and Fallback); with
`adapters`: AdaptersReady (every adapter loaded on every ready serving replica, from what each replica's
/v1/models lists: engine_probe.py), beside status.adapters, one entry per adapter; with `routing.inferencePool`:
InferencePoolAccepted and InferencePoolResolvedRefs, the InferencePool's Accepted and ResolvedRefs conditions as
its parents (the Gateways that route to it) report them, folded into one each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .children import APPLY_FAILED, NAME_CONFLICT
from .children import Problem as ApplyProblem
from .config import OperatorConfig
from .meta import serving_selector
from .model_cache import WAIT_CONTAINER, CacheState
from .model_source import FETCH_CONTAINER
from .reconcile import endpoint_url
from .spec import InferenceEndpoint

# Workload conditions that mean "this will not fix itself": a Deployment past its progress deadline, or pods
# the controller cannot create (quota, admission). Types other controllers (LWS) report are read the same way.
FAILURE_CONDITIONS = {("Progressing", "False", "ProgressDeadlineExceeded"), ("ReplicaFailure", "True", None)}
# Container waiting reasons that mean the engine will not come up by waiting.
STUCK_REASONS = ("CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName",
                 "CreateContainerConfigError", "CreateContainerError")
# Where each optional kind comes from, for the message when the cluster does not serve it.
PROVIDERS = {
    "LeaderWorkerSet": "LeaderWorkerSet (kubernetes-sigs/lws; multi-node layouts need it)",
    "ScaledObject": "KEDA (keda.sh; `scaling` needs it)",
    "ServiceMonitor": "the Prometheus operator (monitoring.coreos.com)",
    "PrometheusRule": "the Prometheus operator (monitoring.coreos.com)",
    "InferencePool": "the Gateway API Inference Extension's CRDs (inference.networking.k8s.io; "
                     "docs/gateway-api.md)",
    "HTTPRoute": "the Gateway API's CRDs (gateway.networking.k8s.io; docs/gateway-api.md)",
}
POOL_CONDITIONS = {"Accepted": "InferencePoolAccepted", "ResolvedRefs": "InferencePoolResolvedRefs"}
KEDA_CONDITIONS = {"Ready": "AutoscalerReady", "Active": "AutoscalerActive", "Fallback": "AutoscalerFallback"}

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


# -- the serving pods -------------------------------------------------------------------------------------
def _pod_condition(pod: Object, type_: str) -> Object | None:
    return next((c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == type_), None)


@dataclass
class Pods:
    """What the serving pods say about scheduling and the model load."""

    total: int = 0
    unschedulable: list[Object] = field(default_factory=list)  # PodScheduled=False, reason Unschedulable
    unplaced: int = 0  # not scheduled yet, no verdict from the scheduler either
    downloading: int = 0  # the fetch-model init container runs, or wait-for-model (the shared cache's Job)
    stuck: tuple[str, str] | None = None  # (reason, message) of a container that will not start by waiting

    @property
    def scheduled(self) -> int:
        return self.total - len(self.unschedulable) - self.unplaced


def summarize_pods(pods: list[Object]) -> Pods:
    out = Pods()
    for pod in pods:
        st = pod.get("status") or {}
        if (pod.get("metadata") or {}).get("deletionTimestamp") or st.get("phase") in ("Succeeded", "Failed"):
            continue  # on its way out: a rollout's old pod, an evicted one
        out.total += 1
        sched = _pod_condition(pod, "PodScheduled")
        if sched is None or sched.get("status") != "True":
            if sched is not None and sched.get("status") == "False" and sched.get("reason") == "Unschedulable":
                out.unschedulable.append(pod)
            else:
                out.unplaced += 1
            continue
        for c in st.get("initContainerStatuses") or []:
            if c.get("name") in (FETCH_CONTAINER, WAIT_CONTAINER) and "running" in (c.get("state") or {}):
                out.downloading += 1
        for c in [*(st.get("initContainerStatuses") or []), *(st.get("containerStatuses") or [])]:
            waiting = (c.get("state") or {}).get("waiting") or {}
            if out.stuck is None and waiting.get("reason") in STUCK_REASONS:
                name = (pod.get("metadata") or {}).get("name", "?")
                out.stuck = (waiting["reason"], f"pod {name}, container {c.get('name')}: "
                                                f"{waiting.get('message') or waiting['reason']}")
    return out


def _unschedulable_message(pods: Pods) -> str:
    first = _pod_condition(pods.unschedulable[0], "PodScheduled") or {}
    n = len(pods.unschedulable)
    head = f"{n} of {pods.total} serving pod{'s' if pods.total != 1 else ''} cannot be scheduled"
    return f"{head}: {first.get('message')}" if first.get("message") else head


# -- the status -------------------------------------------------------------------------------------------
def endpoint_status(ep: InferenceEndpoint, *, serving: Object | None, standby: Object | None = None,
                    prefill: Object | None = None,
                    scaled_object: Object | None = None, pods: list[Object] | None = None,
                    missing_kinds: frozenset[str] | set[str] = frozenset(),
                    problems: Sequence[ApplyProblem] = (), previous: Object | None = None,
                    now: str, cfg: OperatorConfig | None = None, model_cache: CacheState | None = None,
                    adapters: Mapping[str, frozenset[str] | str] | None = None,
                    inference_pool: Object | None = None) -> Object:
    """The endpoint's status from its live serving workload, warm pool, KEDA ScaledObject and serving pods.

    `pods` None: the pods were not read (the workload's counts stand in for them; Scheduled is Unknown).
    `missing_kinds`: kinds the endpoint needs that the cluster does not serve (their CRD is not installed).
    `problems`: children the last pass could not apply. A NameConflict fails the endpoint (its objects'
    names are someone else's until a person acts); an ApplyFailed degrades it while replicas still serve.
    `model_cache`: the shared model cache's state, when the endpoint uses one (cache_sync.observe).
    `adapters`: what each ready serving pod's /v1/models lists, or why it could not be asked (engine_probe.py);
    None: not asked.
    `prefill`: a disaggregated endpoint's prefill workload. The endpoint serves once a decode (serving) replica
    is ready: a decode engine computes prompts itself while no prefill replica is.
    `inference_pool`: the live InferencePool (spec.routing.inferencePool), None where it does not exist (yet).
    """
    cfg = cfg or OperatorConfig()
    gen, prev = ep.metadata.generation, list((previous or {}).get("conditions") or [])
    desired, ready = desired_replicas(ep, serving), _count(serving, "readyReplicas")
    seen = summarize_pods(pods) if pods is not None else None
    started = seen.total if seen is not None else _count(serving, "replicas")
    failure = workload_failure(serving)
    if failure and failure.get("reason") == "ProgressDeadlineExceeded" and seen is not None and seen.downloading:
        # The Deployment's progress deadline counts the download too; a download still running has not failed.
        failure = None
    downloading = model_cache is not None and not model_cache.complete
    standby_ready = _count(standby, "readyReplicas")
    what = f"{ready}/{desired} replicas ready"
    conflicts = [p for p in problems if p.reason == NAME_CONFLICT]
    apply_failed = [p for p in problems if p.reason != NAME_CONFLICT]

    if conflicts:
        phase, reason, message = "Failed", NAME_CONFLICT, "; ".join(p.message for p in conflicts)
    elif apply_failed and ready == 0:
        phase, reason, message = "Failed", APPLY_FAILED, "; ".join(p.message for p in apply_failed)
    elif serving is None and "LeaderWorkerSet" in missing_kinds:
        phase, reason = "Failed", "LeaderWorkerSetNotInstalled"
        message = f"the cluster does not serve LeaderWorkerSets: install {PROVIDERS['LeaderWorkerSet']}"
    elif serving is None:
        phase, reason, message = "Pending", "WorkloadMissing", "the serving workload does not exist yet"
    elif downloading and ready == 0:  # the workloads are held at zero until the shared cache is complete
        assert model_cache is not None
        phase, reason = ("Failed", "DownloadFailed") if model_cache.failed else ("Loading", "Downloading")
        message = model_cache.message
    elif desired == 0:
        phase, reason = "Idle", "ScaledToZero"
        message = "scaled to zero; a request brings a replica back"
        if standby_ready:
            message += f" ({standby_ready} warm-pool pod{'s' if standby_ready != 1 else ''} ready meanwhile)"
    elif ready > 0:
        degraded = (failure and ready < desired) or apply_failed
        phase, reason, message = ("Degraded" if degraded else "Ready"), "ReplicasReady", what
    elif failure:
        phase, reason, message = "Failed", failure.get("reason") or failure["type"], failure.get("message") or what
    elif seen is not None and seen.unschedulable and seen.scheduled == 0:
        phase, reason, message = "Pending", "InsufficientCapacity", _unschedulable_message(seen)
    elif seen is not None and seen.stuck:
        phase, (reason, message) = "Loading", seen.stuck
    elif seen is not None and seen.downloading and seen.downloading == seen.scheduled:
        phase, reason, message = "Loading", "Downloading", f"{what}: fetching the model into the cache"
    elif started > 0 and (seen is None or seen.scheduled > 0):
        phase, reason, message = "Loading", "ModelLoading", f"{what}: loading the model"
    elif started > 0:
        phase, reason, message = "Pending", "AwaitingScheduler", f"{what}: pods are waiting to be scheduled"
    else:
        phase, reason, message = "Pending", "NoPods", f"{what}: no pod created yet"

    serves = phase in ("Ready", "Degraded")
    split = ep.spec.disaggregation
    prefill_counts, ready_message = None, message
    if split is not None:  # (desired, ready) of the prefill pool
        live = ((prefill or {}).get("spec") or {}).get("replicas")
        fixed = split.prefill.fixed_replicas
        prefill_counts = (int(live) if live is not None else (1 if fixed is None else fixed),
                          _count(prefill, "readyReplicas"))
        if serves and prefill_counts[1] < prefill_counts[0]:
            ready_message += (f"; {prefill_counts[1]}/{prefill_counts[0]} prefill replicas ready (decode engines compute "
                              "prompts themselves meanwhile)")
    conditions = [condition("Ready", "True" if serves else "False", reason, ready_message, gen, prev, now)]
    conditions.append(condition("ModelReady", *_model_ready(phase, reason, message, ready, desired), gen, prev, now))
    conditions.append(condition("Scheduled", *_scheduled(seen, desired), gen, prev, now))
    if failure:
        progressing = ("False", failure.get("reason") or failure["type"], failure.get("message") or "")
    elif serving is not None and (ready < desired or _rollout_pending(serving, desired)):
        progressing = ("True", "RollingOut" if _rollout_pending(serving, desired) else "ScalingUp", what)
    else:
        progressing = ("False", "Complete", what)
    conditions.append(condition("Progressing", *progressing, gen, prev, now))
    if failure:
        degraded_state = ("True", failure.get("reason") or failure["type"], failure.get("message") or "")
    elif apply_failed:
        degraded_state = ("True", APPLY_FAILED, "; ".join(p.message for p in apply_failed))
    else:
        degraded_state = ("False", "AsExpected", "")
    conditions.append(condition("Degraded", *degraded_state, gen, prev, now))
    conditions.append(condition("Reconciled", *_reconciled(problems), gen, prev, now))
    if ep.spec.scaling is not None:
        for keda_type, type_ in KEDA_CONDITIONS.items():
            state = _keda(scaled_object, keda_type, "ScaledObject" in missing_kinds)
            conditions.append(condition(type_, *state, gen, prev, now))

    if ep.spec.routing is not None and ep.spec.routing.inference_pool is not None:
        for pool_type, type_ in POOL_CONDITIONS.items():
            state = pool_condition(inference_pool, pool_type, "InferencePool" in missing_kinds)
            conditions.append(condition(type_, *state, gen, prev, now))

    listed = adapter_status(ep, adapters)
    if listed is not None:
        conditions.append(condition("AdaptersReady", *adapters_ready(listed, adapters), gen, prev, now))

    replicas: Object = {"desired": desired, "ready": ready}
    if ep.spec.scaling is not None and ep.spec.scaling.warm_pool is not None:
        replicas["standby"] = standby_ready
    if prefill_counts is not None:
        replicas["prefillDesired"], replicas["prefillReady"] = prefill_counts
    return {
        "observedGeneration": gen,
        "phase": phase,
        "url": endpoint_url(ep, cfg),
        "replicas": replicas,
        "selector": serving_selector(ep),
        "conditions": conditions,
        **({"adapters": listed} if listed is not None else {}),
    }


# -- LoRA adapters ------------------------------------------------------------------------------------------
SHOWN_PODS = 3  # pods named in an adapter's message


def _names(pods: list[str]) -> str:
    more = f" and {len(pods) - SHOWN_PODS} more" if len(pods) > SHOWN_PODS else ""
    return ", ".join(pods[:SHOWN_PODS]) + more


def adapter_status(ep: InferenceEndpoint, probes: Mapping[str, frozenset[str] | str] | None) -> list[Object] | None:
    """status.adapters: per adapter of the spec, whether every ready serving replica has it loaded. None
    without adapters. `probes`: ready pod -> the model ids it lists, or why it could not be asked."""
    if not ep.spec.adapters:
        return None
    answered = {pod: ids for pod, ids in sorted((probes or {}).items()) if not isinstance(ids, str)}
    unasked = {pod: why for pod, why in sorted((probes or {}).items()) if isinstance(why, str)}
    total = len(answered) + len(unasked)
    out = []
    for adapter in ep.spec.adapters:
        on = [pod for pod, ids in answered.items() if adapter.name in ids]
        missing = [pod for pod in answered if pod not in on]
        if probes is None:
            message = "not observed: the operator may not read the serving pods"
        elif total == 0:
            message = "no ready serving replica"
        else:
            message = f"loaded on {len(on)}/{total} ready replicas"
            if missing:
                # Still downloading (the fetch-adapters sidecars' logs), the kubelet not yet showing the pod the
                # new ConfigMap, or refused by the engine (rank, shapes: its log says why).
                message += f"; not on {_names(missing)} yet"
            if unasked:
                pod, why = next(iter(unasked.items()))
                message += f"; could not ask {_names(list(unasked))} ({pod}: {why})"
        out.append({"name": adapter.name, "loaded": total > 0 and len(on) == total, "loadedReplicas": len(on),
                    "message": message})
    return out


def adapters_pending(status: Object | None) -> bool:
    """Whether the status says some ready replica has not (or may not have) loaded an adapter yet: the resync
    asks the engines again (handlers.py). Not while no replica is ready: pod events bring the next pass."""
    cond = next((c for c in (status or {}).get("conditions") or [] if c.get("type") == "AdaptersReady"), None)
    return cond is not None and cond.get("reason") in ("AdaptersLoading", "ReplicasNotAsked")


def adapters_ready(listed: list[Object], probes: Mapping[str, frozenset[str] | str] | None) -> tuple[str, str, str]:
    """The AdaptersReady condition: (status, reason, message)."""
    if probes is None:
        return "Unknown", "PodsNotObserved", "the serving pods were not read"
    if not probes:
        return "False", "NoReadyReplicas", "no ready serving replica to load the adapters"
    waiting = [a for a in listed if not a["loaded"]]
    if not waiting:
        return "True", "AdaptersLoaded", f"{len(listed)} adapter(s) loaded on every ready replica ({len(probes)})"
    message = "; ".join(f"{a['name']}: {a['message']}" for a in waiting)
    answered = sum(not isinstance(ids, str) for ids in probes.values())
    if all(a["loadedReplicas"] == answered for a in waiting):  # on every replica that answered
        return "Unknown", "ReplicasNotAsked", message
    return "False", "AdaptersLoading", message


def _reconciled(problems: Sequence[ApplyProblem]) -> tuple[str, str, str]:
    if not problems:
        return "True", "Applied", "every object of the endpoint is applied"
    first = next((p for p in problems if p.reason == NAME_CONFLICT), problems[0])
    return "False", first.reason, "; ".join(p.message for p in problems)


def _model_ready(phase: str, reason: str, message: str, ready: int, desired: int) -> tuple[str, str, str]:
    if ready > 0:
        return "True", "ModelLoaded", f"{ready}/{desired} serving replicas have the model loaded"
    if phase == "Loading" or reason == "DownloadFailed":  # ModelLoading, Downloading, a stuck container, ...
        return "False", reason, message
    if phase == "Idle":
        return "False", "ScaledToZero", message
    return "False", "NoPodsRunning", message


def _scheduled(seen: Pods | None, desired: int) -> tuple[str, str, str]:
    if seen is None:
        return "Unknown", "PodsNotObserved", "the serving pods were not read"
    if seen.unschedulable:
        return "False", "InsufficientCapacity", _unschedulable_message(seen)
    if seen.unplaced:
        return "Unknown", "AwaitingScheduler", f"{seen.unplaced} serving pod(s) waiting for the scheduler"
    if seen.total:
        return "True", "PodsScheduled", f"{seen.total} serving pod(s) scheduled"
    if desired == 0:
        return "True", "ScaledToZero", "no serving pod is wanted"
    return "Unknown", "NoPods", "no serving pod exists yet"


def _keda(scaled_object: Object | None, keda_type: str, missing: bool) -> tuple[str, str, str]:
    """KEDA's own condition of that type on the ScaledObject, passed through with its reason."""
    if missing:
        return "False" if keda_type == "Ready" else "Unknown", "KedaNotInstalled", (
            f"the cluster does not serve ScaledObjects: install {PROVIDERS['ScaledObject']}")
    status = (scaled_object or {}).get("status") or {}
    for c in status.get("conditions") or []:
        if c.get("type") == keda_type:
            state = c.get("status") or "Unknown"
            reason = c.get("reason") or ("AwaitingKeda" if state == "Unknown" else f"Keda{keda_type}{state}")
            message = c.get("message") or ""
            if keda_type == "Fallback" and state == "True":
                failing = [f"{name} ({h.get('numberOfFailures', '?')} failures)"
                           for name, h in sorted((status.get("health") or {}).items())
                           if (h or {}).get("status") == "Failing"]
                if failing:
                    message = f"{message}; failing triggers: {', '.join(failing)}".lstrip("; ")
            return state, reason, message
    return "Unknown", "AwaitingKeda", f"KEDA has not reported {keda_type} on the ScaledObject yet"


def _parent_name(parent: Object) -> str:
    ref = parent.get("parentRef") or {}
    where = f"{ref['namespace']}/" if ref.get("namespace") else ""
    return f"{ref.get('kind') or 'Gateway'} {where}{ref.get('name', '?')}"


def pool_condition(pool: Object | None, pool_type: str, missing: bool) -> tuple[str, str, str]:
    """One of the InferencePool's conditions (Accepted, ResolvedRefs) over all its parents: False when any parent
    says False (its reason; every such parent's message), True when every parent says True, else Unknown."""
    if missing:
        return "False", "InferencePoolNotInstalled", (
            f"the cluster does not serve InferencePools: install {PROVIDERS['InferencePool']}")
    if pool is None:
        return "Unknown", "InferencePoolMissing", "the InferencePool does not exist yet"
    parents = ((pool.get("status") or {}).get("parents")) or []
    if not parents:
        return "Unknown", "NoParents", ("no gateway has reported on the InferencePool yet: an HTTPRoute attached to "
                                        "a Gateway of an Inference Extension implementation must reference it")
    states = []
    for parent in parents:
        c = next((c for c in parent.get("conditions") or [] if c.get("type") == pool_type), None)
        states.append((_parent_name(parent), c or {}))
    failed = [(name, c) for name, c in states if c.get("status") == "False"]
    if failed:
        message = "; ".join(f"{name}: {c.get('message') or c.get('reason') or 'False'}" for name, c in failed)
        return "False", failed[0][1].get("reason") or f"Not{pool_type}", message
    if all(c.get("status") == "True" for _, c in states):
        names = ", ".join(name for name, _ in states)
        return "True", states[0][1].get("reason") or pool_type, f"{pool_type} by {names}"
    pending = [(name, c) for name, c in states if c.get("status") != "True"]
    message = "; ".join(f"{name}: {c.get('message') or 'not reported yet'}" for name, c in pending)
    return "Unknown", pending[0][1].get("reason") or "Pending", message


def invalid_status(generation: int | None, message: str, previous: Object | None, now: str,
                   reason: str = "InvalidSpec") -> Object:
    """An endpoint the operator cannot serve as written: Failed, with the validation message. `reason`:
    InvalidSpec (the spec does not validate), PolicyViolation (the operator's policy forbids it) or
    ScaleToZeroNeedsGateway (only the operator's settings rule it out)."""
    prev = list((previous or {}).get("conditions") or [])
    return {
        "observedGeneration": generation,
        "phase": "Failed",
        "conditions": [condition("Ready", "False", reason, message, generation, prev, now)],
    }


# Status fields written only while they apply: a status without one drops it from the stored status.
OPTIONAL_FIELDS = ("adapters",)


def status_patch(new: Object, old: Object | None) -> Object:
    """The merge patch that makes the stored status `new`: `new`, with null for each optional field it no longer
    has (a merge patch keeps a key it does not name)."""
    return {**new, **{k: None for k in OPTIONAL_FIELDS if k not in new and (old or {}).get(k) is not None}}


def changed(new: Object, old: Object | None) -> bool:
    """Whether writing `new` changes anything (kopf's own bookkeeping under status.kopf is ignored)."""
    old = {k: v for k, v in (old or {}).items() if k != "kopf"}
    return any(old.get(k) != v for k, v in status_patch(new, old).items())


# -- events -------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


def _cond(status: Object | None, type_: str) -> Object:
    return next((c for c in (status or {}).get("conditions") or [] if c.get("type") == type_), {})


def transitions(old: Object | None, new: Object) -> list[Event]:
    """The Kubernetes events a status change is worth: a new phase; serving pods that cannot be scheduled; a
    container stuck (image pull, crash loop); the autoscaler falling back to its outage count, and back."""
    events = []
    phase = new.get("phase")
    if phase != (old or {}).get("phase"):
        ready = _cond(new, "Ready")
        kind = "Warning" if phase in ("Degraded", "Failed") else "Normal"
        events.append(Event(kind, str(phase), ready.get("message") or ready.get("reason") or ""))

    def became(type_: str, status: str, reasons: tuple[str, ...] | None = None) -> Object | None:
        now, before = _cond(new, type_), _cond(old, type_)
        if now.get("status") != status or (reasons is not None and now.get("reason") not in reasons):
            return None
        if before.get("status") == status and before.get("reason") == now.get("reason"):
            return None
        return now

    if c := became("Scheduled", "False", ("InsufficientCapacity",)):
        events.append(Event("Warning", "InsufficientCapacity", c.get("message") or ""))
    if c := became("ModelReady", "False", STUCK_REASONS):
        events.append(Event("Warning", c["reason"], c.get("message") or ""))
    if c := became("Reconciled", "False"):
        events.append(Event("Warning", c["reason"], c.get("message") or ""))
    if c := became("InferencePoolAccepted", "False"):
        events.append(Event("Warning", "InferencePoolNotAccepted", c.get("message") or c.get("reason") or ""))
    if c := became("AutoscalerFallback", "True"):
        events.append(Event("Warning", "AutoscalerFallback", c.get("message") or c.get("reason") or ""))
    elif _cond(old, "AutoscalerFallback").get("status") == "True" and \
            _cond(new, "AutoscalerFallback").get("status") == "False":
        events.append(Event("Normal", "AutoscalerRecovered", "the autoscaler reads its metrics again"))
    return events
