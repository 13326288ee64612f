"""The gateway's peer port as a hostile neighbour meets it (issue 42: its answers carry tenants' usage, which quotas
trust): without the peer token nothing is answered; a "peer" that answers with forged, malformed or oversized usage
is not believed, and the tenant it targets is still admitted. In-process gateway on 127.0.0.1, bounded in time."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from aiohttp import web
from gateway_fakes import FakeBackend, chat, start_gateway, wait_until
from servers import free_port

from sluice_autoscaler.quota import ALL_ENDPOINTS

pytestmark = pytest.mark.asyncio

KEYS = "tenants:\n  team-a:\n    keys: [sk-a]\n    limits: {tokensPerMinute: 1000}\n"


async def forged_peer(answer: bytes) -> tuple[web.AppRunner, str]:
    """A 'replica' on the peer path answering `answer` to every poll (as if the token were stolen, or no token)."""
    async def demand(_: web.Request) -> web.Response:
        return web.Response(body=answer, content_type="application/json")

    app = web.Application()
    app.router.add_get("/peer/demand", demand)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("answer", [
    b'{"replica": "x", "epoch": 1, "demand": {}, "usage": {"team-a\\t*": [[1, 1, "lots"]]}}',  # malformed bucket
    b'{"replica": "x", "epoch": 1, "demand": {}, "usage": {"team-a\\t*": [' + b",".join([b"[1, 1, 1]"] * 100)
    + b"]}}",  # more buckets than a minute has
    b'{"replica": "x", "epoch": 1, "demand": {}, "usage": "' + b"x" * (9 << 20) + b'"}',  # over the 8 MiB bound
])
async def test_a_forged_peers_usage_is_not_believed(tmp_path, answer):
    keys = tmp_path / "keys.yaml"
    keys.write_text(KEYS)
    backend = await FakeBackend("pod", model="chat").start()
    runner, url = await forged_peer(answer)
    gw = await start_gateway(backends=[f"chat={backend.url}"], api_keys_file=str(keys), peers=[url],
                             peer_interval=0.2)
    try:
        await asyncio.sleep(1.0)  # several polls of the forged peer
        assert gw.usage.peers.get(url) is None
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
            r = await c.post("/v1/chat/completions", json=chat("chat", "hi"), headers={"Authorization": "Bearer sk-a"})
            assert r.status_code == 200, r.text
    finally:
        await gw.stop()
        await runner.cleanup()
        await backend.stop()


async def test_without_the_token_the_peer_port_answers_nothing(tmp_path):
    token = tmp_path / "peer-token"
    token.write_text("the-replicas-secret")
    keys = tmp_path / "keys.yaml"
    keys.write_text(KEYS)
    backend = await FakeBackend("pod", model="chat").start()
    port = free_port()
    gw = await start_gateway(backends=[f"chat={backend.url}"], api_keys_file=str(keys), peer_port=port,
                             peer_token_file=str(token))
    try:
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(f"{gw.url}/v1/chat/completions", json=chat("chat", "hi"),
                             headers={"Authorization": "Bearer sk-a"})
            assert r.status_code == 200
            await wait_until(lambda: gw.usage.local_snapshot() != {}, timeout=5)
            for headers in ({}, {"Authorization": "Bearer guess"}, {"Authorization": "Basic dGhlLXJlcGxpY2Fz"}):
                r = await c.get(f"http://127.0.0.1:{port}/peer/demand", params={"wait": "30"}, headers=headers)
                assert r.status_code == 401  # at once: no long poll held open for a stranger
                assert "team-a" not in r.text and json.loads(r.text)["error"]
        assert gw.usage.used("team-a", ALL_ENDPOINTS, int(gw.usage.clock()))[0] == 1
    finally:
        await gw.stop()
        await backend.stop()
