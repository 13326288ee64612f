"""The Argo CD health check (charts/sluice/argocd/health.lua), run in Lua 5.1 as Argo CD's gopher-lua is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

lupa = pytest.importorskip("lupa", reason="lupa (dev extra) runs the Argo CD Lua health check")

ROOT = Path(__file__).parents[2]
HEALTH_LUA = ROOT / "charts" / "sluice" / "argocd" / "health.lua"


def _runtime() -> Any:
    try:  # Argo CD runs health scripts in gopher-lua, a Lua 5.1: test in the same dialect when we can.
        from lupa import lua51

        return lua51.LuaRuntime(unpack_returned_tuples=True)
    except ImportError:
        return lupa.LuaRuntime(unpack_returned_tuples=True)


def health(obj: dict[str, Any]) -> dict[str, Any]:
    lua = _runtime()
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute(HEALTH_LUA.read_text())
    return dict(result.items())


def endpoint(status: dict[str, Any] | None = None, generation: int = 3) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "sluice.dev/v1alpha1",
        "kind": "InferenceEndpoint",
        "metadata": {"name": "llama", "namespace": "ml", "generation": generation},
        "spec": {"model": {"uri": "hf://org/model"}},
    }
    if status is not None:
        obj["status"] = status
    return obj


def cond(ctype: str, status: str, reason: str | None = None, message: str | None = None) -> dict[str, Any]:
    c = {"type": ctype, "status": status, "observedGeneration": 3}
    if reason is not None:
        c["reason"] = reason
    if message is not None:
        c["message"] = message
    return c


@pytest.mark.parametrize(("phase", "expected"), [
    ("Ready", "Healthy"),
    ("Idle", "Healthy"),
    ("Pending", "Progressing"),
    ("Loading", "Progressing"),
    ("Progressing", "Progressing"),
    ("Degraded", "Degraded"),
    ("Failed", "Degraded"),
])
def test_phase_maps_to_health(phase: str, expected: str) -> None:
    hs = health(endpoint({"phase": phase, "observedGeneration": 3}))
    assert hs["status"] == expected
    assert hs["message"]


def test_missing_status_is_progressing() -> None:
    assert health(endpoint())["status"] == "Progressing"
    assert health(endpoint({}))["status"] == "Progressing"
    assert health(endpoint({"conditions": [cond("Ready", "Unknown")]}))["status"] == "Progressing"


def test_ready_message_names_the_url() -> None:
    hs = health(endpoint({"phase": "Ready", "observedGeneration": 3, "url": "http://llama.ml.svc.cluster.local/v1"}))
    assert hs == {"status": "Healthy", "message": "Serving at http://llama.ml.svc.cluster.local/v1"}


def test_idle_says_scaled_to_zero() -> None:
    assert "zero" in health(endpoint({"phase": "Idle", "observedGeneration": 3}))["message"]


def test_degraded_carries_the_degraded_condition_message() -> None:
    hs = health(endpoint({"phase": "Degraded", "observedGeneration": 3, "conditions": [
        cond("Ready", "True", "Serving", "2/3 replicas ready"),
        cond("Degraded", "True", "ReplicasUnavailable", "1 of 3 replicas is not ready"),
    ]}))
    assert hs == {"status": "Degraded", "message": "ReplicasUnavailable: 1 of 3 replicas is not ready"}


def test_failed_falls_back_to_the_ready_condition() -> None:
    hs = health(endpoint({"phase": "Failed", "observedGeneration": 3, "conditions": [
        cond("Ready", "False", "ModelNotFound", "hf://org/model: repository not found"),
        cond("Degraded", "False"),
    ]}))
    assert hs["status"] == "Degraded"
    assert hs["message"] == "ModelNotFound: hf://org/model: repository not found"


def test_pending_explains_unschedulable_pods() -> None:
    hs = health(endpoint({"phase": "Pending", "observedGeneration": 3, "conditions": [
        cond("Scheduled", "False", "InsufficientCapacity", "0/4 nodes have 8 free nvidia.com/gpu"),
    ]}))
    assert hs["status"] == "Progressing"
    assert hs["message"] == "Scheduled: InsufficientCapacity: 0/4 nodes have 8 free nvidia.com/gpu"


def test_failed_without_conditions_still_has_a_message() -> None:
    assert health(endpoint({"phase": "Failed"})) == {"status": "Degraded", "message": "Failed"}


def test_stale_status_is_progressing() -> None:
    # The spec changed (generation 4) but the status still describes generation 3: not Healthy yet.
    hs = health(endpoint({"phase": "Ready", "observedGeneration": 3}, generation=4))
    assert hs["status"] == "Progressing"
    assert "generation 4" in hs["message"]


def test_unknown_phase_is_unknown() -> None:
    assert health(endpoint({"phase": "Exploded", "observedGeneration": 3}))["status"] == "Unknown"


def test_statuses_the_operator_writes():
    """The operator's own status (endpoint_status) through the health check, for the states users ask about."""
    from sluice_operator.spec import parse_endpoint
    from sluice_operator.status import endpoint_status

    ep = parse_endpoint({**endpoint(), "metadata": {"name": "llama", "namespace": "ml", "generation": 3},
                         "spec": {"model": {"uri": "hf://org/model"},
                                  "scaling": {"minReplicas": 0, "maxReplicas": 2}}})
    unschedulable = {"metadata": {"name": "llama-1"}, "status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}]}}
    cases = [
        (dict(serving={"spec": {"replicas": 1}, "status": {"replicas": 1}}, pods=[unschedulable]), "Progressing",
         "InsufficientCapacity: 1 of 1 serving pod cannot be scheduled: 0/4 nodes are available: "
         "4 Insufficient nvidia.com/gpu."),
        (dict(serving={"spec": {"replicas": 0}, "status": {}}, pods=[]), "Healthy",
         "Scaled to zero; starts on the next request"),
        (dict(serving={"spec": {"replicas": 1}, "status": {"replicas": 1, "readyReplicas": 1}}, pods=[]),
         "Healthy", None),
    ]
    for observed, status, message in cases:
        hs = health(endpoint(endpoint_status(ep, now="2025-01-01T00:00:00Z", **observed)))
        assert hs["status"] == status, hs
        if message is not None:
            assert hs["message"] == message
