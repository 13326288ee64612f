"""The periodic resync (drift.py, handlers.resync_round): endpoints at rest cost no request of their own, a
round costs a fixed number of list calls however many endpoints there are, and drift is still undone (a
deleted Service comes back, a hand-edited ConfigMap is restored) while status-only changes get a status-only
pass. Child events are coalesced into one pass per endpoint."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import kopf
import pytest

from sluice_operator.apply import CHILD_KINDS
from sluice_operator.drift import Seen, needed, observe
from sluice_operator.handlers import Loop, build_registry
from sluice_operator.main import serve

kmock = pytest.importorskip("kmock")
from kopf_harness import (  # noqa: E402
    CM,
    DEPLOY,
    ENDPOINT,
    NS,
    SVC,
    api,
    create_endpoint,
    eventually,
    live,
    must,
    serve_kinds,
)
from kube_emulator import ApiServer  # noqa: E402

pytestmark = [pytest.mark.kmock(cls=ApiServer)]
ROUND_CALLS = 1 + len(CHILD_KINDS) + 1  # endpoints, each child kind, serving pods (one namespace)


# -- what a round decides (pure) ------------------------------------------------------------------------------
def _seen(generation: int = 1, specs: frozenset = frozenset({("Service", "a", "7")}),
          states: frozenset = frozenset()) -> Seen:
    return Seen("uid-1", generation, specs, states)


def test_needed() -> None:
    base = _seen(states=frozenset({("Deployment", "a", "10")}))
    assert needed(None, base) == "apply"  # never seen (a restart)
    assert needed(base, base) is None  # at rest
    assert needed(base, _seen(generation=2, states=base.states)) == "apply"  # the spec changed
    assert needed(base, _seen(specs=frozenset(), states=base.states)) == "apply"  # a child is gone
    assert needed(base, _seen(specs=frozenset({("Service", "a", "8")}), states=base.states)) == "apply"  # edited
    assert needed(base, _seen(states=frozenset({("Deployment", "a", "11")}))) == "fold"  # status only
    assert needed(base, Seen("uid-2", 1, base.specs, base.states)) == "apply"  # replaced by a new endpoint


def test_observe_groups_by_endpoint_and_keeps_only_owned_children() -> None:
    def obj(kind: str, name: str, rv: str, owner: str | None, generation: int | None = None,
            endpoint: str = "a") -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name, "namespace": NS, "resourceVersion": rv,
                                "labels": {"sluice.dev/endpoint": endpoint}}
        if generation is not None:
            meta["generation"] = generation
        if owner:
            meta["ownerReferences"] = [{"kind": "InferenceEndpoint", "name": endpoint, "uid": owner, "controller": True}]
        return {"kind": kind, "metadata": meta}

    endpoints = [{"metadata": {"name": "a", "namespace": NS, "uid": "u-a", "generation": 3}}]
    children = [obj("Service", "a", "5", "u-a"), obj("Deployment", "a", "9", "u-a", generation=2),
                obj("Service", "b", "6", None),  # someone else's, labelled alike
                obj("ConfigMap", "x", "1", "u-other", endpoint="other")]
    pods = [{"metadata": {"name": "a-1", "namespace": NS, "resourceVersion": "12",
                          "labels": {"sluice.dev/endpoint": "a"}}}]
    (seen,) = observe(endpoints, children, pods).values()
    assert seen == Seen("u-a", 3, frozenset({("Service", "a", "5"), ("Deployment", "a", "g2")}),
                        frozenset({("Deployment", "a", "9"), ("Pod", "a-1", "12")}))


# -- the loop ---------------------------------------------------------------------------------------------------
@pytest.fixture
def k8s(kmock: Any) -> Any:
    return serve_kinds(kmock)


class Operator:
    def __init__(self, k8s: Any, resync_seconds: float):
        self.loop = Loop()
        server = str(k8s.url).rstrip("/")
        registry = build_registry(self.loop, namespaces=[NS], login=lambda **_: kopf.ConnectionInfo(server=server),
                                  resync_seconds=resync_seconds, retry_seconds=0.5)
        self.stop = asyncio.Event()
        self.task = asyncio.create_task(serve(self.loop, registry, [NS], stop=self.stop))

    def requests(self) -> float:
        return self.loop.metrics.api_requests_total()

    def rounds(self) -> float:
        return self.loop.metrics.resync_rounds_total()

    def reconciles(self) -> float:
        return self.loop.metrics.reconciles_total()

    async def close(self) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, 15)


def endpoint(name: str) -> dict[str, Any]:
    doc = copy.deepcopy(ENDPOINT)
    doc["metadata"]["name"] = name
    doc["spec"]["model"]["servedName"] = name
    return doc


async def settle(op: Operator) -> None:
    """Wait until two whole resync rounds pass without a reconcile pass (the round after the endpoints were
    created sees their new children and runs one more pass over each)."""
    while True:
        passes, rounds = op.reconciles(), op.rounds()
        # Generous: right after the endpoints are created, a round waits behind their first passes, and the
        # emulator answers ~17 requests a second (slower on a busy box: a CI run once took over 30 s for two).
        await eventually(lambda r=rounds: must(op.rounds() >= r + 2), timeout=90)
        if op.reconciles() == passes:
            return


@pytest.mark.asyncio
@pytest.mark.timeout(300)
async def test_endpoints_at_rest_cost_only_the_rounds_lists(k8s: Any) -> None:
    resync = 0.4
    op = Operator(k8s, resync)
    try:
        for i in range(6):
            await create_endpoint(k8s, endpoint(f"ep{i}"))
        await eventually(lambda: must(all(live(k8s, DEPLOY, f"ep{i}") is not None for i in range(6))), timeout=30)
        await settle(op)
        calls, passes, rounds = op.requests(), op.reconciles(), op.rounds()
        await eventually(lambda: must(op.rounds() >= rounds + 4), timeout=30)
        calls, rounds = op.requests() - calls, op.rounds() - rounds
        assert op.reconciles() == passes  # not one pass over an endpoint at rest
        # Each round's lists, and nothing per endpoint (a round may be under way when counted).
        assert rounds * ROUND_CALLS <= calls <= (rounds + 1) * ROUND_CALLS, (calls, rounds)

        # Drift is undone by the next round: a deleted Service comes back, a hand edit is reverted.
        await api(k8s, "DELETE", f"/api/v1/namespaces/{NS}/services/ep3")
        await api(k8s, "PATCH", f"/api/v1/namespaces/{NS}/configmaps/ep4-engine",
                  {"data": {"served-model-name": "hijacked"}}, "application/merge-patch+json")
        # A few rounds at most (each lists one kind more since endpoints have NetworkPolicies; the emulator answers
        # ~17 requests a second, slower on a busy box).
        await eventually(lambda: must(live(k8s, SVC, "ep3") is not None), timeout=15)
        await eventually(lambda: must(live(k8s, CM, "ep4-engine")["data"]["served-model-name"] == "ep4"), timeout=15)
    finally:
        await op.close()


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_burst_of_child_events_is_one_pass(k8s: Any) -> None:
    op = Operator(k8s, resync_seconds=3600)  # no resync here: only events drive passes
    try:
        await create_endpoint(k8s, endpoint("burst"))
        await eventually(lambda: must(live(k8s, DEPLOY, "burst") is not None), timeout=15)
        await asyncio.sleep(1.0)
        passes = op.reconciles()
        for ready in range(10):  # the Deployment controller reporting ten times in quick succession
            await api(k8s, "PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/burst/status",
                      {"status": {"replicas": 1, "readyReplicas": ready % 2, "observedGeneration": 1}},
                      "application/merge-patch+json")
        await asyncio.sleep(1.5)
        assert 1 <= op.reconciles() - passes <= 2, op.reconciles() - passes
    finally:
        await op.close()
