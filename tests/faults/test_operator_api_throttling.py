"""The operator's API client against a server that answers 429 (issue 24): right after a CRD is installed
the real kube-apiserver answers `429 storage is (re)initializing` with Retry-After, and API priority and
fairness throttles the same way. The client waits Retry-After and retries; a server that never stops
throttling fails the call with the server's own message, in bounded time."""

from __future__ import annotations

import asyncio
import time

import kopf
import pytest
from aiohttp import web

from sluice_operator.apply import ApiError, Kind, KubeApi

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


async def _server(throttled: int) -> tuple[web.AppRunner, str, list[float]]:
    seen: list[float] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(time.monotonic())
        if len(seen) <= throttled:
            return web.json_response({"kind": "Status", "status": "Failure", "code": 429, "reason": "TooManyRequests",
                                      "message": "storage is (re)initializing"}, status=429,
                                     headers={"Retry-After": "0.2"})
        return web.json_response({"kind": "ConfigMap", "metadata": {"name": request.match_info["name"]}})

    app = web.Application()
    app.router.add_get("/api/v1/namespaces/{ns}/configmaps/{name}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}", seen


CONFIGMAP = Kind("v1", "ConfigMap", "configmaps")


@pytest.mark.parametrize("throttled", [1, 3])
async def test_429_is_waited_out_and_retried(throttled: int) -> None:
    runner, url, seen = await _server(throttled)
    statuses: list[int | str] = []
    try:
        async with KubeApi(kopf.ConnectionInfo(server=url), on_request=lambda m, s: statuses.append(s)) as api:
            live = await api.get(CONFIGMAP, "default", "engine")
    finally:
        await runner.cleanup()
    assert live == {"kind": "ConfigMap", "metadata": {"name": "engine"}}
    assert statuses == [429] * throttled + [200]  # each attempt counted in the operator's metrics
    gaps = [b - a for a, b in zip(seen, seen[1:], strict=False)]
    assert all(g >= 0.18 for g in gaps), gaps  # Retry-After honoured


async def test_endless_429_fails_with_the_servers_message() -> None:
    runner, url, seen = await _server(throttled=10**6)
    try:
        async with KubeApi(kopf.ConnectionInfo(server=url)) as api:
            started = time.monotonic()
            with pytest.raises(ApiError) as err:
                await asyncio.wait_for(api.get(CONFIGMAP, "default", "engine"), 30)
            elapsed = time.monotonic() - started
    finally:
        await runner.cleanup()
    assert err.value.status == 429 and "storage is (re)initializing" in str(err.value)
    assert len(seen) == KubeApi.THROTTLE_RETRIES + 1 and elapsed < 5, (len(seen), elapsed)
