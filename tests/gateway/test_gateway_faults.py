"""The gateway's fault suite (issue 13, item 7), on 127.0.0.1 only, each case bounded in time:

- a backend SIGKILLed mid-stream: its streams end with an error event, its non-streamed requests go to
  another backend, nothing hangs;
- a backend SIGSTOPped (hung): --read-timeout notices it; a stream ends with an error event, a request that
  got nothing yet is retried elsewhere, and the hung backend takes no more traffic;
- a 500 the engine attributed to the request (code request_failed) reaches one backend only, and so does a
  4xx; a dead engine's 500 (engine_dead) and a draining engine's 503 (shutting_down) are retried elsewhere;
- held-request limits (count and bytes, per endpoint and in total: 429), body limit (413) and the bound on
  bodies in memory (503), with the gateway's resident memory measured under a flood of large bodies;
- a client that leaves: the backend's answer is cut (the engine aborts the request), held or in flight;
  against a real engine, its running count returns to 0;
- the KEDA external scaler, run from the CLI with --scaler-token-file, refuses calls without the token.

Fake backends are aiohttp apps (tests/support/gateway_fakes.py); those that get signals run as their own processes.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import grpc
import httpx
import pytest
from gateway_fakes import FakeBackend, FakeBackendProcess, GatewayProcess, chat, start_gateway, wait_until
from servers import rss_mib

from sluice_autoscaler import externalscaler_pb2 as pb
from sluice_autoscaler import externalscaler_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]  # and every wait below has its own bound

MiB = 2**20


def counter(gw, outcome: str, key: str = "m") -> float:
    return gw.metrics.requests.labels(key, outcome)._value.get()


async def read_stream(c: httpx.AsyncClient, body: dict, on_chunk=None) -> tuple[int, list[str], str | None]:
    """(status, data lines, backend that served it)."""
    lines: list[str] = []
    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
        backend = r.headers.get("x-sluice-backend")
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                lines.append(line)
                if on_chunk is not None:
                    await on_chunk(len(lines), backend)
    return r.status_code, lines, backend


def last_error(lines: list[str]) -> dict | None:
    for line in reversed(lines):
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            return event.get("error")
    return None


# -- a backend dies or hangs ----------------------------------------------------------------------------------
async def test_backend_sigkilled_mid_stream():
    a = await asyncio.to_thread(FakeBackendProcess, "A", chunks=40, delay=0.05)
    b = await asyncio.to_thread(FakeBackendProcess, "B", chunks=40, delay=0.05)
    by_url = {a.url: a, b.url: b}
    gw = await start_gateway(backends=[f"m={a.url}", f"m={b.url}"], routing="round-robin")
    try:
        await wait_until(lambda: len(gw.registry.by_model("m").candidates()[0]) == 2)
        killed: list[str] = []

        async def kill_after_5(n: int, url: str) -> None:
            if n == 5 and not killed:
                killed.append(url)
                by_url[url].signal(signal.SIGKILL)

        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
            t0 = time.monotonic()
            status, lines, served = await read_stream(c, chat("m", "kill me", stream=True), kill_after_5)
            assert time.monotonic() - t0 < 10  # ended, did not hang
            assert status == 200 and killed == [served]
            assert len(lines) >= 5 and lines[-1] != "data: [DONE]"
            assert last_error(lines)["code"] == "backend_failed"
            assert counter(gw, "backend_failed") == 1
            survivor = b if served == a.url else a
            # The dead backend is out of routing; everything goes to the survivor, streamed or not.
            for i in range(3):
                r = await c.post("/v1/chat/completions", json=chat("m", f"after {i}"))
                assert r.status_code == 200 and r.json()["backend"] == survivor.name
            status, lines, served = await read_stream(c, chat("m", "after", stream=True))
            assert served == survivor.url and lines[-1] == "data: [DONE]"
        assert gw.demand["m"].inflight == 0
    finally:
        await gw.stop()
        a.stop()
        b.stop()


async def test_backend_killed_during_a_non_streamed_request_is_retried_elsewhere():
    a = await asyncio.to_thread(FakeBackendProcess, "A", delay=2.0)  # a long generation
    b = await asyncio.to_thread(FakeBackendProcess, "B", delay=2.0)
    by_url = {a.url: a, b.url: b}
    gw = await start_gateway(backends=[f"m={a.url}", f"m={b.url}"])
    try:
        ep = gw.registry.by_model("m")
        await wait_until(lambda: len(ep.candidates()[0]) == 2)
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
            pending = asyncio.create_task(c.post("/v1/chat/completions", json=chat("m", "long")))
            await wait_until(lambda: any(x.inflight for x in ep.backends.values()))
            (busy,) = [x.url for x in ep.backends.values() if x.inflight]
            await asyncio.sleep(0.3)
            by_url[busy].signal(signal.SIGKILL)
            r = await asyncio.wait_for(pending, 10)
            other = b if busy == a.url else a
            assert r.status_code == 200 and r.json()["backend"] == other.name  # nothing had reached the client
            assert gw.metrics.retries.labels("m")._value.get() == 1
    finally:
        await gw.stop()
        a.stop()
        b.stop()


def write_backends(path, urls: list[str]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"endpoints": [{"model": "m", "serving": urls}]}))
    tmp.replace(path)


async def test_backend_sigstopped_is_noticed_by_the_read_timeout(tmp_path):
    a = await asyncio.to_thread(FakeBackendProcess, "A", chunks=40, delay=0.05)
    b = await asyncio.to_thread(FakeBackendProcess, "B", chunks=3, delay=0.05)
    backends = tmp_path / "backends.json"
    write_backends(backends, [a.url])
    gw = await start_gateway(backends_file=str(backends), read_timeout=1.0, routing="round-robin")
    try:
        await wait_until(lambda: gw.registry.by_model("m") is not None)
        ep = gw.registry.by_model("m")
        await wait_until(lambda: ep.candidates()[0])
        stopped = []

        async def stop_after_3(n: int, url: str) -> None:
            if n == 3 and not stopped:
                stopped.append(url)
                a.signal(signal.SIGSTOP)

        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
            # Mid-stream: the stream ends with an error event about a second after the backend froze.
            t0 = time.monotonic()
            status, lines, served = await read_stream(c, chat("m", "freeze", stream=True), stop_after_3)
            assert status == 200 and stopped and served == a.url
            assert 1.0 <= time.monotonic() - t0 < 6
            err = last_error(lines)
            assert err["code"] == "backend_failed" and "went silent" in err["message"]
            assert not ep.candidates()[0]  # the hung backend takes no more traffic
            assert counter(gw, "backend_failed") == 1

            # Before any byte: a request sent to a hung backend is retried on another once the read times out.
            a.signal(signal.SIGCONT)
            write_backends(backends, [a.url, b.url])
            await wait_until(lambda: len(ep.candidates()[0]) == 2, timeout=10)
            a.signal(signal.SIGSTOP)
            results = []
            for i in range(2):  # round-robin: one of the two goes to A first
                t0 = time.monotonic()
                r = await c.post("/v1/chat/completions", json=chat("m", f"q{i}"))
                results.append((r.status_code, r.json().get("backend"), time.monotonic() - t0))
            assert all(s == 200 and who == "B" for s, who, _ in results), results
            assert gw.metrics.retries.labels("m")._value.get() == 1
            assert max(t for *_, t in results) < 6
        assert gw.demand["m"].inflight == 0
    finally:
        await gw.stop()
        a.stop()
        b.stop()


# -- failures attributed to the request are not spread ---------------------------------------------------------
async def test_a_request_failure_reaches_one_backend_only():
    backends = [await FakeBackend(name).start() for name in ("A", "B", "C")]
    gw = await start_gateway(backends=[f"m={x.url}" for x in backends], routing="round-robin")
    try:
        await wait_until(lambda: len(gw.registry.by_model("m").candidates()[0]) == 3)
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:

            async def attempt(status: int, code: str) -> tuple[httpx.Response, int]:
                for x in backends:
                    x.status, x.error_code = status, code
                    x.requests.clear()
                r = await c.post("/v1/chat/completions", json=chat("m", "bad"))
                return r, sum(len(x.requests) for x in backends)

            # The engine's own verdict on the request: one backend, and its answer as it is.
            r, reached = await attempt(500, "request_failed")
            assert reached == 1 and r.status_code == 500 and r.json()["error"]["code"] == "request_failed"
            assert counter(gw, "request_failed") == 1
            r, reached = await attempt(400, "invalid_value")
            assert reached == 1 and r.status_code == 400
            r, reached = await attempt(500, "internal_error")  # a 500 the gateway cannot place: not spread
            assert reached == 1 and r.status_code == 500
            assert gw.metrics.retries.labels("m")._value.get() == 0
            # A dead engine, a draining one: the backend's fault, so the next backend is tried.
            for status, code in ((500, "engine_dead"), (503, "shutting_down")):
                r, reached = await attempt(status, code)
                assert reached == 3 and r.status_code == status and r.headers["retry-after"] == "1"
            backends[0].status = None
            for status, code in ((500, "engine_dead"), (503, "shutting_down")):
                for x in backends[1:]:
                    x.status, x.error_code = status, code
                for i in range(3):
                    r = await c.post("/v1/chat/completions", json=chat("m", f"ok {i}"))
                    assert r.status_code == 200 and r.json()["backend"] == "A"
                await wait_until(lambda: len(gw.registry.by_model("m").candidates()[0]) == 3)
    finally:
        await gw.stop()
        for x in backends:
            await x.stop()


# -- bounded memory ------------------------------------------------------------------------------------------------
async def test_hold_limits_and_body_limits():
    gw = await start_gateway(backends=["m=http://127.0.0.1:9", "n=http://127.0.0.1:9"], hold_timeout=30,
                             max_held=3, max_held_total=5, max_held_bytes=300_000, max_held_bytes_total=450_000,
                             max_body_bytes=200_000, max_buffered_bytes=550_000, retry_after=4)
    try:
        async with httpx.AsyncClient(base_url=gw.url, timeout=30, limits=httpx.Limits(max_connections=None)) as c:
            def big(model: str, size: int) -> dict:
                return chat(model, "x" * size)

            async def held(model: str, size: int) -> asyncio.Task:
                n = gw.demand.held_total
                t = asyncio.create_task(c.post("/v1/chat/completions", json=big(model, size)))
                await wait_until(lambda: gw.demand.held_total == n + 1 or t.done())
                assert not t.done(), t.result().text
                return t

            async def refused(model: str, size: int, code: str, status: int = 429) -> str:
                r = await c.post("/v1/chat/completions", json=big(model, size))
                assert r.status_code == status, r.text
                assert r.json()["error"]["code"] == code
                if status in (429, 503):
                    assert r.headers["retry-after"] == "4"
                return r.json()["error"]["message"]

            # Bodies too large: declared, or sent chunked without a length.
            await refused("m", 300_000, "request_too_large", 413)

            async def chunked():
                for _ in range(30):
                    yield b" " * 10_000

            r = await c.post("/v1/chat/completions", content=chunked())
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
            # Held: count and bytes, per endpoint and in total.
            tasks = [await held("m", 100_000), await held("m", 100_000)]
            assert "--max-held-bytes 300000" in await refused("m", 150_000, "too_many_waiting")
            tasks.append(await held("m", 10))
            assert "--max-held 3" in await refused("m", 10, "too_many_waiting")
            tasks.append(await held("n", 190_000))
            assert "--max-held-bytes-total" in await refused("n", 100_000, "too_many_waiting")
            tasks.append(await held("n", 10))
            assert "--max-held-total" in await refused("n", 10, "too_many_waiting")
            assert gw.demand.held_bytes_total == sum(gw.demand[k].held_bytes for k in ("m", "n")) > 390_000
            # Bodies in memory: the held ones, and no more than --max-buffered-bytes.
            assert gw.proxy.budget.used > 390_000  # the held bodies
            assert "--max-buffered-bytes" in await refused("n", 199_000, "gateway_overloaded", 503)
            assert gw.metrics.refused.labels("too_large")._value.get() == 2
            assert gw.metrics.refused.labels("overloaded")._value.get() == 1
            assert counter(gw, "rejected", "m") == 2 and counter(gw, "rejected", "n") == 2
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await wait_until(lambda: gw.demand.held_total == 0 and gw.proxy.budget.used == 0, timeout=5)
        assert gw.demand.held_bytes_total == 0
    finally:
        await gw.stop()


@pytest.mark.slow
async def test_memory_stays_bounded_under_a_flood_of_large_bodies(tmp_path):
    """200 clients each send a 2 MiB body (400 MiB) for an endpoint at zero replicas. The gateway keeps at
    most --max-buffered-bytes (24 MiB) of bodies: the rest get 429/503 at once, and its resident memory
    grows by far less than what was offered."""
    gw = await asyncio.to_thread(
        GatewayProcess, ["--backend", "m=http://127.0.0.1:9", "--max-held-bytes", str(16 * MiB),
                         "--max-held-bytes-total", str(16 * MiB), "--max-buffered-bytes", str(24 * MiB),
                         "--max-body-bytes", str(4 * MiB), "--hold-timeout", "60", "--retry-after", "2"],
        tmp_path / "gateway.log")
    peak = [rss_mib(gw.proc.pid)]
    base = peak[0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_mib(gw.proc.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    body = json.dumps(chat("m", "y" * (2 * MiB))).encode()
    try:
        async with httpx.AsyncClient(base_url=gw.url, timeout=60, limits=httpx.Limits(max_connections=None)) as c:
            async def one() -> int:
                try:
                    r = await c.post("/v1/chat/completions", content=body,
                                     headers={"Content-Type": "application/json"})
                    return r.status_code
                except httpx.HTTPError:  # refused while still sending: the gateway closed the connection
                    return -1

            tasks = [asyncio.create_task(one()) for _ in range(200)]
            deadline = time.monotonic() + 60
            while sum(t.done() for t in tasks) < 192 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            m = await asyncio.to_thread(gw.metrics)
            held = m['sluice_gateway_pending_requests{endpoint="m"}']
            assert 1 <= held <= 8  # 16 MiB of 2 MiB bodies
            finished = [t.result() for t in tasks if t.done()]
            assert finished and set(finished) <= {429, 503, -1}, set(finished)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        done.set()
        sampler.join()
        growth = peak[0] - base
        print(f"gateway RSS {base:.0f} MiB at rest, peak {peak[0]:.0f} MiB under 400 MiB offered")
        assert growth < 120, f"resident memory grew by {growth:.0f} MiB"
    finally:
        done.set()
        gw.stop()


# -- a client that leaves --------------------------------------------------------------------------------------------
async def test_client_disconnect_reaches_the_backend():
    backend = await FakeBackend("A", chunks=100, delay=0.05).start()
    gw = await start_gateway(backends=[f"m={backend.url}"])
    try:
        await wait_until(lambda: gw.registry.by_model("m").candidates()[0])
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
            async with c.stream("POST", "/v1/chat/completions", json=chat("m", "bye", stream=True)) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        break  # one chunk, then the client goes
        await wait_until(lambda: backend.aborted == 1, timeout=5)
        await wait_until(lambda: gw.demand["m"].inflight == 0, timeout=5)
        assert counter(gw, "client_gone") == 1 and backend.completed == 0
        # A non-streamed request whose client gives up: the backend's work is cut as well.
        backend.delay = 10.0
        async with httpx.AsyncClient(base_url=gw.url, timeout=0.5) as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.post("/v1/chat/completions", json=chat("m", "impatient"))
        await wait_until(lambda: backend.aborted == 2, timeout=5)
        await wait_until(lambda: gw.demand["m"].inflight == 0, timeout=5)
    finally:
        await gw.stop()
        await backend.stop()


def engine_gauge(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


@pytest.mark.slow
async def test_client_disconnect_aborts_the_request_in_a_real_engine(start_server):
    from servers import SERVED_NAME

    engine = await asyncio.to_thread(start_server)
    gw = await start_gateway(backends=[f"{SERVED_NAME}={engine.url}"])
    try:
        await wait_until(lambda: gw.registry.by_model(SERVED_NAME).candidates()[0], timeout=30)
        body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Count to a thousand."}],
                "max_tokens": 2000, "min_tokens": 2000, "stream": True}
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as c:
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: {")
                    if seen == 3:  # generating for us now; then the client goes
                        running = await asyncio.to_thread(engine_gauge, engine.url, "sluice_num_requests_running")
                        assert running == 1
                        break
            running = await asyncio.to_thread(engine_gauge, engine.url, "sluice_num_requests_running")
            t0 = time.monotonic()
            while running > 0:
                assert time.monotonic() - t0 < 10, "the engine kept generating for a client that left"
                await asyncio.sleep(0.1)
                running = await asyncio.to_thread(engine_gauge, engine.url, "sluice_num_requests_running")
            assert await asyncio.to_thread(engine_gauge, engine.url, "sluice_num_requests_waiting") == 0
            # And the engine still answers.
            r = await c.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2, "min_tokens": 0})
            assert r.status_code == 200
    finally:
        await gw.stop()


# -- the KEDA external scaler ------------------------------------------------------------------------------------------
async def test_scaler_token_from_the_cli(tmp_path):
    token = tmp_path / "scaler-token"
    token.write_text("t0ken\n")
    gw = await asyncio.to_thread(GatewayProcess, ["--backend", "m=http://127.0.0.1:9", "--scaler-token-file",
                                                  str(token)], tmp_path / "gateway.log")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.scaler_port}") as channel:
            stub = pb_grpc.ExternalScalerStub(channel)
            ref = pb.ScaledObjectRef(name="m", namespace="ns", scalerMetadata={"endpoint": "m"})
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.IsActive(ref)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.StreamIsActive(ref).read()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            ref.scalerMetadata["scalerToken"] = "t0ken"
            assert (await stub.IsActive(ref)).result is False
        assert "t0ken" not in gw.log_path.read_text()
    finally:
        gw.stop()
