"""The OpenAI-compatible reverse proxy: one request's way through the gateway.

    body -> model -> endpoint -> API key check -> routing key (prompt prefix)
      -> candidates (ready serving; ready standby while serving is cold)
           none: hold (bounded by --max-held and --hold-timeout; demand signalled at once; a held stream gets
                 its headers and SSE keep-alive comments) until the endpoint changes, then look again
      -> router picks one -> forward -> SSE chunks go to the client as they arrive
      -> the backend fails before any of its bytes reached the client: try another backend
         after: the stream ends with an OpenAI-shaped error event
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from .auth import ApiKeys
from .config import GatewayConfig
from .demand import DemandBoard
from .metrics import GatewayMetrics
from .prefix import routing_key
from .registry import STANDBY, Backend, Endpoint, Registry
from .router import Router

log = logging.getLogger("sluice.gateway")

SSE_TYPE = "text/event-stream"
SSE_HEADERS = {"Content-Type": SSE_TYPE, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
KEEPALIVE = b": sluice-gateway: waiting for a ready backend\n\n"
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "transfer-encoding", "upgrade", "host", "content-length"}
# Not forwarded upstream: the gateway's own credentials, and encodings it would have to undo.
DROP_UPSTREAM = HOP_BY_HOP | {"authorization", "accept-encoding", "cookie"}
DROP_DOWNSTREAM = HOP_BY_HOP | {"content-encoding", "date", "server"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               429: "rate_limit_error", 503: "service_unavailable"}


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape, as the engine answers it too."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def json_error(status: int, message: str, code: str | None = None, param: str | None = None,
               headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(status, message, code, param), status=status, headers=headers)


def sse_event(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


class Reject(Exception):
    """Ends a request with an error of the gateway's own."""

    def __init__(self, status: int, message: str, code: str, outcome: str, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.outcome = status, message, code, outcome
        self.headers = {"Retry-After": str(retry_after)} if retry_after is not None else None


class ClientGone(Exception):
    pass


@dataclass(slots=True)
class Failure:
    """A backend attempt that sent nothing to the client: retried elsewhere, or relayed at the end."""

    reason: str
    status: int | None = None  # the backend's 5xx, or None when it could not be reached
    body: bytes = b""
    headers: CIMultiDictProxy[str] | None = None


class Proxy:
    def __init__(self, cfg: GatewayConfig, registry: Registry, demand: DemandBoard, metrics: GatewayMetrics,
                 keys: ApiKeys):
        self.cfg, self.registry, self.demand, self.metrics, self.keys = cfg, registry, demand, metrics, keys
        self.router = Router(cfg.routing, cfg.load_factor)
        self.session: aiohttp.ClientSession | None = None
        self.started = int(time.time())

    async def start(self) -> None:
        # No total or read timeout: a generation may take minutes. Connecting must be quick.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout))

    async def stop(self) -> None:
        if self.session:
            await self.session.close()

    # -- routes ------------------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/* : every OpenAI call that names a model in its JSON body."""
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError as e:
            return json_error(400, f"request body is not valid JSON: {e}", "invalid_json")
        if not isinstance(body, dict):
            return json_error(400, "request body must be a JSON object", "invalid_value")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return json_error(400, "missing required field 'model'", "invalid_value", "model")
        ep = self.registry.by_model(model)
        if ep is None:
            served = ", ".join(e.model for e in self.registry.models()) or "none"
            return json_error(404, f"model '{model}' does not exist; this gateway serves: {served}",
                              "model_not_found", "model")
        denied = self.keys.check(ep.key, ep.model, request.headers.get("Authorization"))
        if denied:
            self.metrics.finished(ep.key, "unauthorized")
            return json_error(401, denied, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        key = routing_key(body, self.cfg.prefix_chars) if self.cfg.routing == "prefix" else None
        return await Exchange(self, request, ep, raw, body.get("stream") is True, key).run()

    async def models(self, request: web.Request) -> web.Response:
        auth = request.headers.get("Authorization")
        data = []
        for ep in self.registry.models():
            if self.keys.check(ep.key, ep.model, auth) is not None:
                continue  # a key-protected endpoint this caller cannot use
            want = request.match_info.get("model")
            if want is not None and want != ep.model:
                continue
            data.append({"id": ep.model, "object": "model", "created": self.started, "owned_by": "sluice",
                         "endpoint": ep.key, "ready": bool(ep.candidates()[0])})
        if "model" in request.match_info:
            if not data:
                return json_error(404, f"model '{request.match_info['model']}' does not exist", "model_not_found")
            return web.json_response(data[0])
        return web.json_response({"object": "list", "data": data})

    async def metrics_route(self, _: web.Request) -> web.Response:
        body, content_type = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})


class Exchange:
    """One client request: hold while nothing is ready, pick a backend, forward, maybe retry."""

    def __init__(self, proxy: Proxy, request: web.Request, ep: Endpoint, raw: bytes, stream: bool, key: str | None):
        self.p, self.request, self.ep, self.raw, self.stream, self.key = proxy, request, ep, raw, stream, key
        self.cfg = proxy.cfg
        self.demand = proxy.demand[ep.key]
        self.resp: web.StreamResponse | None = None  # headers sent (a held stream's keep-alive, or a backend's)
        self.committed = False  # a backend's bytes reached the client: no retry from here on
        self.held_since: float | None = None
        self.holding = False
        self.outcome: str | None = None

    # -- the loop --------------------------------------------------------------------------------------------
    async def run(self) -> web.StreamResponse:
        try:
            return await self._run()
        except Reject as r:
            self.outcome = r.outcome
            return await self._error(r.status, error_body(r.status, r.message, r.code), r.headers)
        except ClientGone:
            self.outcome = "client_gone"
            return self.resp or web.Response(status=499)
        finally:  # also on cancellation (the client went away while held or waiting)
            self._end_hold()
            self.p.metrics.finished(self.ep.key, self.outcome or "client_gone")

    async def _run(self) -> web.StreamResponse:
        tried: set[str] = set()
        attempts = 0
        last: Failure | None = None
        while True:
            if self.ep.removed:
                raise Reject(404, f"model '{self.ep.model}' is no longer served", "model_not_found", "unavailable")
            candidates, _ = self.ep.candidates()
            if not candidates:
                if self.p.registry.closing:
                    raise Reject(503, "the gateway is shutting down; retry", "shutting_down", "unavailable", 1)
                await self._hold()
                tried.clear()  # the endpoint changed: a backend tried before may be back
                continue
            fresh = [b for b in candidates if b.url not in tried]
            if not fresh or attempts >= self.cfg.max_attempts:
                return await self._give_up(last)
            b = self.p.router.pick(fresh, self.key)
            assert isinstance(b, Backend)
            attempts += 1
            tried.add(b.url)
            if attempts > 1:
                self.p.metrics.retries.labels(self.ep.key).inc()
            result = await self._forward(b)
            if isinstance(result, Failure):
                log.info("endpoint %s: %s; %s", self.ep.key, result.reason,
                         "retrying on another backend" if attempts < self.cfg.max_attempts else "giving up")
                last = result
                continue
            return result

    async def _give_up(self, last: Failure | None) -> web.StreamResponse:
        if last is not None and last.status is not None:  # the backend's own 5xx: pass it on
            return await self._reply(last.status, last.body, last.headers)
        reason = last.reason if last else "no backend left to try"
        raise Reject(502, f"no backend of model '{self.ep.model}' could take the request ({reason})",
                     "backend_unreachable", "unavailable")

    # -- holding -----------------------------------------------------------------------------------------------
    async def _hold(self) -> None:
        """Wait until the endpoint changes. Counts as held from the first call until a backend takes it."""
        loop = asyncio.get_running_loop()
        if self.held_since is None:
            if self.demand.held >= self.cfg.max_held:
                raise Reject(429, f"{self.demand.held} requests are already waiting for model '{self.ep.model}' "
                             f"to get a ready backend (--max-held {self.cfg.max_held}); retry later",
                             "too_many_waiting", "rejected", self.cfg.retry_after)
            self.held_since = self._next_keepalive = loop.time()
            self._next_keepalive += self.cfg.keepalive_interval
            self.holding = True
            self.demand.add(held=1)  # StreamIsActive subscribers hear of it now
        deadline = self.held_since + self.cfg.hold_timeout
        while True:
            now = loop.time()
            if now >= deadline:
                raise Reject(503, f"no backend of model '{self.ep.model}' became ready within "
                             f"{self.cfg.hold_timeout:g}s (it may still be scaling up from zero); retry later",
                             "hold_timeout", "hold_timeout", self.cfg.retry_after)
            wait = deadline - now
            if self.stream:
                wait = min(wait, max(0.0, self._next_keepalive - now))
            if await self.ep.wait_changed(wait):
                return
            if self.stream and loop.time() >= self._next_keepalive:
                await self._keepalive()
                self._next_keepalive += self.cfg.keepalive_interval
                return  # the endpoint may have changed while we wrote: the caller looks again

    def _end_hold(self) -> None:
        if self.holding:
            self.holding = False
            self.demand.add(held=-1)
            assert self.held_since is not None
            self.p.metrics.hold_seconds.labels(self.ep.key).observe(asyncio.get_running_loop().time() - self.held_since)

    async def _keepalive(self) -> None:
        """A held stream: send the headers now and an SSE comment, so proxies and clients keep waiting."""
        if self.resp is None:
            await self._prepare(web.StreamResponse(status=200, headers=SSE_HEADERS))
        await self._write(KEEPALIVE)

    # -- one backend ---------------------------------------------------------------------------------------------
    async def _forward(self, b: Backend) -> web.StreamResponse | Failure:
        self.demand.add(inflight=1)  # before the hold ends: demand never dips to zero on the way
        b.inflight += 1
        self._end_hold()
        if b.role == STANDBY:
            self.p.metrics.standby.labels(self.ep.key).inc()
        try:
            return await self._exchange(b)
        finally:
            b.inflight -= 1
            self.demand.add(inflight=-1)

    async def _exchange(self, b: Backend) -> web.StreamResponse | Failure:
        assert self.p.session is not None
        url = b.url + str(self.request.rel_url)
        headers = {k: v for k, v in self.request.headers.items() if k.lower() not in DROP_UPSTREAM}
        try:
            async with self.p.session.post(url, data=self.raw, headers=headers) as up:
                if up.status >= 500:
                    body = await up.read()
                    b.poke.set()  # e.g. a dead engine answers 500: let the health check see it
                    return Failure(f"backend {b.url} answered {up.status}", up.status, body, up.headers)
                if up.status != 200 or not up.headers.get("Content-Type", "").startswith(SSE_TYPE):
                    return await self._reply(up.status, await up.read(), up.headers, b)
                async for chunk in up.content.iter_any():  # as the backend sends them: no buffering
                    if self.resp is None:
                        await self._prepare(web.StreamResponse(status=200, headers=self._headers(up.headers, b)))
                    await self._write(chunk)
                    self.committed = True
                if self.resp is None:
                    await self._prepare(web.StreamResponse(status=200, headers=self._headers(up.headers, b)))
                await self.resp.write_eof()  # type: ignore[union-attr]
                self.outcome = "ok"
                return self.resp  # type: ignore[return-value]
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.p.registry.mark_failed(self.ep, b)
            reason = f"backend {b.url} failed: {type(e).__name__}: {e}"
            if not self.committed:
                return Failure(reason)
            # Part of the answer is out: end the stream with an error event the OpenAI SDKs raise.
            log.warning("endpoint %s: %s, mid-stream", self.ep.key, reason)
            self.outcome = "backend_failed"
            await self._write(sse_event(error_body(502, f"the backend serving this stream failed mid-response "
                                                   f"({type(e).__name__}); the output is incomplete",
                                                   "backend_failed")))
            await self.resp.write_eof()  # type: ignore[union-attr]
            return self.resp  # type: ignore[return-value]

    # -- writing to the client ---------------------------------------------------------------------------------
    def _headers(self, upstream: CIMultiDictProxy[str] | None, b: Backend | None = None) -> CIMultiDict[str]:
        out: CIMultiDict[str] = CIMultiDict()
        for k, v in (upstream or {}).items():
            if k.lower() not in DROP_DOWNSTREAM:
                out.add(k, v)
        if out.get("Content-Type", "").startswith(SSE_TYPE):
            out.update({k: v for k, v in SSE_HEADERS.items() if k != "Content-Type"})
        if self.cfg.debug_headers and b is not None:
            out["X-Sluice-Backend"], out["X-Sluice-Role"] = b.url, b.role
        return out

    async def _prepare(self, resp: web.StreamResponse) -> None:
        self.resp = resp
        try:
            await resp.prepare(self.request)
        except (ConnectionResetError, ConnectionError) as e:
            raise ClientGone() from e

    async def _write(self, data: bytes) -> None:
        assert self.resp is not None
        try:
            await self.resp.write(data)
        except (ConnectionResetError, ConnectionError) as e:
            raise ClientGone() from e

    async def _reply(self, status: int, body: bytes, upstream: CIMultiDictProxy[str] | None,
                     b: Backend | None = None) -> web.StreamResponse:
        """A whole (non-streamed) backend answer."""
        self.outcome = "ok" if status < 400 else "client_error" if status < 500 else "backend_error"
        if self.resp is None:
            return web.Response(status=status, body=body, headers=self._headers(upstream, b))
        # A held stream already answered 200 with SSE headers: an error goes out as an error event.
        if status >= 400:
            try:
                payload = json.loads(body)
                assert isinstance(payload, dict) and "error" in payload
            except (ValueError, AssertionError):
                payload = error_body(status, body.decode(errors="replace")[:500] or f"backend answered {status}")
            body = sse_event(payload)
        await self._write(body)
        await self.resp.write_eof()
        return self.resp

    async def _error(self, status: int, payload: dict[str, Any], headers: dict[str, str] | None) -> web.StreamResponse:
        if self.resp is None:
            return web.json_response(payload, status=status, headers=headers)
        try:
            await self._write(sse_event(payload))
            await self.resp.write_eof()
        except ClientGone:
            self.outcome = "client_gone"
        return self.resp


def build_app(proxy: Proxy, ready: asyncio.Event) -> web.Application:
    app = web.Application(client_max_size=64 * 2**20)

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready_route(_: web.Request) -> web.Response:
        if not ready.is_set():  # discovery has not listed the backends yet
            return web.json_response({"status": "starting"}, status=503)
        return web.json_response({"status": "ready"})

    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready_route)
    app.router.add_get("/metrics", proxy.metrics_route)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/v1/models/{model:.+}", proxy.models)  # names may hold slashes
    app.router.add_post("/v1/{tail:.*}", proxy.completions)
    return app

