"""The OpenAI-compatible reverse proxy: one request's way through the gateway.

    API key precheck (before the body is read) -> body (bounded: --max-body-bytes, --max-buffered-bytes)
      -> model -> endpoint (and the LoRA adapter, when the model names one) -> API key check
      -> routing key (adapter + prompt prefix)
      -> candidates (ready serving; ready standby while serving is cold)
           none: hold (bounded by --max-held and --hold-timeout; demand signalled at once; a held stream gets
                 its headers and SSE keep-alive comments) until the endpoint changes, then look again
      -> router picks one (an adapter's: those that answered it lately first) -> forward
      -> SSE chunks go to the client as they arrive
      -> the backend fails before any of its bytes reached the client: try another backend, unless the
         failure is the request's own (a 4xx, or a 500 the engine attributed to it: code request_failed);
         an adapter's 404 model_not_found is the backend's (it has not loaded the adapter yet): tried elsewhere
         after: the stream ends with an OpenAI-shaped error event
      -> a backend silent for --read-timeout counts as hung (a failure like a reset connection)
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

from .auth import NO_TENANT, ApiKeys
from .config import GatewayConfig
from .demand import DemandBoard
from .metrics import GatewayMetrics
from .prefix import routing_key
from .priorities import OBJECTIVE_HEADER, set_engine_priority
from .quota import Refusal, RequestMeter, UsageBoard, prompt_estimate, reservation
from .registry import STANDBY, Backend, Endpoint, Registry
from .router import Router
from .tracing import NO_SPAN, GatewayTracer
from .usage_tap import UsageTap, wants_usage

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
               408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               503: "service_unavailable"}
READ_CHUNK = 64 * 1024
BODY_READ_TIMEOUT_S = 60.0  # a client must send its whole body within this (a slow sender holds memory)
ERROR_BODY_MAX = 1 << 20  # a backend's error answer is read whole up to this; beyond, it is replaced
# A backend's 5xx that another backend may well not repeat: it is retried elsewhere. Anything else, notably
# a 500 the engine attributed to the request (code "request_failed"), goes to the client as it is: retrying
# it would only spread a bad request over the replicas.
RETRY_STATUSES = {502, 503, 504}
RETRY_500_CODES = {"engine_dead"}


def error_code(body: bytes) -> str | None:
    """The `error.code` of an OpenAI-shaped error body, if it has one."""
    try:
        payload = json.loads(body)
        code = payload["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


def retryable(status: int, body: bytes) -> bool:
    return status in RETRY_STATUSES or (status == 500 and error_code(body) in RETRY_500_CODES)


class BodyBudget:
    """Bytes of request bodies in memory (being read, held, in flight): --max-buffered-bytes."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n
        assert self.used >= 0


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape, as the engine answers it too."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def json_error(status: int, message: str, code: str | None = None, param: str | None = None,
               headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(status, message, code, param), status=status, headers=headers)


async def read_capped(up: aiohttp.ClientResponse, cap: int = ERROR_BODY_MAX) -> bytes:
    """A backend's (error) answer, whole up to `cap` bytes; a longer one is replaced by a note."""
    out = bytearray()
    async for chunk in up.content.iter_any():
        out += chunk
        if len(out) > cap:
            return json.dumps(error_body(up.status, f"the backend answered {up.status} with a body over {cap} "
                                                    "bytes (not relayed)")).encode()
    return bytes(out)


def encode_body(body: dict[str, Any]) -> bytes:
    """A request body as JSON bytes again. UTF-8 as sent; a string with a lone surrogate (valid JSON as an
    escape, not encodable as UTF-8) makes the whole body ASCII with escapes instead."""
    try:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        return json.dumps(body, separators=(",", ":")).encode()


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
    status: int | None = None  # the backend's 5xx (or an adapter's 404), or None when it could not be reached
    body: bytes = b""
    headers: CIMultiDictProxy[str] | None = None


class Proxy:
    def __init__(self, cfg: GatewayConfig, registry: Registry, demand: DemandBoard, metrics: GatewayMetrics,
                 keys: ApiKeys, usage: UsageBoard | None = None):
        self.cfg, self.registry, self.demand, self.metrics, self.keys = cfg, registry, demand, metrics, keys
        self.usage = usage if usage is not None else UsageBoard()  # tenants' windows (quota.py)
        self.tracer = GatewayTracer.from_flags(cfg.otlp_traces_endpoint, cfg.trace_sample_ratio)  # None: off
        self.router = Router(cfg.routing, cfg.load_factor, cfg.load_floor)
        self.session: aiohttp.ClientSession | None = None
        self.started = int(time.time())
        self.budget = BodyBudget(cfg.max_buffered_bytes)

    async def start(self) -> None:
        # No total timeout: a generation may take minutes. Connecting must be quick, and a backend silent for
        # --read-timeout (no headers, or no next chunk) is hung.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout,
                                          sock_read=self.cfg.read_timeout))

    async def stop(self) -> None:
        if self.session:
            await self.session.close()
        if self.tracer is not None:  # the last batch of spans
            await asyncio.to_thread(self.tracer.shutdown)

    # -- routes ------------------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/* : every OpenAI call that names a model in its JSON body."""
        auth = request.headers.get("Authorization")
        denied = self.keys.precheck(auth)  # before the body is read: no memory for callers without a key
        if denied:
            return self._refuse("unauthorized", json_error(401, denied, "invalid_api_key",
                                                            headers={"WWW-Authenticate": "Bearer"}))
        limit = self.cfg.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            return self._refuse("too_large", self._too_large())
        raw = bytearray()
        try:
            try:
                async with asyncio.timeout(BODY_READ_TIMEOUT_S):
                    async for chunk in request.content.iter_chunked(READ_CHUNK):
                        if len(raw) + len(chunk) > limit:
                            return self._refuse("too_large", self._too_large())
                        if not self.budget.take(len(chunk)):
                            return self._refuse("overloaded", self._overloaded(), close=True)
                        raw += chunk
            except TimeoutError:
                return self._refuse("invalid_request", json_error(
                    408, f"the request body did not arrive within {BODY_READ_TIMEOUT_S:g}s", "body_timeout"),
                    close=True)
            return await self._route(request, raw, auth)
        finally:
            self.budget.give(len(raw))

    def _overloaded(self) -> web.Response:
        return json_error(503, "the gateway holds as many request bodies as it may "
                          f"(--max-buffered-bytes {self.cfg.max_buffered_bytes}); retry later",
                          "gateway_overloaded", headers={"Retry-After": str(self.cfg.retry_after)})

    def _too_large(self) -> web.Response:
        return json_error(413, f"request body is larger than {self.cfg.max_body_bytes} bytes (--max-body-bytes)",
                          "request_too_large")

    def _refuse(self, reason: str, resp: web.Response, close: bool = True) -> web.Response:
        """An answer before the request has an endpoint. `close`: the body may be partly unread."""
        self.metrics.refused.labels(reason).inc()
        if close:
            resp.force_close()
        return resp

    async def _route(self, request: web.Request, raw: bytearray, auth: str | None) -> web.StreamResponse:
        try:
            body = json.loads(raw)
        except ValueError as e:
            return self._refuse("invalid_request", json_error(400, f"request body is not valid JSON: {e}",
                                                              "invalid_json"), close=False)
        except RecursionError:
            return self._refuse("invalid_request", json_error(400, "request body is nested too deeply",
                                                              "invalid_json"), close=False)
        if not isinstance(body, dict):
            return self._refuse("invalid_request", json_error(400, "request body must be a JSON object",
                                                              "invalid_value"), close=False)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return self._refuse("invalid_request", json_error(400, "missing required field 'model'",
                                                              "invalid_value", "model"), close=False)
        route = self.registry.route(model, request.headers)  # headers: a split model's session key
        if route is None:
            # Only the models this caller may use: the list must not reveal key-protected endpoints.
            visible = [n for n, e in self.registry.names() if self.keys.check(e.key, n, auth) is None]
            served = ", ".join(visible) or "none"
            return self._refuse("model_not_found", json_error(
                404, f"model '{model[:200]}' does not exist; models available to you: {served}",
                "model_not_found", "model"), close=False)
        ep, adapter = route.endpoint, route.adapter
        # Keys by model name are keys for the name the client sent: a key for `<namespace>/<name>` opens
        # that namespace's endpoint only (and an adapter's name is a name of its own).
        denied = self.keys.check(ep.key, model, auth)
        if denied:
            self.metrics.finished(ep.key, "unauthorized")
            return json_error(401, denied, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        key = routing_key(body, self.cfg.prefix_chars, adapter) if self.cfg.routing == "prefix" else None
        stream = body.get("stream") is True
        meter = None
        if self.keys.tenants:  # tenants configured: every request is metered, a tenant's against its limits
            meter = self._meter(ep.key, model, body, len(raw), auth)
            if isinstance(meter, Refusal):
                self.metrics.tenant_limited.labels(meter.tenant, ep.key, meter.limit).inc()
                self.metrics.finished(ep.key, "rate_limited")
                return json_error(429, meter.message, "rate_limit_exceeded", headers={
                    "Retry-After": str(meter.retry_after), f"X-RateLimit-Limit-{meter.limit.title()}": str(meter.value),
                    f"X-RateLimit-Remaining-{meter.limit.title()}": str(max(0, meter.value - meter.used))})
            meter.strip = stream and wants_usage(body)
        span = self.tracer.start_request(request.headers, ep.key, model) if self.tracer is not None else NO_SPAN
        # An endpoint with objectives (spec.routing.objectives): the header's objective sets the priority.
        prioritised = bool(ep.priorities) and set_engine_priority(
            body, ep.priorities.get(request.headers.get(OBJECTIVE_HEADER, ""), 0))
        if model == route.model and not prioritised and not (meter and meter.strip):
            del body  # the parsed body is not kept while the request is held or in flight: the raw bytes are
            return await Exchange(self, request, ep, raw, stream, key, adapter, meter, span).run()
        # The engine answers to its served name and its adapters' names only: the name the client sent
        # (`<namespace>/<name>`) is replaced before the request goes on. The answer's `model` is then the
        # engine's name.
        body["model"] = route.model  # (the same, where only the priority changed)
        forwarded = encode_body(body)
        del body
        if not self.budget.take(len(forwarded)):
            return self._refuse("overloaded", self._overloaded(), close=False)
        try:
            return await Exchange(self, request, ep, forwarded, stream, key, adapter, meter, span).run()
        finally:
            self.budget.give(len(forwarded))

    def _meter(self, endpoint: str, model: str, body: dict[str, Any], size: int,
               auth: str | None) -> RequestMeter | Refusal:
        """A request's meter; a tenant's request reserves its worst case under its limits first (quota.py)."""
        tenant = self.keys.tenant(auth)
        meter = RequestMeter(self.usage, tenant.name if tenant else NO_TENANT, endpoint, prompt_estimate(size))
        if tenant is not None:
            ticket = self.usage.admit(tenant.name, tenant.scoped_limits(endpoint, model), reservation(body, size))
            if isinstance(ticket, Refusal):
                return ticket
            meter.ticket = ticket
        return meter

    async def models(self, request: web.Request) -> web.Response:
        auth = request.headers.get("Authorization")
        data = []
        want = request.match_info.get("model")
        for name, route in self.registry.routes():
            ep = route.endpoint
            if want is not None and want != name:
                continue
            if self.keys.check(ep.key, name, auth) is not None:
                continue  # a key-protected endpoint this caller cannot use
            # `parent`: as the engine lists its LoRA adapters (the base model's name; None for a model).
            data.append({"id": name, "object": "model", "created": self.started, "owned_by": "sluice",
                         "endpoint": ep.key, "served_name": route.model, "parent": route.parent,
                         "ready": bool(ep.candidates()[0])})
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

    def __init__(self, proxy: Proxy, request: web.Request, ep: Endpoint, raw: bytes | bytearray, stream: bool,
                 key: str | None, adapter: str | None = None, meter: RequestMeter | None = None, span=NO_SPAN):
        self.p, self.request, self.ep, self.raw, self.stream, self.key = proxy, request, ep, raw, stream, key
        self.adapter = adapter  # the LoRA adapter the request runs on (None: the base model)
        self.meter = meter  # tenants' usage and limits (None: not metered)
        self.tap: UsageTap | None = None  # the answer's usage, read as it passes
        self.span = span  # tracing.py: the request's span (NO_SPAN: not traced)
        self.cfg = proxy.cfg
        self.demand = proxy.demand[ep.key]
        self.resp: web.StreamResponse | None = None  # headers sent (a held stream's keep-alive, or a backend's)
        self.committed = False  # a backend's bytes reached the client: no retry from here on
        self.held_since: float | None = None
        self.holding = False
        self.outcome: str | None = None

    # -- the loop --------------------------------------------------------------------------------------------
    async def run(self) -> web.StreamResponse:
        resp: web.StreamResponse | None = None
        try:
            resp = await self._run()
            return resp
        except Reject as r:
            self.outcome = r.outcome
            resp = await self._error(r.status, error_body(r.status, r.message, r.code), r.headers)
            return resp
        except ClientGone:
            self.outcome = "client_gone"
            resp = self.resp or web.Response(status=499)
            return resp
        finally:  # also on cancellation (the client went away while held or waiting)
            self._end_hold()
            self.p.metrics.finished(self.ep.key, self.outcome or "client_gone")
            self.span.end(resp.status if resp is not None else (self.resp.status if self.resp else None),
                          self.outcome or "client_gone")
            if self.meter is not None:
                self._settle(self.meter)

    def _settle(self, meter: RequestMeter) -> None:
        tap = self.tap
        usage = tap.usage if tap else None
        prompt, completion = meter.finish(usage.prompt if usage else None, usage.completion if usage else None,
                                          tap.events if tap else 0)
        self.p.metrics.tenant_used(meter.tenant, self.ep.key, prompt, completion)

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
            # An adapter's request prefers the backends that answered it lately (they hold it loaded).
            prefer = self.ep.adapter_use.warm(self.adapter) if self.adapter else ()
            b = self.p.router.pick(fresh, self.key, prefer)
            assert isinstance(b, Backend)
            attempts += 1
            tried.add(b.url)
            self.span.attempt_start(b.url, attempts)
            if attempts > 1:
                self.p.metrics.retries.labels(self.ep.key).inc()
            result = await self._forward(b)
            if isinstance(result, Failure):
                self.span.attempt_end(result.status, result.reason)
                self.span.retry(result.reason)
                log.info("endpoint %s: %s; %s", self.ep.key, result.reason,
                         "retrying on another backend" if attempts < self.cfg.max_attempts else "giving up")
                last = result
                continue
            self.span.attempt_end(result.status)
            return result

    async def _give_up(self, last: Failure | None) -> web.StreamResponse:
        if last is not None and last.status is not None:  # the backend's own 5xx (an adapter's 404): pass it on
            return await self._reply(last.status, last.body, last.headers)
        reason = last.reason if last else "no backend left to try"
        raise Reject(502, f"no backend of model '{self.ep.model}' could take the request ({reason})",
                     "backend_unreachable", "unavailable")

    # -- holding -----------------------------------------------------------------------------------------------
    async def _hold(self) -> None:
        """Wait until the endpoint changes. Counts as held from the first call until a backend takes it."""
        loop = asyncio.get_running_loop()
        if self.held_since is None:
            full = self._hold_limit()
            if full:
                raise Reject(429, f"{full}; retry later", "too_many_waiting", "rejected", self.cfg.retry_after)
            self.held_since = self._next_keepalive = loop.time()
            self._next_keepalive += self.cfg.keepalive_interval
            self.holding = True
            self.span.hold_start()
            board, size = self.p.demand, len(self.raw)
            board.held_total += 1
            board.held_bytes_total += size
            self.demand.held_bytes += size
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

    def _hold_limit(self) -> str | None:
        """Why this request may not be held, if a hold limit is reached."""
        cfg, d, board, size = self.cfg, self.demand, self.p.demand, len(self.raw)
        model = self.ep.model
        if d.held >= cfg.max_held:
            return (f"{d.held} requests are already waiting for model '{model}' to get a ready backend "
                    f"(--max-held {cfg.max_held})")
        if board.held_total >= cfg.max_held_total:
            return f"{board.held_total} requests are already waiting for a ready backend (--max-held-total)"
        if d.held_bytes + size > cfg.max_held_bytes:
            return (f"the requests waiting for model '{model}' hold {d.held_bytes} bytes; this one would pass "
                    f"--max-held-bytes {cfg.max_held_bytes}")
        if board.held_bytes_total + size > cfg.max_held_bytes_total:
            return (f"the requests waiting hold {board.held_bytes_total} bytes; this one would pass "
                    f"--max-held-bytes-total {cfg.max_held_bytes_total}")
        return None

    def _end_hold(self) -> None:
        if self.holding:
            self.holding = False
            self.span.hold_end()
            board, size = self.p.demand, len(self.raw)
            board.held_total -= 1
            board.held_bytes_total -= size
            self.demand.held_bytes -= size
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
        self.span.apply_upstream(headers)
        try:
            async with self.p.session.post(url, data=self.raw, headers=headers) as up:
                if up.status >= 400:
                    body = await read_capped(up)
                    if up.status >= 500 and retryable(up.status, body):
                        b.poke.set()  # e.g. a dead engine answers 500 engine_dead: let the health check see it
                        return Failure(f"backend {b.url} answered {up.status}", up.status, body, up.headers)
                    if self.adapter and up.status == 404 and error_code(body) == "model_not_found":
                        # Adapters load while engines run (operator: adapters.json): this one has not loaded
                        # it yet, or has unloaded it. Another backend may have it; if none does, the 404 goes on.
                        self.ep.adapter_use.missing(self.adapter, b.url)
                        return Failure(f"backend {b.url} does not serve adapter '{self.adapter}'", up.status, body,
                                       up.headers)
                    # The request's own failure (a 4xx, a 500 the engine attributed to it): not retried.
                    return await self._reply(up.status, body, up.headers, b)
                if self.adapter:
                    self.ep.adapter_use.served(self.adapter, b.url)
                sse = up.headers.get("Content-Type", "").startswith(SSE_TYPE)
                tap = None
                if self.meter is not None:
                    tap = self.tap = UsageTap(self.meter.strip)
                    tap.start(up.headers.get("Content-Type", ""))
                async for chunk in up.content.iter_any():  # as the backend sends them: no buffering
                    if tap is not None:
                        chunk = tap.feed(chunk)  # an SSE event split across chunks waits for its end
                        if not chunk:
                            continue
                    if self.resp is None:
                        resp = web.StreamResponse(status=up.status, headers=self._headers(up.headers, b))
                        if not sse and up.content_length is not None:
                            resp.content_length = up.content_length
                        await self._prepare(resp)
                    await self._write(chunk)
                    self.committed = True
                rest = tap.flush() if tap is not None else b""
                if rest:
                    if self.resp is None:
                        await self._prepare(web.StreamResponse(status=up.status, headers=self._headers(up.headers, b)))
                    await self._write(rest)
                if self.resp is None:
                    await self._prepare(web.StreamResponse(status=up.status, headers=self._headers(up.headers, b)))
                await self.resp.write_eof()  # type: ignore[union-attr]
                self.outcome = "ok"
                return self.resp  # type: ignore[return-value]
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.p.registry.mark_failed(self.ep, b)
            if isinstance(e, asyncio.TimeoutError):
                what = f"sent nothing for {self.cfg.read_timeout:g}s (--read-timeout)"
            else:
                what = f"failed: {type(e).__name__}: {e}"
            reason = f"backend {b.url} {what}"
            if not self.committed:
                return Failure(reason)
            log.warning("endpoint %s: %s, mid-response", self.ep.key, reason)
            self.outcome = "backend_failed"
            if not self.resp.content_type.startswith(SSE_TYPE):  # type: ignore[union-attr]
                # A plain body cannot carry an error event: cut the connection, so the client sees it short.
                if self.request.transport is not None:
                    self.request.transport.close()
                return self.resp  # type: ignore[return-value]
            # Part of the stream is out: end it with an error event the OpenAI SDKs raise.
            cause = "went silent" if isinstance(e, asyncio.TimeoutError) else f"failed ({type(e).__name__})"
            await self._write(sse_event(error_body(502, f"the backend serving this stream {cause} mid-response; "
                                                   "the output is incomplete", "backend_failed")))
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
        if status < 400:
            self.outcome = "ok"
        elif status < 500:
            self.outcome = "client_error"
        else:  # a backend's 5xx left after retries, or one the engine attributed to the request (not retried)
            self.outcome = "backend_error" if retryable(status, body) else "request_failed"
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
    # Bodies are read by Proxy.completions with its own limits; this bounds any other route's.
    app = web.Application(client_max_size=proxy.cfg.max_body_bytes)

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

