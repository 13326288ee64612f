"""The gateway's proxy against fake OpenAI backends on loopback: streaming, holding and its limits, retries,
the warm pool, API keys, backends-file reloads. (Real engines: test_gateway_engine.py.)"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from aiohttp import web
from gateway_fakes import FakeBackend, chat, start_gateway, wait_until

pytestmark = pytest.mark.asyncio


def gauge(gw, name: str, key: str = "m") -> float:
    d = gw.demand[key]
    return {"pending": d.held, "inflight": d.inflight}[name]


def counter(gw, outcome: str, key: str = "m") -> float:
    return gw.metrics.requests.labels(key, outcome)._value.get()


async def test_sse_passes_through_as_the_backend_sends_it():
    backend = await FakeBackend("A", chunks=4, delay=0.3).start()
    gw = await start_gateway(backends=[f"m={backend.url}"])
    try:
        await wait_until(lambda: gw.registry.by_model("m").candidates()[0])
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
            t0 = time.monotonic()
            arrivals = []
            async with c.stream("POST", "/v1/chat/completions", json=chat("m", "hi", stream=True)) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.monotonic() - t0)
        assert len(arrivals) == 4
        # Chunks arrive spread out as the backend wrote them, not all at once at the end.
        assert arrivals[0] < 0.9 and arrivals[-1] - arrivals[0] > 0.6
        assert counter(gw, "ok") == 1
    finally:
        await gw.stop()
        await backend.stop()


async def test_request_held_until_a_backend_is_ready():
    backend = await FakeBackend("A").start()
    backend.ready = False  # loading
    gw = await start_gateway(backends=[f"m={backend.url}"])
    try:
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
            pending = asyncio.create_task(c.post("/v1/chat/completions", json=chat("m", "hi")))
            await wait_until(lambda: gauge(gw, "pending") == 1)
            metrics = (await c.get("/metrics")).text
            assert 'sluice_gateway_pending_requests{endpoint="m"} 1.0' in metrics
            assert 'sluice_gateway_backends{endpoint="m",role="serving",state="cold"} 1.0' in metrics
            assert not pending.done()
            backend.ready = True  # the replica finished loading
            r = await asyncio.wait_for(pending, 5)
            assert r.status_code == 200 and r.json()["backend"] == "A"
            assert gauge(gw, "pending") == 0 and gauge(gw, "inflight") == 0
            assert gw.metrics.hold_seconds.labels("m")._sum.get() > 0
    finally:
        await gw.stop()
        await backend.stop()


async def test_hold_limits_429_and_503_with_retry_after():
    gw = await start_gateway(backends_file="/nonexistent/so/no/backends.yaml", backends=["m=http://127.0.0.1:9"],
                             max_held=2, hold_timeout=1.0, retry_after=7)
    try:
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
            held = [asyncio.create_task(c.post("/v1/chat/completions", json=chat("m", f"q{i}"))) for i in range(2)]
            await wait_until(lambda: gauge(gw, "pending") == 2)
            r = await c.post("/v1/completions", json={"model": "m", "prompt": "one too many"})
            assert r.status_code == 429 and r.headers["retry-after"] == "7"
            assert r.json()["error"]["type"] == "rate_limit_error" and "--max-held 2" in r.json()["error"]["message"]
            for r in await asyncio.gather(*held):
                assert r.status_code == 503 and r.headers["retry-after"] == "7"
                err = r.json()["error"]
                assert err["code"] == "hold_timeout" and "became ready within 1s" in err["message"]
        assert gauge(gw, "pending") == 0
        assert counter(gw, "rejected") == 1 and counter(gw, "hold_timeout") == 2
    finally:
        await gw.stop()


async def test_held_stream_gets_keepalives_then_tokens_or_an_error_event():
    backend = await FakeBackend("A", chunks=2).start()
    backend.ready = False
    gw = await start_gateway(backends=[f"m={backend.url}"], keepalive_interval=0.1, hold_timeout=30)
    try:
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
            lines = []
            async with c.stream("POST", "/v1/chat/completions", json=chat("m", "hi", stream=True)) as r:
                assert r.status_code == 200  # headers went out with the first keep-alive
                async for line in r.aiter_lines():
                    lines.append(line)
                    if sum(1 for x in lines if x.startswith(":")) == 3:
                        backend.ready = True
            comments = [x for x in lines if x.startswith(": sluice-gateway")]
            data = [x for x in lines if x.startswith("data:")]
            assert len(comments) >= 3 and lines.index(comments[0]) < lines.index(data[0])
            assert [json.loads(x[6:])["backend"] for x in data[:-1]] == ["A", "A"] and data[-1] == "data: [DONE]"
        # A held stream that times out after its headers went out ends with an error event.
        gw.cfg.hold_timeout = 0.35
        backend.ready = False
        await wait_until(lambda: not gw.registry.by_model("m").candidates()[0])
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
            async with c.stream("POST", "/v1/chat/completions", json=chat("m", "hi", stream=True)) as r:
                text = (await r.aread()).decode()
            assert r.status_code == 200 and text.startswith(": sluice-gateway")
            event = json.loads(text.strip().splitlines()[-1][6:])
            assert event["error"]["code"] == "hold_timeout"
    finally:
        await gw.stop()
        await backend.stop()


async def test_a_client_that_leaves_is_no_longer_held():
    gw = await start_gateway(backends=["m=http://127.0.0.1:9"])
    try:
        async with httpx.AsyncClient(base_url=gw.url, timeout=0.5) as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.post("/v1/chat/completions", json=chat("m", "hi"))
        await wait_until(lambda: gauge(gw, "pending") == 0, timeout=5)
        assert counter(gw, "client_gone") == 1
    finally:
        await gw.stop()


async def test_retries_go_to_another_backend_before_anything_was_sent():
    good = await FakeBackend("good").start()
    busy = await FakeBackend("busy").start()
    busy.status = 503  # e.g. the engine's queue is full
    gw = await start_gateway(backends=[f"m={good.url}", f"m={busy.url}"], routing="round-robin")
    try:
        await wait_until(lambda: len(gw.registry.by_model("m").candidates()[0]) == 2)
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
            for i in range(4):
                r = await c.post("/v1/chat/completions", json=chat("m", f"q{i}"))
                assert r.status_code == 200 and r.json()["backend"] == "good"
            assert gw.metrics.retries.labels("m")._value.get() >= 1
            good.status = 503  # nobody left to try: the backend's own 503 goes back, Retry-After included
            r = await c.post("/v1/chat/completions", json=chat("m", "x"))
            assert r.status_code == 503 and r.headers["retry-after"] == "1" and "says 503" in r.text
            good.status = None
            # connection refused: the backend is dropped from routing until /ready answers again
            port = int(good.url.rsplit(":", 1)[1])
            await good.stop()
            busy.status = None
            r = await c.post("/v1/chat/completions", json=chat("m", "after the crash"))
            assert r.status_code == 200 and r.json()["backend"] == "busy"
            ep = gw.registry.by_model("m")
            assert [b.url for b in ep.candidates()[0]] == [busy.url]
            await FakeBackend("good again").start(port)  # it comes back on the same address
            await wait_until(lambda: len(ep.candidates()[0]) == 2)
    finally:
        await gw.stop()
        await busy.stop()


async def test_midstream_failure_ends_with_an_error_event():
    async def dies_midstream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"delta": {"content": "partial"}}]}\n\n')
        await asyncio.sleep(0.1)
        request.transport.close()  # the process died
        return resp

    async def ready(_: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/ready", ready)
    app.router.add_post("/v1/chat/completions", dies_midstream)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    gw = await start_gateway(backends=[f"m={url}"])
    try:
        await wait_until(lambda: gw.registry.by_model("m").candidates()[0])
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
            async with c.stream("POST", "/v1/chat/completions", json=chat("m", "hi", stream=True)) as r:
                lines = [x async for x in r.aiter_lines() if x]
        assert "partial" in lines[0]
        assert json.loads(lines[-1][6:])["error"]["code"] == "backend_failed"
        assert counter(gw, "backend_failed") == 1 and gauge(gw, "inflight") == 0
    finally:
        await gw.stop()
        await runner.cleanup()


async def test_warm_pool_answers_while_serving_is_cold_then_traffic_moves_back():
    serving = await FakeBackend("serving").start()
    standby = await FakeBackend("standby").start()
    serving.ready = False
    gw = await start_gateway(backends=[f"m={serving.url}"], standby=[f"m={standby.url}"])
    try:
        await wait_until(lambda: gw.registry.by_model("m").candidates()[0])
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
            t0 = time.monotonic()
            r = await c.post("/v1/chat/completions", json=chat("m", "cold"))
            assert r.json()["backend"] == "standby" and r.headers["x-sluice-role"] == "standby"
            assert time.monotonic() - t0 < 0.5  # not held: the warm pool answered at once
            assert gw.metrics.standby.labels("m")._value.get() == 1
            serving.ready = True
            await wait_until(lambda: gw.registry.by_model("m").candidates()[1] is False)
            for i in range(3):
                r = await c.post("/v1/chat/completions", json=chat("m", f"warm {i}"))
                assert r.json()["backend"] == "serving"
    finally:
        await gw.stop()
        await serving.stop()
        await standby.stop()


async def test_api_keys_per_endpoint(tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  locked: [sk-right]\nopen: [open]\n")
    locked = await FakeBackend("L", model="locked").start()
    opened = await FakeBackend("O", model="open").start()
    other = await FakeBackend("X", model="unnamed").start()
    gw = await start_gateway(backends=[f"locked={locked.url}", f"open={opened.url}", f"unnamed={other.url}"],
                             api_keys_file=str(keys))
    try:
        await wait_until(lambda: all(ep.candidates()[0] for ep in gw.registry.models()))
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
            r = await c.post("/v1/chat/completions", json=chat("locked", "hi"))
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            err = r.json()["error"]
            assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
            assert "requires an API key" in err["message"] and "Authorization: Bearer" in err["message"]
            r = await c.post("/v1/chat/completions", json=chat("locked", "hi"), headers={"Authorization": "Bearer sk-no"})
            assert r.status_code == 401 and "not valid" in r.json()["error"]["message"]
            ok = {"Authorization": "Bearer sk-right"}
            r = await c.post("/v1/chat/completions", json=chat("locked", "hi"), headers=ok)
            assert r.status_code == 200
            assert "authorization" not in {k.lower() for k in locked.headers[-1]}  # not passed to the backend
            # Opted out: open to anyone. Named nowhere: closed (closed by default once keys are configured).
            assert (await c.post("/v1/chat/completions", json=chat("open", "hi"))).status_code == 200
            assert (await c.post("/v1/chat/completions", json=chat("unnamed", "hi"), headers=ok)).status_code == 401
            assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == ["open"]
            assert [m["id"] for m in (await c.get("/v1/models", headers=ok)).json()["data"]] == ["locked", "open"]
            # An unknown model's 404 lists only what the caller may use.
            r = await c.post("/v1/chat/completions", json=chat("nope", "hi"))
            assert r.status_code == 404 and r.json()["error"]["message"].endswith("models available to you: open")
            r = await c.post("/v1/chat/completions", json=chat("nope", "hi"), headers=ok)
            assert r.json()["error"]["message"].endswith("models available to you: locked, open")
            keys.write_text('"*": [sk-new]\n')  # rotated (the flat form): every endpoint needs a key
            await asyncio.sleep(0.01)
            r = await c.post("/v1/chat/completions", json=chat("open", "hi"))
            assert r.status_code == 401
            r = await c.post("/v1/chat/completions", json=chat("locked", "hi"), headers={"Authorization": "Bearer sk-new"})
            assert r.status_code == 200
            assert counter(gw, "unauthorized", "locked") == 2
    finally:
        await gw.stop()
        for b in (locked, opened, other):
            await b.stop()


async def test_api_key_is_checked_before_the_body_is_read(tmp_path, caplog):
    keys = tmp_path / "keys.yaml"
    keys.write_text('"*": [sk-secret-123]\n')
    gw = await start_gateway(backends=["m=http://127.0.0.1:9"], api_keys_file=str(keys), hold_timeout=0.3)
    try:
        # Headers announcing a 1 MiB body, and no body at all: the 401 comes anyway, so none of it was awaited.
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1048576\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 401") and b"Connection: close" in head
        writer.close()
        assert gw.metrics.refused.labels("unauthorized")._value.get() == 1
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
            # No key material in the logs: a broken file is reported by position, not quoted.
            keys.write_text('"*": [sk-secret-456\n')
            await asyncio.sleep(0.01)
            r = await c.post("/v1/chat/completions", json=chat("m", "hi"), headers={"Authorization": "Bearer sk-secret-123"})
            assert r.status_code != 401  # the previous keys stay
        assert "keeping the previous keys" in caplog.text
        assert "sk-secret" not in caplog.text
    finally:
        await gw.stop()


async def test_backends_file_is_reread_on_change(tmp_path):
    path = tmp_path / "backends.yaml"
    backend = await FakeBackend("A", model="late").start()
    gw = await start_gateway(backends_file=str(path))
    try:
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
            r = await c.post("/v1/chat/completions", json=chat("late", "hi"))
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            path.write_text(f"endpoints:\n  - model: late\n    name: ns/late\n    serving: [{backend.url}]\n")
            await wait_until(lambda: gw.registry.by_model("late") is not None, timeout=5)
            r = await c.post("/v1/chat/completions", json=chat("late", "hi"))
            assert r.status_code == 200 and r.json()["backend"] == "A"
            assert (await c.get("/v1/models")).json()["data"][0]["endpoint"] == "ns/late"
            assert (await c.get("/v1/models/late")).json()["id"] == "late"
            assert (await c.get("/v1/models/org/other")).status_code == 404
            path.write_text("endpoints: [")  # broken: the last good list stays
            await asyncio.sleep(1.2)
            assert gw.registry.by_model("late") is not None
            r = await c.post("/v1/chat/completions", content=b"{not json")
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    finally:
        await gw.stop()
        await backend.stop()


async def test_shutdown_answers_held_requests():
    gw = await start_gateway(backends=["m=http://127.0.0.1:9"])
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        held = asyncio.create_task(c.post("/v1/chat/completions", json=chat("m", "hi")))
        await wait_until(lambda: gauge(gw, "pending") == 1)
        await gw.stop()  # SIGTERM: a held request is told to retry, not dropped
        r = await held
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "shutting_down"


async def test_hostile_bodies_get_4xx_never_5xx():
    backend = await FakeBackend("A").start()
    gw = await start_gateway(backends=[f"m={backend.url}"])
    try:
        await wait_until(lambda: gw.registry.by_model("m").candidates()[0])
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
            cases = {
                b"[" * 100_000 + b"]" * 100_000: 400,  # nested past the parser's recursion
                b"\xff\xfe not utf-8": 400,
                b"[1, 2]": 400,
                b'{"model": 7}': 400,
                b'{"model": "m" * 3}': 400,
                b'{"model": "' + b"x" * 100_000 + b'"}': 404,
                b'{"model": "m", "messages": [1, {"role": {"x": 1}, "content": [null, {"text": 5}]}]}': 200,
                b'{"model": "m", "prompt": "\\ud800 lone surrogate"}': 200,
                b'{"model": "m", "messages": [{"role": "user", "content": "\\udfff"}]}': 200,
                b'{"model": "m", "prompt": [[1, 2], [3]]}': 200,
            }
            for body, status in cases.items():
                r = await c.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
                assert r.status_code == status, (body[:60], r.status_code, r.text[:200])
                if status != 200:
                    assert r.json()["error"]["type"] in ("invalid_request_error", "not_found_error")
                    assert len(r.content) < 2000  # a long model name is not echoed whole
    finally:
        await gw.stop()
        await backend.stop()


async def test_an_endpoints_objectives_set_the_priority_the_engine_gets(tmp_path):
    """spec.routing.objectives (here the backends file's): the header's objective decides the request's priority,
    in the engine's convention; a client's own is dropped; an endpoint without objectives passes it on."""
    a, b = await FakeBackend("A").start(), await FakeBackend("B", model="plain").start()
    path = tmp_path / "backends.yaml"
    path.write_text(json.dumps({"endpoints": [
        {"model": "m", "serving": [a.url], "objectives": [{"name": "critical", "priority": 10},
                                                          {"name": "batch", "priority": -1}]},
        {"model": "plain", "serving": [b.url]}]}))
    gw = await start_gateway(backends_file=str(path))
    try:
        await wait_until(lambda: gw.registry.by_model("m") and gw.registry.by_model("m").candidates()[0]
                         and gw.registry.by_model("plain").candidates()[0])
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
            for objective, sent in (("critical", -10), ("batch", 1), ("unknown", None), (None, None)):
                headers = {"x-gateway-inference-objective": objective} if objective else {}
                r = await c.post("/v1/chat/completions", json=chat("m", "hi", priority=-99), headers=headers)
                assert r.status_code == 200
                assert a.requests[-1].get("priority") == sent, (objective, a.requests[-1])
            r = await c.post("/v1/chat/completions", json=chat("plain", "hi", priority=3),
                             headers={"x-gateway-inference-objective": "critical"})
            assert r.status_code == 200 and b.requests[-1]["priority"] == 3  # no objectives: the client's own
    finally:
        await gw.stop()
        await a.stop()
        await b.stop()
