"""The endpoint picker's ext-proc protocol (picker.py), driven in-process the way GIE's data planes drive an
EPP: request headers, body chunks (full-duplex streamed), then the response going by. Fake backends only
answer /ready here: the picker never talks to them. (A gateway built from Envoy's own Go types drives it
in test_picker_extproc.py.)"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from gateway_fakes import FakeBackend, chat, start_gateway, wait_until
from google.protobuf import json_format

from sluice_autoscaler import ext_proc_pb2 as pb
from sluice_autoscaler import ext_proc_pb2_grpc as pb_grpc
from sluice_autoscaler.picker import DESTINATION, LB_NAMESPACE, SERVED, SUBSET, SUBSET_NAMESPACE, hostport

pytestmark = pytest.mark.asyncio


def headers(path: str = "/v1/chat/completions", eos: bool = False, **extra: str) -> pb.HttpHeaders:
    hs = {":method": "POST", ":path": path, ":authority": "gw", "content-type": "application/json", **extra}
    return pb.HttpHeaders(headers=pb.HeaderMap(headers=[pb.HeaderValue(key=k, raw_value=v.encode())
                                                         for k, v in hs.items()]), end_of_stream=eos)


def metadata(namespace: str, values: dict) -> pb.Metadata:
    md = pb.Metadata()
    md.filter_metadata[namespace].update(values)
    return md


class Exchange:
    """One request's stream, as a gateway runs it."""

    def __init__(self, stub: pb_grpc.ExternalProcessorStub):
        self.call = stub.Process()

    async def request(self, body: dict | None, chunk: int = 7, subset: list[str] | None = None,
                      **hdrs: str) -> list[pb.ProcessingResponse]:
        raw = json.dumps(body).encode() if body is not None else b""
        first = pb.ProcessingRequest(request_headers=headers(eos=not raw, **hdrs))
        if subset is not None:
            first.metadata_context.CopyFrom(metadata(SUBSET_NAMESPACE, {SUBSET: subset}))
        await self.call.write(first)
        pieces = [raw[i:i + chunk] for i in range(0, len(raw), chunk)]
        for i, piece in enumerate(pieces):
            await self.call.write(pb.ProcessingRequest(request_body=pb.HttpBody(
                body=piece, end_of_stream=i == len(pieces) - 1)))
        out = [await self.call.read()]
        if out[0].WhichOneof("response") == "immediate_response":
            return out
        while raw:  # the body comes back in streamed pieces until end_of_stream
            r = await self.call.read()
            out.append(r)
            if r.request_body.response.body_mutation.streamed_response.end_of_stream:
                break
        return out

    async def respond(self, served: str, chunks: list[bytes], status: str = "200") -> list[bytes]:
        await self.call.write(pb.ProcessingRequest(
            response_headers=pb.HttpHeaders(headers=pb.HeaderMap(headers=[
                pb.HeaderValue(key=":status", raw_value=status.encode())])),
            metadata_context=metadata(LB_NAMESPACE, {SERVED: served})))
        assert (await self.call.read()).WhichOneof("response") == "response_headers"
        back = []
        for i, c in enumerate(chunks):
            await self.call.write(pb.ProcessingRequest(response_body=pb.HttpBody(
                body=c, end_of_stream=i == len(chunks) - 1)))
            back.append((await self.call.read()).response_body.response.body_mutation.streamed_response.body)
        await self.call.done_writing()
        return back


def destination(responses: list[pb.ProcessingResponse]) -> tuple[str, str, bytes]:
    """(header value, metadata value, body sent upstream) of a pick."""
    first = responses[0].request_headers.response
    header = {h.header.key: h.header.raw_value.decode() for h in first.header_mutation.set_headers}[DESTINATION]
    meta = json_format.MessageToDict(responses[0].dynamic_metadata)[LB_NAMESPACE][DESTINATION]
    assert first.clear_route_cache
    body = b"".join(r.request_body.response.body_mutation.streamed_response.body for r in responses[1:])
    return header, meta, body


async def picker(backends: list[FakeBackend], **kw):
    gw = await start_gateway(backends=[f"m={b.url}" for b in backends], endpoint_picker=True, picker_port=0, **kw)
    await wait_until(lambda: len(gw.registry.by_model("m").candidates()[0]) == len(backends))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.picker_port}")
    return gw, channel, pb_grpc.ExternalProcessorStub(channel)


async def test_the_pick_names_a_ready_backend_in_header_and_metadata_alike_and_the_body_comes_back_whole():
    backends = [await FakeBackend(n).start() for n in "ABC"]
    gw, channel, stub = await picker(backends)
    try:
        body = chat("m", "a long shared system prompt " * 20)
        ex = Exchange(stub)
        header, meta, sent = destination(await ex.request(body))
        assert header == meta  # the protocol: both, the same value
        first, *fallbacks = header.split(",")
        assert first in {hostport(b.url) for b in backends} and len(fallbacks) == 2 and first not in fallbacks
        assert json.loads(sent) == body  # nothing to rewrite: the same request goes upstream
        ep = gw.registry.by_model("m")
        assert sum(b.inflight for b in ep.backends.values()) == 1 and gw.demand["m"].inflight == 1
        # the response goes by chunk by chunk, unchanged; the stream's end releases the count
        assert await ex.respond(first, [b"data: 1\n\n", b"data: [DONE]\n\n"]) == [b"data: 1\n\n", b"data: [DONE]\n\n"]
        await wait_until(lambda: gw.demand["m"].inflight == 0)
        assert sum(b.inflight for b in ep.backends.values()) == 0
        # the same prefix is the same pick (prefix affinity), a request without a body still gets one
        again = destination(await Exchange(stub).request(body))[0].split(",")[0]
        assert again == first
        r = await Exchange(stub).request(None, path="/v1/models")
        assert destination(r)[0].split(",")[0] in {hostport(b.url) for b in backends}
    finally:
        await channel.close()
        await gw.stop()
        for b in backends:
            await b.stop()


async def test_subset_hint_limits_the_pick_and_an_unmatched_one_is_503():
    backends = [await FakeBackend(n).start() for n in "AB"]
    gw, channel, stub = await picker(backends)
    try:
        only = hostport(backends[1].url)
        for i in range(6):
            r = await Exchange(stub).request(chat("m", f"prompt {i}"), subset=[only])
            assert destination(r)[0] == only  # no fallback outside the subset either
        r = await Exchange(stub).request(chat("m", "x"), subset=["10.9.9.9:8000"])
        assert r[0].immediate_response.status.code == 503
        assert "subset" in json.loads(r[0].immediate_response.body)["error"]["message"]
    finally:
        await channel.close()
        await gw.stop()
        for b in backends:
            await b.stop()


async def test_bad_requests_get_immediate_answers_naming_the_cause():
    backends = [await FakeBackend("A").start()]
    gw, channel, stub = await picker(backends, max_body_bytes=1000, max_buffered_bytes=1000)
    try:
        async def answer(body) -> tuple[int, dict]:
            ex = Exchange(stub)
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            await ex.call.write(pb.ProcessingRequest(request_headers=headers()))
            await ex.call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True)))
            r = (await ex.call.read()).immediate_response
            return r.status.code, json.loads(r.body)["error"]

        assert (await answer(b"{not json"))[0] == 400
        code, err = await answer({"messages": []})
        assert code == 400 and err["param"] == "model"
        code, err = await answer(chat("other", "hi"))
        assert code == 404 and err["code"] == "model_not_found"
        code, err = await answer(chat("m", "x" * 2000))
        assert code == 413 and "--max-body-bytes" in err["message"]
        assert gw.proxy.budget.used == 0  # nothing stays counted against the buffer budget
        refused = {r: gw.metrics.refused.labels(r)._value.get() for r in ("invalid_request", "model_not_found")}
        assert refused == {"invalid_request": 2, "model_not_found": 1}
        # a gateway that goes on sending after the 413 is not answered again, and nothing is kept
        ex = Exchange(stub)
        await ex.call.write(pb.ProcessingRequest(request_headers=headers()))
        await ex.call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=b"y" * 900)))
        await ex.call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=b"y" * 900)))
        assert (await ex.call.read()).immediate_response.status.code == 413
        for _ in range(5):
            await ex.call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=b"y" * 900)))
        await ex.call.done_writing()
        assert await ex.call.read() is grpc.aio.EOF
        assert gw.proxy.budget.used == 0
    finally:
        await channel.close()
        await gw.stop()
        await backends[0].stop()


async def test_objective_priority_reaches_the_engine_and_a_client_cannot_set_its_own():
    backends = [await FakeBackend("A").start()]
    gw, channel, stub = await picker(backends, objectives=["critical=10", "batch=-1"])
    try:
        def sent(r) -> dict:
            return json.loads(destination(r)[2])

        r = await Exchange(stub).request(chat("m", "hi", priority=-100), **{"x-gateway-inference-objective": "critical"})
        assert sent(r)["priority"] == -10  # GIE's higher-is-more-important becomes the engine's lower-is-sooner
        r = await Exchange(stub).request(chat("m", "hi", priority=-100))
        assert "priority" not in sent(r)  # no objective: the default, priority 0; the client's field is dropped
        r = await Exchange(stub).request(chat("m", "hi"), **{"x-gateway-inference-objective": "batch"})
        assert sent(r)["priority"] == 1
    finally:
        await channel.close()
        await gw.stop()
        await backends[0].stop()


async def test_when_every_backend_is_full_sheddable_requests_get_429_and_others_queue_for_their_turn():
    backends = [await FakeBackend("A").start()]
    gw, channel, stub = await picker(backends, objectives=["batch=-1"], picker_max_inflight=1)
    try:
        busy = Exchange(stub)
        first = destination(await busy.request(chat("m", "first")))[0]  # in flight until its response ends
        r = await Exchange(stub).request(chat("m", "late"), **{"x-gateway-inference-objective": "batch"})
        assert r[0].immediate_response.status.code == 429
        assert {h.header.key for h in r[0].immediate_response.headers.set_headers} >= {"retry-after"}
        # priority 0 is not sheddable: it waits (counted as held for KEDA) and is picked when room frees up
        queued = asyncio.create_task(Exchange(stub).request(chat("m", "important")))
        await wait_until(lambda: gw.demand["m"].held == 1)
        assert not queued.done()
        await busy.respond(first, [b"data: [DONE]\n\n"])
        r = await asyncio.wait_for(queued, 5)
        assert r[0].WhichOneof("response") == "request_headers" and gw.demand["m"].held == 0
    finally:
        await channel.close()
        await gw.stop()
        await backends[0].stop()


async def test_a_higher_priority_request_goes_past_the_cap_where_the_engine_can_preempt_a_lower_one():
    backends = [await FakeBackend("A").start()]
    gw, channel, stub = await picker(backends, objectives=["critical=10"], picker_max_inflight=1)
    try:
        low = Exchange(stub)
        dest = destination(await low.request(chat("m", "standard")))[0]
        # critical: picked at once, over the cap of 1 (the engine preempts the standard one for it)
        crit = Exchange(stub)
        r = await crit.request(chat("m", "urgent"), **{"x-gateway-inference-objective": "critical"})
        assert r[0].WhichOneof("response") == "request_headers" and gw.demand["m"].held == 0
        # another standard one is not: it waits for a turn
        waiting = asyncio.create_task(Exchange(stub).request(chat("m", "standard 2")))
        await wait_until(lambda: gw.demand["m"].held == 1)
        # never past twice the cap: a second critical waits too (ahead of the standard one: higher priority)
        crit2_ex = Exchange(stub)
        crit2 = asyncio.create_task(crit2_ex.request(chat("m", "urgent 2"),
                                                     **{"x-gateway-inference-objective": "critical"}))
        await wait_until(lambda: gw.demand["m"].held == 2)
        await crit.respond(dest, [b"data: [DONE]\n\n"])
        r = await asyncio.wait_for(crit2, 5)
        assert r[0].WhichOneof("response") == "request_headers" and not waiting.done()
        await crit2_ex.respond(dest, [b"data: [DONE]\n\n"])
        await asyncio.sleep(0.2)
        assert not waiting.done()  # the standard one in flight holds the one slot: nothing lower to preempt
        # a queue of lower priorities does not hold a critical one back
        crit3 = Exchange(stub)
        r = await crit3.request(chat("m", "urgent 3"), **{"x-gateway-inference-objective": "critical"})
        assert r[0].WhichOneof("response") == "request_headers" and gw.demand["m"].held == 1, r[0]
        await crit3.respond(dest, [b"data: [DONE]\n\n"])
        await low.respond(dest, [b"data: [DONE]\n\n"])
        await asyncio.wait_for(waiting, 5)
        # counted: only what is in flight now (the last standard one); the finished ones are forgotten
        assert [dict(c) for c in gw.picker._priorities.values()] == [{0: 1}]
    finally:
        await channel.close()
        await gw.stop()
        await backends[0].stop()


async def test_queued_requests_go_by_priority_then_tenant_by_tenant():
    """One backend with room for one: a tenant that queued six requests does not starve one that queued two
    after them, and a critical request sent last goes first."""
    backends = [await FakeBackend("A").start()]
    gw, channel, stub = await picker(backends, objectives=["critical=5"], picker_max_inflight=1)
    order: list[str] = []
    try:
        holder = Exchange(stub)
        dest = destination(await holder.request(chat("m", "holder")))[0].split(",")[0]

        async def one(label: str, tenant: str, objective: str | None = None) -> None:
            ex = Exchange(stub)
            hdrs = {"x-gateway-inference-fairness-id": tenant}
            if objective:
                hdrs["x-gateway-inference-objective"] = objective
            await ex.request(chat("m", label), **hdrs)
            order.append(label)
            await asyncio.sleep(0.01)
            await ex.respond(dest, [b"data: [DONE]\n\n"])  # done: the next in the queue gets the room

        tasks = []
        for i in range(6):
            tasks.append(asyncio.create_task(one(f"a{i}", "tenant-a")))
            await wait_until(lambda n=i + 1: gw.demand["m"].held == n)
        for i in range(2):
            tasks.append(asyncio.create_task(one(f"b{i}", "tenant-b")))
            await wait_until(lambda n=7 + i: gw.demand["m"].held == n)
        # a critical one is not queued behind them: the one in flight is of a lower priority, which the engine
        # preempts for it (it goes past the cap of 1)
        tasks.append(asyncio.create_task(one("urgent", "tenant-a", "critical")))
        await wait_until(lambda: order == ["urgent"])
        assert gw.demand["m"].held == 8
        await holder.respond(dest, [b"data: [DONE]\n\n"])
        await asyncio.wait_for(asyncio.gather(*tasks), 20)
        assert order[0] == "urgent"
        # then the two tenants alternate while both wait; FCFS within each
        assert order[1:] == ["a0", "b0", "a1", "b1", "a2", "a3", "a4", "a5"], order
        assert gw.demand["m"].held == 0 and gw.demand["m"].inflight == 0
    finally:
        await channel.close()
        await gw.stop()
        await backends[0].stop()


async def test_a_pick_at_zero_is_held_counts_for_keda_and_goes_on_when_a_backend_is_ready():
    backend = FakeBackend("A")
    backend.ready = False
    await backend.start()
    gw = await start_gateway(backends=[f"m={backend.url}"], endpoint_picker=True, picker_port=0,
                             picker_hold_timeout=10)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.picker_port}")
    stub = pb_grpc.ExternalProcessorStub(channel)
    try:
        pick = asyncio.create_task(Exchange(stub).request(chat("m", "wake up")))
        await wait_until(lambda: gw.demand["m"].held == 1)
        backend.ready = True
        r = await asyncio.wait_for(pick, 10)
        assert destination(r)[0] == hostport(backend.url)
        assert gw.demand["m"].held == 0 and gw.demand["m"].inflight == 1
        # past --picker-hold-timeout the picker answers 503 with Retry-After itself
        backend.ready = False
        await wait_until(lambda: not gw.registry.by_model("m").candidates()[0])
        gw.cfg.picker_hold_timeout = 0.3
        r = await Exchange(stub).request(chat("m", "again"))
        assert r[0].immediate_response.status.code == 503
        assert json.loads(r[0].immediate_response.body)["error"]["code"] == "hold_timeout"
        assert gw.demand["m"].held == 0
    finally:
        await channel.close()
        await gw.stop()
        await backend.stop()


async def test_the_pools_inference_objectives_set_priorities_over_the_flags():
    from sluice_autoscaler.picker import Objectives, pool_objectives

    def objective(name: str, pool: str, priority, group: str | None = None) -> dict:
        ref = {"name": pool, **({"group": group} if group else {})}
        return {"metadata": {"name": name}, "spec": {"poolRef": ref, "priority": priority}}

    found = pool_objectives([objective("critical", "pool-a", 10), objective("batch", "pool-a", -1),
                             objective("other-pool", "pool-b", 5), objective("odd", "pool-a", "high"),
                             objective("foreign", "pool-a", 3, group="example.com"),
                             {"metadata": {"name": "no-spec"}}], "pool-a")
    assert found == {"critical": 10, "batch": -1}
    objectives = Objectives.parse(["critical=1", "standard=0", "flag-only=4", "spec=1"])
    objectives.watched = found
    assert [objectives.priority(n) for n in ("critical", "batch", "flag-only", "unknown", None)] == [10, -1, 4, 0, 0]
    # the endpoint's spec.routing.objectives: under the pool's InferenceObjectives, over the flags
    endpoint = {"critical": 3, "spec": 7}
    assert [objectives.priority(n, endpoint) for n in ("critical", "spec", "flag-only")] == [10, 7, 4]
