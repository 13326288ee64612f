"""Keeping the autoscaler from scaling in replicas that are still loading their model.

Loading a large model takes minutes of GPU time. Two things can throw that away before the replica has served:
- Scale-in below a loading replica. On a Deployment scale-in, the ReplicaSet deletes not-ready pods first
  (its ranking: unscheduled, pending, not ready, then pod-deletion-cost, ...), so a loading pod is always the
  first to go; `controller.kubernetes.io/pod-deletion-cost` only orders pods of the same readiness and
  cannot protect it.
- Scale to zero while the first replica loads: KEDA scales to zero once no trigger has been active for
  cooldownPeriod, whether or not the pod it started is ready (initialCooldownPeriod covers only the
  ScaledObject's creation).

The hold: while any serving replica is loading, the operator raises the ScaledObject's minReplicaCount to the
replicas that exist (ready + loading, at most the workload's current count), so neither the HPA nor KEDA's scale to zero goes below them; once they
are ready (or have failed), minReplicaCount returns to scaling.minReplicas and the usual scale-down delay
applies. A replica counts as loading while its pod answers HTTP (an LWS leader), is not terminating, not
Ready, and has not restarted or got stuck (CrashLoopBackOff, image pull): a replica that failed its load is
not held, so a broken one never pins GPUs.

NOTE: not a guarantee. The hold reaches the HPA through the operator (it follows workload events) and KEDA
(which reconciles the ScaledObject): a scale-in decided within those seconds still happens. The HPA's own
scale-down stabilization window (scaleDownDelaySeconds) covers the first minutes after a scale-up.
"""

from __future__ import annotations

from typing import Any

from .meta import SERVES_LABEL
from .spec import InferenceEndpoint
from .status import STUCK_REASONS

Object = dict[str, Any]


def _ready(pod: Object) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _failed_load(pod: Object) -> bool:
    st = pod.get("status") or {}
    for c in [*(st.get("initContainerStatuses") or []), *(st.get("containerStatuses") or [])]:
        if (c.get("restartCount") or 0) > 0:
            return True
        if ((c.get("state") or {}).get("waiting") or {}).get("reason") in STUCK_REASONS:
            return True
    return False


def replicas_to_hold(pods: list[Object], current: int | None = None) -> int | None:
    """Replicas the autoscaler must not go below (ready + loading, at most the workload's `current` count:
    a rollout's surge pod is not a replica to keep), or None when none is loading."""
    ready = loading = 0
    for pod in pods:
        meta, st = pod.get("metadata") or {}, pod.get("status") or {}
        if (meta.get("labels") or {}).get(SERVES_LABEL) != "true" or meta.get("deletionTimestamp"):
            continue  # an LWS worker (its leader stands for the group), or a pod on its way out
        if st.get("phase") in ("Succeeded", "Failed"):
            continue
        if _ready(pod):
            ready += 1
        elif not _failed_load(pod):
            loading += 1
    if not loading:
        return None
    return ready + loading if current is None else min(ready + loading, current)


def hold_scale_in(ep: InferenceEndpoint, manifests: list[Object], hold: int | None) -> list[Object]:
    """reconcile()'s manifests with the ScaledObject's minReplicaCount raised to `hold` (never above
    maxReplicaCount). reconcile() stays a function of the spec alone; this is the live state's part."""
    scaling = ep.spec.scaling
    if hold is None or scaling is None:
        return manifests
    for m in manifests:
        if m["kind"] == "ScaledObject" and m["metadata"]["name"] == ep.name:
            spec = m["spec"]
            spec["minReplicaCount"] = max(spec["minReplicaCount"], min(hold, scaling.max_replicas))
    return manifests
