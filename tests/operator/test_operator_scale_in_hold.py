"""The scale-in hold, pure: which serving pods count as loading, and the ScaledObject's minimum they set."""

from __future__ import annotations

from typing import Any

from sluice_operator.reconcile import reconcile
from sluice_operator.scale_in_hold import hold_scale_in, replicas_to_hold
from sluice_operator.spec import parse_endpoint


def pod(*, ready: bool = False, serves: bool = True, restarts: int = 0, waiting: str | None = None,
        terminating: bool = False, phase: str = "Running") -> dict[str, Any]:
    state = {"waiting": {"reason": waiting}} if waiting else {"running": {}}
    meta: dict[str, Any] = {"labels": {"sluice.dev/serves": "true" if serves else "false"}}
    if terminating:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    return {"metadata": meta, "status": {
        "phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        "containerStatuses": [{"name": "engine", "restartCount": restarts, "state": state}]}}


def test_which_pods_hold() -> None:
    assert replicas_to_hold([]) is None
    assert replicas_to_hold([pod(ready=True), pod(ready=True)]) is None  # nothing loading: no hold
    assert replicas_to_hold([pod(ready=True), pod()]) == 2  # one loading: keep both
    assert replicas_to_hold([pod(), pod(serves=False)]) == 1  # an LWS worker: its leader stands for the group
    assert replicas_to_hold([pod(ready=True), pod(restarts=1)]) is None  # its load failed once: not held
    assert replicas_to_hold([pod(waiting="CrashLoopBackOff")]) is None
    assert replicas_to_hold([pod(waiting="ContainerCreating")]) == 1  # still starting
    assert replicas_to_hold([pod(terminating=True), pod(phase="Failed")]) is None
    # A rollout's surge pod (maxSurge 1: 2 ready + 1 new for 2 replicas) is not a replica to keep.
    assert replicas_to_hold([pod(ready=True), pod(ready=True), pod()], current=2) == 2


def test_hold_raises_the_minimum_within_the_maximum() -> None:
    ep = parse_endpoint({"apiVersion": "sluice.dev/v1alpha1", "kind": "InferenceEndpoint",
                         "metadata": {"name": "e", "namespace": "ns"},
                         "spec": {"model": {"uri": "hf://o/m"}, "scaling": {"minReplicas": 1, "maxReplicas": 3}}})

    def minimum(hold: int | None) -> int:
        so = next(m for m in hold_scale_in(ep, reconcile(ep), hold) if m["kind"] == "ScaledObject")
        return so["spec"]["minReplicaCount"]

    assert (minimum(None), minimum(0), minimum(2), minimum(7)) == (1, 1, 2, 3)
