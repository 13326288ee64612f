"""Leader election (issue 14): two operator replicas against kmock's emulator, one Lease. Only the leader
runs kopf and reconciles; when it stops it releases the Lease and the other takes over at once; a leader
that can no longer renew stops reconciling and exits non-zero. Plus the Lease protocol itself: a held,
fresh Lease is not taken, an expired one is, and of two candidates racing for it exactly one wins (the
emulator refuses a write naming a stale resourceVersion, as the API server does)."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from typing import Any

import kopf
import pytest

from sluice_operator.apply import KubeApi
from sluice_operator.handlers import Loop, build_registry
from sluice_operator.leader import LEASE_KIND, LeaseElector
from sluice_operator.main import LEASE_NAME, serve

kmock = pytest.importorskip("kmock")
from kopf_harness import DEPLOY, ENDPOINT, NS, api, create_endpoint, eventually, live, must, serve_kinds  # noqa: E402
from kube_emulator import ApiServer  # noqa: E402

pytestmark = [pytest.mark.kmock(cls=ApiServer), pytest.mark.asyncio, pytest.mark.timeout(90)]
LEASES = "coordination.k8s.io/v1/leases"


@pytest.fixture
def k8s(kmock: Any) -> Any:
    return serve_kinds(kmock)


def info(k8s: Any) -> kopf.ConnectionInfo:
    return kopf.ConnectionInfo(server=str(k8s.url).rstrip("/"))


def login(k8s: Any) -> Any:
    """A login handler with kopf's own signature (settings is keyword-only and required), as default_login is."""
    def handler(*, settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
        assert isinstance(settings, kopf.OperatorSettings)
        return info(k8s)
    return handler


def elector(k8s: Any, identity: str, loop: Loop | None = None, **timing: float) -> LeaseElector:
    on_request = loop.metrics.count_request if loop is not None else None
    timing = {"lease_s": 3.0, "renew_deadline_s": 2.0, "renew_s": 0.25, **timing}
    return LeaseElector(lambda: KubeApi(info(k8s), on_request=on_request), NS, LEASE_NAME, identity, **timing)


class Replica:
    """One `sluice operator --leader-election` process's worth: its loop, registry, elector and task."""

    def __init__(self, k8s: Any, identity: str):
        self.loop = Loop()
        registry = build_registry(self.loop, namespaces=[NS], login=login(k8s), resync_seconds=0.5,
                                  retry_seconds=0.5)
        self.elector = elector(k8s, identity, self.loop)
        self.stop = asyncio.Event()
        self.task = asyncio.create_task(serve(self.loop, registry, [NS], elector=self.elector,
                                              login=login(k8s), stop=self.stop))

    def reconciles(self) -> float:
        return self.loop.metrics.reconciles_total()

    def leading(self) -> float:
        return self.loop.metrics.leader._value.get()


def holder(k8s: Any) -> str | None:
    lease = live(k8s, LEASES, LEASE_NAME)
    return None if lease is None else lease["spec"].get("holderIdentity")


async def test_one_replica_reconciles_and_the_other_takes_over(k8s: Any) -> None:
    a, b = Replica(k8s, "operator-a"), Replica(k8s, "operator-b")
    try:
        await eventually(lambda: must(holder(k8s) in ("operator-a", "operator-b")))
        leader, follower = (a, b) if holder(k8s) == "operator-a" else (b, a)
        await create_endpoint(k8s, ENDPOINT)
        await eventually(lambda: must(live(k8s, DEPLOY, "smollm2") is not None))
        # Three passes of the leader (resyncs every 0.5 s; a pass over the emulator, ~17 requests a second, takes
        # longer since each endpoint also has its NetworkPolicies: waited for, not slept for a fixed time).
        await eventually(lambda: must(leader.reconciles() >= 3), timeout=30)
        assert leader.leading() == 1
        assert follower.reconciles() == 0 and follower.leading() == 0
        assert not follower.task.done()  # a standby waits; it does not exit

        # The leader stops cleanly: it releases the Lease, so the follower takes over without waiting it out.
        leader.stop.set()
        assert await asyncio.wait_for(leader.task, 15) == 0
        await eventually(lambda: must(follower.elector.is_leader), timeout=2)
        assert holder(k8s) == follower.elector.identity
        await api(k8s, "DELETE", f"/apis/apps/v1/namespaces/{NS}/deployments/smollm2")
        assert live(k8s, DEPLOY, "smollm2") is None
        await eventually(lambda: must(live(k8s, DEPLOY, "smollm2") is not None))  # the new leader repairs
        await eventually(lambda: must(follower.reconciles() > 0))  # counted when its pass ends
        assert follower.leading() == 1
        lease = live(k8s, LEASES, LEASE_NAME)
        assert lease["spec"]["leaseTransitions"] >= 1
    finally:
        for r in (a, b):
            r.stop.set()
        await asyncio.wait_for(asyncio.gather(a.task, b.task, return_exceptions=True), 15)


async def test_a_leader_that_cannot_renew_stops_and_exits_non_zero(k8s: Any) -> None:
    r = Replica(k8s, "operator-a")
    await eventually(lambda: must(r.elector.is_leader))
    await create_endpoint(k8s, ENDPOINT)
    await eventually(lambda: must(live(k8s, DEPLOY, "smollm2") is not None))

    # Another holder writes the Lease and keeps it fresh (as after a network partition healed the other way).
    async def usurp() -> None:
        while True:
            lease = live(k8s, LEASES, LEASE_NAME)
            now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            lease["spec"].update(holderIdentity="intruder", renewTime=now)
            await api(k8s, "PATCH", f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/{LEASE_NAME}",
                      {"spec": lease["spec"]}, "application/merge-patch+json")
            await asyncio.sleep(0.2)

    usurper = asyncio.create_task(usurp())
    try:
        assert await asyncio.wait_for(r.task, 10) == 1  # within renew_deadline_s (2 s) and kopf's stop
        assert not r.elector.is_leader and r.leading() == 0
        assert holder(k8s) == "intruder"  # it did not release what it no longer holds
    finally:
        usurper.cancel()
        r.stop.set()


async def test_lease_protocol(k8s: Any) -> None:
    a = elector(k8s, "a", lease_s=1.0, renew_deadline_s=0.8, renew_s=0.1)
    b = elector(k8s, "b", lease_s=1.0, renew_deadline_s=0.8, renew_s=0.1)
    assert await a.try_acquire_or_renew()  # creates the Lease
    assert not await b.try_acquire_or_renew()  # held and fresh
    assert await a.try_acquire_or_renew()  # the holder renews
    await asyncio.sleep(0.5)
    assert not await b.try_acquire_or_renew()  # renewed 0.5 s ago: still fresh to b
    await asyncio.sleep(1.1)  # a stopped renewing; b has seen the same record for over the lease
    assert await b.try_acquire_or_renew()
    assert holder(k8s) == "b" and live(k8s, LEASES, LEASE_NAME)["spec"]["leaseTransitions"] == 1

    # Two candidates that both read the same expired record: the API server lets one write win.
    async with KubeApi(info(k8s)) as kube:
        stale = await kube.get(LEASE_KIND, NS, LEASE_NAME)
    c, d = elector(k8s, "c"), elector(k8s, "d")
    for e in (c, d):
        e._observed, e._observed_at = (stale["spec"]["holderIdentity"], stale["spec"]["renewTime"]), -1e9
    results = await asyncio.gather(c.try_acquire_or_renew(), d.try_acquire_or_renew())
    assert sorted(results) == [False, True]
    assert holder(k8s) == ("c" if results[0] else "d")
