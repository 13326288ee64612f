"""Several gateway replicas (issue 14, item 7): each holds and routes its own requests; KEDA, calling the
external scaler's gRPC on one replica as it does, sees the demand of all of them; the same model name in two
namespaces reaches each namespace's pods. Real `sluice gateway` processes on 127.0.0.1, discovering
endpoints and each other through kmock (an in-memory Kubernetes API) as they would in a cluster."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import httpx
import pytest
from gateway_fakes import (
    FakeBackend,
    GatewayProcess,
    add_sluice_resources,
    chat,
    endpoint_slice,
    kube_call,
    start_gateway,
    wait_until,
)
from servers import free_port

from sluice_autoscaler import externalscaler_pb2 as pb
from sluice_autoscaler import externalscaler_pb2_grpc as pb_grpc
from sluice_autoscaler.demand import DemandBoard, PeerCounts
from sluice_contract import ENDPOINT_LABEL, ROLE_LABEL, SCALER_METRIC_NAME, SERVICE_NAME_LABEL, SERVING

kmock = pytest.importorskip("kmock")

TEAMS = ("team-a", "team-b")
GATEWAY_NS, PEERS_SERVICE = "sluice-system", "sluice-gateway-peers"


@pytest.fixture
def k8s(kmock: Any) -> Any:
    return add_sluice_resources(kmock)


def ref(namespace: str) -> pb.ScaledObjectRef:
    """What KEDA sends for the operator's external-push trigger of InferenceEndpoint <namespace>/chat."""
    return pb.ScaledObjectRef(name="chat", namespace=namespace, scalerMetadata={
        "scalerAddress": "sluice-gateway.sluice-system.svc:9090", "endpoint": f"{namespace}/chat", "model": "llama"})


async def demand_seen_by_keda(stub: pb_grpc.ExternalScalerStub, namespace: str) -> tuple[bool, float]:
    active = (await stub.IsActive(ref(namespace))).result
    metrics = await stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref(namespace),
                                                         metricName=f"s1-{SCALER_METRIC_NAME}"))
    return active, metrics.metricValues[0].metricValueFloat


async def wait_demand(stub: pb_grpc.ExternalScalerStub, namespace: str, want: tuple[bool, float],
                      timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while (seen := await demand_seen_by_keda(stub, namespace)) != want:
        assert time.monotonic() < deadline, f"{namespace}: KEDA sees {seen}, wanted {want}"
        await asyncio.sleep(0.05)


@pytest.mark.slow  # two gateway processes: about 5 s
@pytest.mark.asyncio
async def test_two_gateway_processes_hold_route_and_report_summed_demand(k8s, tmp_path):
    backends = {ns: await FakeBackend(f"{ns}-pod", model="llama").start() for ns in TEAMS}
    for ns, backend in backends.items():  # the same served name in both namespaces
        await kube_call(k8s, "POST", f"/apis/sluice.dev/v1alpha1/namespaces/{ns}/inferenceendpoints", {
            "apiVersion": "sluice.dev/v1alpha1", "kind": "InferenceEndpoint",
            "metadata": {"name": "chat", "namespace": ns},
            "spec": {"model": {"uri": "hf://org/Llama-3-8B", "servedName": "llama"}}})
        await kube_call(k8s, "POST", f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", endpoint_slice(
            "chat-x1", ns, {SERVICE_NAME_LABEL: "chat", ENDPOINT_LABEL: "chat", ROLE_LABEL: SERVING}, backend.url))
    # The headless peers Service's slices list both replicas (one port each here: they share 127.0.0.1).
    peer_ports = [free_port(), free_port()]
    for i, port in enumerate(peer_ports):
        await kube_call(k8s, "POST", f"/apis/discovery.k8s.io/v1/namespaces/{GATEWAY_NS}/endpointslices",
                        endpoint_slice(f"peers-{i}", GATEWAY_NS, {SERVICE_NAME_LABEL: PEERS_SERVICE},
                                       f"http://127.0.0.1:{port}", ready=False, port_name="peers"))
    args = ["--kubernetes", "--kube-api", str(k8s.url), "--peer-service", PEERS_SERVICE, "--peer-namespace",
            GATEWAY_NS, "--health-interval", "0.2"]
    gateways = await asyncio.gather(*(asyncio.to_thread(GatewayProcess, args, tmp_path / f"gateway-{i}.log", port)
                                      for i, port in enumerate(peer_ports)))
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{gw.scaler_port}") for gw in gateways]
    keda = [pb_grpc.ExternalScalerStub(c) for c in channels]
    clients = [httpx.AsyncClient(base_url=gw.url, timeout=30) for gw in gateways]
    try:
        # -- routing: `<namespace>/<servedName>` reaches that namespace's pods, through either replica
        for c in clients:
            for ns in TEAMS:
                r = await c.post("/v1/chat/completions", json=chat(f"{ns}/llama", "hi"))
                assert r.status_code == 200 and r.json()["backend"] == f"{ns}-pod", r.text
            r = await c.post("/v1/chat/completions", json=chat("llama", "hi"))  # nobody published it plainly
            assert r.status_code == 404
            listed = (await c.get("/v1/models")).json()["data"]
            assert [(m["id"], m["endpoint"]) for m in listed] == [("team-a/llama", "team-a/chat"),
                                                                 ("team-b/llama", "team-b/chat")]
        assert all(req["model"] == "llama" for b in backends.values() for req in b.requests)  # the served name
        assert len(backends["team-a"].requests) == len(backends["team-b"].requests) == 2

        # -- scaled to zero: team-a's pod stops answering; KEDA (on replica 0) sees no demand yet
        backends["team-a"].ready = False
        await asyncio.sleep(0.5)  # both replicas' health polls (0.2 s) see it
        for stub in keda:
            await wait_demand(stub, "team-a", (False, 0.0))
        # Replica 0 holds two requests, replica 1 one: each holds its own, KEDA sees three on either.
        held = [asyncio.create_task(clients[i].post("/v1/chat/completions", json=chat("team-a/llama", f"q{i}{j}")))
                for i, n in ((0, 2), (1, 1)) for j in range(n)]
        for stub in keda:
            await wait_demand(stub, "team-a", (True, 3.0))
            await wait_demand(stub, "team-b", (False, 0.0))
        per_replica = [await asyncio.to_thread(gw.metrics) for gw in gateways]
        assert [m['sluice_gateway_pending_requests{endpoint="team-a/chat"}'] for m in per_replica] == [2, 1]
        assert [m["sluice_gateway_peers"] for m in per_replica] == [1, 1]

        # -- a cold start held by replica 1 is pushed on replica 0's StreamIsActive, without a poll
        backends["team-b"].ready = False
        await asyncio.sleep(0.5)
        stream = keda[0].StreamIsActive(ref("team-b"))
        assert (await stream.read()).result is False
        t0 = time.monotonic()
        held.append(asyncio.create_task(clients[1].post("/v1/chat/completions", json=chat("team-b/llama", "wake"))))
        pushed = await asyncio.wait_for(stream.read(), 3)
        assert pushed.result is True and time.monotonic() - t0 < 1.5

        # -- the pods are ready: every held request is answered by its namespace's pod, demand goes to zero
        for b in backends.values():
            b.ready = True
        answers = await asyncio.gather(*held)
        assert [(r.status_code, r.json()["backend"]) for r in answers] == [(200, "team-a-pod")] * 3 + [
            (200, "team-b-pod")]
        assert (await asyncio.wait_for(stream.read(), 5)).result is False
        stream.cancel()
        for stub in keda:
            for ns in TEAMS:
                await wait_demand(stub, ns, (False, 0.0))
    finally:
        for c in clients:
            await c.aclose()
        for ch in channels:
            await ch.close()
        await asyncio.gather(*(asyncio.to_thread(gw.stop) for gw in gateways))
        for b in backends.values():
            await b.stop()


@pytest.mark.asyncio
async def test_a_replica_that_dies_stops_counting_after_the_peer_timeout(tmp_path):
    """Static peers (`--peer`): the list may name the replica itself (recognised by its id, skipped). A peer
    killed with requests held keeps its last counts for --peer-timeout (a brief silence is not demand gone),
    then counts for nothing (its requests died with it)."""
    backend = await FakeBackend("pod", model="chat").start()
    backend.ready = False
    own_port = free_port()
    other = await asyncio.to_thread(GatewayProcess, ["--backend", f"chat={backend.url}"], tmp_path / "other.log")
    peers = [f"http://127.0.0.1:{own_port}", f"http://127.0.0.1:{other.peer_port}"]
    gw = await start_gateway(backends=[f"chat={backend.url}"], peer_port=own_port, peers=peers,
                             peer_interval=0.2, peer_timeout=1.5)
    try:
        await wait_until(lambda: gw.ready.is_set())
        assert gw.peers.peer_urls == [peers[1]] and gw.peers.selves == {peers[0]}
        async with httpx.AsyncClient(base_url=other.url, timeout=30) as c:
            request = asyncio.create_task(c.post("/v1/chat/completions", json=chat("chat", "hi")))
            await wait_until(lambda: gw.demand.total("chat") == (True, 1), timeout=5)
            assert gw.demand.get("chat") is None  # nothing of its own: the one request is the peer's
            other.proc.kill()
            killed = time.monotonic()
            with pytest.raises(httpx.HTTPError):
                await request
        await asyncio.sleep(0.5)
        assert gw.demand.total("chat") == (True, 1) and gw.demand.peers == 1  # within --peer-timeout
        await wait_until(lambda: gw.demand.total("chat") == (False, 0), timeout=5)
        assert gw.demand.peers == 0 and time.monotonic() - killed >= 1.5 - 0.2 - 0.1  # last answer <= 0.2 s before
    finally:
        await gw.stop()
        other.stop()
        await backend.stop()


@pytest.mark.asyncio
async def test_the_peer_port_takes_only_callers_with_the_peer_token(tmp_path):
    """--peer-token-file: the peer port answers 401 to a caller without the token (its answers carry tenants'
    usage, which quotas trust), and replicas sharing the token follow each other."""
    backend = await FakeBackend("pod", model="chat").start()
    backend.ready = False
    token = tmp_path / "peer-token"
    token.write_text("s3cret-peer-token\n")
    own_port = free_port()
    other = await asyncio.to_thread(GatewayProcess, ["--backend", f"chat={backend.url}", "--peer-token-file",
                                                     str(token)], tmp_path / "other.log")
    gw = await start_gateway(backends=[f"chat={backend.url}"], peer_port=own_port, peer_interval=0.2,
                             peers=[f"http://127.0.0.1:{other.peer_port}"], peer_token_file=str(token))
    try:
        async with httpx.AsyncClient(timeout=10) as c:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                r = await c.get(f"http://127.0.0.1:{other.peer_port}/peer/demand", headers=headers)
                assert r.status_code == 401 and "peer token" in r.json()["error"]
            r = await c.get(f"http://127.0.0.1:{own_port}/peer/demand",
                            headers={"Authorization": "Bearer s3cret-peer-token"})
            assert r.status_code == 200 and "demand" in r.json()
        async with httpx.AsyncClient(base_url=other.url, timeout=30) as c:
            request = asyncio.create_task(c.post("/v1/chat/completions", json=chat("chat", "hi")))
            await wait_until(lambda: gw.demand.total("chat") == (True, 1), timeout=5)  # the peer's hold, heard
            request.cancel()
    finally:
        await gw.stop()
        other.stop()
        await backend.stop()


def test_board_sums_peers_and_pushes_their_holds():
    async def run() -> None:
        board = DemandBoard()
        q = board.subscribe("ns/e")
        assert q is not None
        board["ns/e"].add(inflight=1)  # this replica: active
        assert q.get_nowait() is True
        board.set_peer("http://peer", {"ns/e": PeerCounts(held=2, inflight=0, hold_starts=1)})
        assert board.total("ns/e") == (True, 3)
        assert q.get_nowait() is True  # a hold began on the peer: a new cold start to signal, though active
        board.set_peer("http://peer", {"ns/e": PeerCounts(held=1, inflight=1, hold_starts=1)})
        assert q.empty() and board.total("ns/e") == (True, 3)  # no edge: nothing pushed
        board["ns/e"].add(inflight=-1)  # this replica idle, the peer still busy: still active, nothing pushed
        assert q.empty()
        board.set_peer("http://peer", None)  # the peer is gone
        assert q.get_nowait() is False and board.total("ns/e") == (False, 0)
        # Peers are long-polled: an edge of this replica's own demand ends a wait at once.
        seen = board.epoch
        waiter = asyncio.create_task(board.wait_epoch(seen, 5))
        await asyncio.sleep(0)
        board["ns/e"].add(held=1)
        await asyncio.wait_for(waiter, 1)
        assert board.epoch == seen + 1 and board.local_counts()["ns/e"] == PeerCounts(1, 0, 1)

    asyncio.run(run())
