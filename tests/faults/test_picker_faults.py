"""The endpoint picker's port under faults and abuse (issue 41; 127.0.0.1 only, bounded): gateways that go away in
the middle of a request, bodies over the limits, more streams than it serves, the picker's death under its data
plane, a backend killed after it was picked. After each case nothing stays counted (in flight, held, buffered)
and the next request is picked as before."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import grpc
import httpx
import pytest
from extproc_gateway import run_extproc_gateway
from gateway_fakes import FakeBackend, FakeBackendProcess, GatewayProcess, chat, start_gateway, wait_until
from servers import free_port

from sluice_autoscaler import ext_proc_pb2 as pb
from sluice_autoscaler import ext_proc_pb2_grpc as pb_grpc

SERVED = "x-gateway-destination-endpoint-served"


def headers() -> pb.HttpHeaders:
    return pb.HttpHeaders(headers=pb.HeaderMap(headers=[
        pb.HeaderValue(key=":method", raw_value=b"POST"), pb.HeaderValue(key=":path", raw_value=b"/v1/completions")]))


def settled(gw) -> bool:
    ep = gw.registry.by_model("m")
    return (gw.demand["m"].inflight, gw.demand["m"].held, gw.proxy.budget.used, gw.picker.streams,
            sum(b.inflight for b in ep.backends.values())) == (0, 0, 0, 0, 0)


async def picked(stub) -> str:
    call = stub.Process()
    body = json.dumps(chat("m", "still picked")).encode()
    await call.write(pb.ProcessingRequest(request_headers=headers()))
    await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    r = await call.read()
    await call.done_writing()
    call.cancel()
    return r.WhichOneof("response")


@pytest.mark.asyncio
async def test_gateways_that_leave_mid_request_leave_nothing_counted():
    backend = await FakeBackend("A").start()
    gw = await start_gateway(backends=[f"m={backend.url}"], endpoint_picker=True, picker_port=0,
                             max_body_bytes=4096, picker_max_streams=8, picker_hold_timeout=5)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.picker_port}")
    stub = pb_grpc.ExternalProcessorStub(channel)
    try:
        await wait_until(lambda: gw.registry.by_model("m").candidates()[0])
        # 1. half a body, then gone; 2. picked, then gone before the response; 3. held at zero, then gone
        half = stub.Process()
        await half.write(pb.ProcessingRequest(request_headers=headers()))
        await half.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=b'{"model": "m", "pro')))
        await wait_until(lambda: gw.proxy.budget.used > 0)
        half.cancel()
        mid = stub.Process()
        await mid.write(pb.ProcessingRequest(request_headers=headers()))
        await mid.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=json.dumps(chat("m", "x")).encode(),
                                                                      end_of_stream=True)))
        assert (await mid.read()).WhichOneof("response") == "request_headers"
        assert gw.demand["m"].inflight == 1
        mid.cancel()
        await wait_until(lambda: settled(gw), 5)
        backend.ready = False
        await wait_until(lambda: not gw.registry.by_model("m").candidates()[0])
        held = stub.Process()
        await held.write(pb.ProcessingRequest(request_headers=headers()))
        await held.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=json.dumps(chat("m", "y")).encode(),
                                                                       end_of_stream=True)))
        await wait_until(lambda: gw.demand["m"].held == 1)
        held.cancel()
        await wait_until(lambda: settled(gw), 5)
        backend.ready = True
        await wait_until(lambda: gw.registry.by_model("m").candidates()[0])
        # 4. a body past --max-body-bytes in small chunks: 413 once it passes, nothing kept
        big = stub.Process()
        await big.write(pb.ProcessingRequest(request_headers=headers()))
        for _ in range(10):
            await big.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=b"x" * 1000)))
        r = (await big.read()).immediate_response
        assert r.status.code == 413
        big.cancel()
        # 5. more streams than --picker-max-streams: the rest refused, not queued without bound
        opened = [stub.Process() for _ in range(12)]
        for call in opened:
            await call.write(pb.ProcessingRequest(request_headers=headers()))
        codes = []
        for call in opened:
            try:
                await asyncio.wait_for(call.read(), 1)
            except asyncio.TimeoutError:
                codes.append("open")  # served: waiting for its body
            except grpc.aio.AioRpcError as e:
                codes.append(e.code())
        assert codes.count("open") == 8 and codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 4, codes
        for call in opened:
            call.cancel()
        await wait_until(lambda: settled(gw), 5)
        assert await picked(stub) == "request_headers"
    finally:
        await channel.close()
        await gw.stop()
        await backend.stop()


def test_the_data_plane_answers_503_while_the_picker_is_down_and_recovers(tmp_path):
    backend = FakeBackendProcess("A")
    port = free_port()
    picker = GatewayProcess(["--endpoint-picker", "--picker-port", str(port), "--backend", f"m={backend.url}"],
                            tmp_path / "picker.log")
    try:
        with run_extproc_gateway(["--epp", f"127.0.0.1:{port}", "--epp-timeout", "5s"]) as url:
            assert httpx.post(f"{url}/v1/completions", json=chat("m", "a"), timeout=30).status_code == 200
            picker.proc.send_signal(signal.SIGKILL)
            picker.proc.wait(10)
            r = httpx.post(f"{url}/v1/completions", json=chat("m", "b"), timeout=30)
            assert r.status_code == 503 and r.json()["error"]["message"]  # FailClose: a clear error, no hang
            picker = GatewayProcess(["--endpoint-picker", "--picker-port", str(port), "--backend",
                                     f"m={backend.url}"], tmp_path / "picker2.log")
            # the data plane's gRPC channel reconnects with back-off (as Envoy's does): answers come back
            await_ok = time.monotonic() + 30
            while httpx.post(f"{url}/v1/completions", json=chat("m", "c"), timeout=30).status_code != 200:
                assert time.monotonic() < await_ok, "no answer 30 s after the picker came back"
                time.sleep(0.2)
    finally:
        picker.stop()
        backend.stop()


def test_a_backend_killed_after_the_pick_fails_over_to_the_fallback(tmp_path):
    """The picker names fallbacks: a backend that dies between the pick and the connection costs the client
    nothing (the data plane goes down the list), and the picker stops naming it once its health check sees."""
    backends = [FakeBackendProcess(n) for n in "AB"]
    port = free_port()
    picker = GatewayProcess(["--endpoint-picker", "--picker-port", str(port), "--health-interval", "0.2",
                             *(a for b in backends for a in ("--backend", f"m={b.url}"))], tmp_path / "picker.log")
    try:
        with run_extproc_gateway(["--epp", f"127.0.0.1:{port}"]) as url:
            first = httpx.post(f"{url}/v1/completions", json=chat("m", "sticky"), timeout=30).headers[SERVED]
            dead = next(b for b in backends if b.url.endswith(first))
            dead.signal(signal.SIGKILL)
            dead.proc.wait(10)
            r = httpx.post(f"{url}/v1/completions", json=chat("m", "sticky"), timeout=30)
            assert r.status_code == 200 and r.headers[SERVED] != first  # the fallback took it
    finally:
        picker.stop()
        for b in backends:
            b.stop()
