"""`sluice gateway --endpoint-picker`: the gateway's routing behind a Gateway API gateway a cluster already runs.

The Gateway API Inference Extension (GIE) has the data plane (Envoy Gateway, Istio, kgateway, GKE...) ask an
endpoint picker (EPP) which model-server pod takes each request, over Envoy's External Processing protocol
(ext_proc.proto): one bidirectional gRPC stream per HTTP request. This module is that picker, with the same
registry, router (prefix affinity under a load bound, LoRA affinity), names and demand board as the proxy:

    gateway ──request headers, body chunks──►  picker: parse, route, pick (router.py), hold at zero
            ◄─headers response: x-gateway-destination-endpoint = ip:port[,fallbacks]  (header and
              dynamic metadata envoy.lb), then the body back as streamed chunks (possibly rewritten)
    gateway ──response headers (+ envoy.lb x-gateway-destination-endpoint-served), body chunks──►  picker
            ◄─each chunk back as it came (full-duplex streaming: the picker sees the answer go by)

GIE's protocol (docs/proposals/004-endpoint-picker-protocol): the destination goes in both the header and
the `envoy.lb` dynamic metadata, with the same value; a subset hint (`envoy.lb.subset_hint` filter metadata)
limits the choice, and an empty or unmatched subset is a 503; no ready endpoint: 503; a request shed: 429.

Holding while an endpoint scales from zero works as in the proxy (the request counts as held for KEDA, and
goes on when a backend is ready) but only as long as the gateway waits for the picker's answer: its ext-proc
message timeout (Envoy's default is 200 ms; GIE's guides raise it). --picker-hold-timeout must stay under
it; past it the picker answers 503 with Retry-After itself rather than let the gateway fail the request.

Priority: a request's InferenceObjective (header x-gateway-inference-objective) has a priority (higher is
more important; negative is sheddable). It reaches the engine as the request's `priority` field in the
engine's convention (vLLM's: lower is sooner), so the engine's priority scheduling orders and preempts by it;
a client cannot set its own (the field is replaced). With --picker-max-inflight, requests beyond it wait in
a flow queue (FlowQueue: priority, then tenant by tenant), and a sheddable one is shed with 429 instead.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter, deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import grpc
from google.protobuf import struct_pb2

from . import ext_proc_pb2 as pb
from . import ext_proc_pb2_grpc as pb_grpc
from .auth import ApiKeys
from .config import GatewayConfig
from .demand import DemandBoard
from .kube import Informer, KubeAPI
from .metrics import REFUSALS, GatewayMetrics
from .prefix import routing_key
from .priorities import OBJECTIVE_HEADER, set_engine_priority
from .proxy import BodyBudget, error_body
from .registry import Backend, Endpoint, Registry, Route
from .router import Router
from .scaler_tls import ScalerTLS, add_port

log = logging.getLogger("sluice.gateway")

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
MAX_TENANT_CHARS = 256
# Streamed body chunks sent back: under the 64 KiB Envoy buffers per stream by default.
BODY_CHUNK = 62 * 1024
FALLBACKS = 2  # endpoints after the chosen one, for the gateway's retry policy
OVERWRITE = pb.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


OBJECTIVES_API = "/apis/inference.networking.x-k8s.io/v1alpha2"
POOL_GROUP = "inference.networking.k8s.io"


@dataclass(slots=True)
class Objectives:
    """InferenceObjective name -> priority (GIE: higher is more important; below zero: sheddable): the
    --objective flags, and with --kubernetes --pool the InferenceObjectives whose poolRef names the pool (they
    win over a flag of the same name; watched, so a change applies to the next request)."""

    priorities: dict[str, int]
    watched: dict[str, int] = field(default_factory=dict)

    @classmethod
    def parse(cls, pairs: Iterable[str]) -> Objectives:
        """--objective NAME=PRIORITY flags (GatewayConfig has checked their form)."""
        return cls({name: int(value) for name, _, value in (p.partition("=") for p in pairs)})

    def priority(self, name: str | None, endpoint: dict[str, int] | None = None) -> int:
        """The pool's InferenceObjective, else the endpoint's spec.routing.objectives, else the flag; an unknown
        or absent objective is priority 0, as GIE's default objective."""
        if not name:
            return 0
        for source in (self.watched, endpoint or {}, self.priorities):
            if name in source:
                return source[name]
        return 0


def pool_objectives(objects: Iterable[dict], pool: str) -> dict[str, int]:
    """name -> priority of the InferenceObjectives whose poolRef is the InferencePool `pool` (the endpoint's
    name: the operator names the pool after it). Pure."""
    out: dict[str, int] = {}
    for obj in objects:
        spec = obj.get("spec") or {}
        ref = spec.get("poolRef") or {}
        if ref.get("name") != pool or ref.get("group", POOL_GROUP) != POOL_GROUP:
            continue
        priority = spec.get("priority", 0)
        name = (obj.get("metadata") or {}).get("name")
        if isinstance(name, str) and isinstance(priority, int) and not isinstance(priority, bool):
            out[name] = priority
    return out


def hostport(url: str) -> str:
    """A backend's `ip:port`, as the EPP protocol names endpoints."""
    return urlsplit(url).netloc


def headers_of(hm: pb.HeaderMap) -> dict[str, str]:
    """Envoy sends values in raw_value (value stays empty); lower-case keys; the last of a repeated key."""
    return {h.key.lower(): (h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value) for h in hm.headers}


def subset_hint(md: pb.Metadata) -> frozenset[str] | None:
    """The endpoints the gateway allows (ip:port), or None when it sent no hint."""
    if SUBSET_NAMESPACE not in md.filter_metadata:
        return None
    value = md.filter_metadata[SUBSET_NAMESPACE].fields.get(SUBSET)
    if value is None:
        return None
    if value.HasField("list_value"):
        return frozenset(v.string_value for v in value.list_value.values if v.string_value)
    return frozenset(s.strip() for s in value.string_value.split(",") if s.strip())


def served_endpoint(md: pb.Metadata) -> str | None:
    if LB_NAMESPACE not in md.filter_metadata:
        return None
    value = md.filter_metadata[LB_NAMESPACE].fields.get(SERVED)
    return value.string_value or None if value is not None else None


def set_header(key: str, value: str) -> pb.HeaderValueOption:
    return pb.HeaderValueOption(header=pb.HeaderValue(key=key, raw_value=value.encode()), append_action=OVERWRITE)


def immediate(status: int, message: str, code: str, param: str | None = None,
              retry_after: int | None = None) -> pb.ProcessingResponse:
    """An answer the gateway sends the client itself: an OpenAI-style error body."""
    headers = [set_header("content-type", "application/json")]
    if retry_after is not None:
        headers.append(set_header("retry-after", str(retry_after)))
    body = json.dumps(error_body(status, message, code, param)).encode()
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=pb.HttpStatus(code=status), headers=pb.HeaderMutation(set_headers=headers), body=body,
        details=f"sluice_picker_{code}"))


def destination_responses(dest: str, body: bytes | None, in_body: bool) -> list[pb.ProcessingResponse]:
    """The pick: the destination header (and its metadata twin) and, streamed, the body to send upstream.
    `in_body`: the gateway buffers the body (BUFFERED mode) and already had its headers answered, so the
    header mutation rides on the body's answer."""
    meta = struct_pb2.Struct()
    meta.update({LB_NAMESPACE: {DESTINATION: dest}})
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=[set_header(DESTINATION, dest)]),
                               clear_route_cache=True)
    if in_body:
        if body is not None:
            common.status = pb.CommonResponse.CONTINUE_AND_REPLACE
            common.body_mutation.body = body
        return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=meta)]
    out = [pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=meta)]
    if body is not None:
        pieces = [body[i:i + BODY_CHUNK] for i in range(0, len(body), BODY_CHUNK)] or [b""]
        for i, piece in enumerate(pieces):
            out.append(pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                    body=piece, end_of_stream=i == len(pieces) - 1))))))
    return out


class FlowQueue:
    """Requests of one endpoint waiting for room (every backend at --picker-max-inflight). The next turn goes to
    the highest priority waiting; within it, tenant by tenant in turn (x-gateway-inference-fairness-id; no
    header: one shared tenant), so a tenant with many requests waiting does not starve one with few; within a
    tenant, first come first served. GIE's flow control has the same order: priority bands, fairness between
    flows in a band, FCFS in a flow."""

    def __init__(self) -> None:
        # priority -> tenant -> its waiting turns, tenants in the order they get turns
        self._bands: dict[int, dict[str, deque[asyncio.Future[None]]]] = {}
        self._where: dict[asyncio.Future[None], tuple[int, str]] = {}

    @property
    def waiting(self) -> int:
        return len(self._where)

    def enqueue(self, priority: int, tenant: str, front: bool = False) -> asyncio.Future[None]:
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._bands.setdefault(priority, {}).setdefault(tenant, deque())
        if front:
            queue.appendleft(turn)
        else:
            queue.append(turn)
        self._where[turn] = (priority, tenant)
        return turn

    def highest(self) -> float:
        """The highest priority waiting (-inf when none waits)."""
        return max(self._bands, default=float("-inf"))

    def head(self) -> asyncio.Future[None] | None:
        """The first turn in serving order (one given already, and not yet used, included)."""
        for priority in sorted(self._bands, reverse=True):
            for queue in self._bands[priority].values():
                return queue[0]
        return None

    def wake(self) -> None:
        """Give the next waiter not woken yet its turn. Its tenant goes to the back of the band only when the turn
        is used (remove(used=True)): a waiter woken for room another took keeps its place."""
        for priority in sorted(self._bands, reverse=True):
            for queue in self._bands[priority].values():
                turn = next((t for t in queue if not t.done()), None)
                if turn is not None:
                    turn.set_result(None)
                    return

    def remove(self, turn: asyncio.Future[None], used: bool = False) -> bool:
        """A waiter leaves the queue; True when it had been given a turn (the caller passes an unused one on).
        `used`: it got room: its tenant goes to the back of the band, so the band's others come first next."""
        where = self._where.pop(turn, None)
        if where is None:
            return False
        priority, tenant = where
        tenants = self._bands[priority]
        if used:
            tenants[tenant] = tenants.pop(tenant)
        tenants[tenant].remove(turn)
        if not tenants[tenant]:
            del tenants[tenant]
        if not tenants:
            del self._bands[priority]
        woken = turn.done() and not turn.cancelled()
        turn.cancel()
        return woken


class Refusal(Exception):
    def __init__(self, response: pb.ProcessingResponse, outcome: str):
        self.response, self.outcome = response, outcome


class PickerStream:
    """One HTTP request's ext-proc stream."""

    def __init__(self, picker: EndpointPicker):
        self.p = picker
        self.cfg = picker.cfg
        self.headers: dict[str, str] = {}
        self.subset: frozenset[str] | None = None
        self.body = bytearray()
        self.request_mode = pb.FULL_DUPLEX_STREAMED  # what GIE's gateways are configured with
        self.response_mode = pb.FULL_DUPLEX_STREAMED
        self.decided = False
        self.ep: Endpoint | None = None
        self.backend: Backend | None = None  # counted in flight on it
        self.adapter: str | None = None
        self.status: int | None = None
        self.outcome: str | None = None
        self.held_since: float | None = None
        self.priority = 0  # the objective's (GIE convention: higher is more important)
        self.tenant = ""  # x-gateway-inference-fairness-id: shares within a priority are per tenant
        self.taken = 0  # request-body bytes counted against the picker's buffer budget
        self.answered = False  # refused before the pick: the rest of the request is not read

    async def run(self, requests: AsyncIterator[pb.ProcessingRequest]) -> AsyncIterator[pb.ProcessingResponse]:
        try:
            async for req in requests:
                for resp in await self._one(req):
                    yield resp
        finally:  # the stream ended, was cancelled, or failed: nothing may stay counted
            self._drop_body()
            self._end_hold()
            self._release()
            if self.ep is not None:
                self.p.metrics.finished(self.ep.key, self.outcome or "client_gone")

    def _drop_body(self) -> None:
        self.p.budget.give(self.taken)
        self.taken = 0
        self.body = bytearray()

    def _refuse_body(self, response: pb.ProcessingResponse, outcome: str) -> list[pb.ProcessingResponse]:
        """An answer before the pick: the body read so far is dropped, and what the gateway still sends of the
        request is ignored (it should stop, having the answer)."""
        self.outcome, self.answered = outcome, True
        self._drop_body()
        self._count_refusal()
        return [response]

    def _count_refusal(self) -> None:
        if self.ep is None and self.outcome in REFUSALS:  # before an endpoint was known, as the proxy counts
            self.p.metrics.refused.labels(self.outcome).inc()

    async def _one(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if self.answered:
            return []
        if req.HasField("protocol_config"):
            self.request_mode = req.protocol_config.request_body_mode
            self.response_mode = req.protocol_config.response_body_mode
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            self.headers = headers_of(req.request_headers.headers)
            self.tenant = self.headers.get(FAIRNESS_HEADER, "")[:MAX_TENANT_CHARS]
            self.subset = subset_hint(req.metadata_context)
            if req.request_headers.end_of_stream:
                return await self._decide(None, in_body=False)
            if self.request_mode not in (pb.FULL_DUPLEX_STREAMED, pb.BUFFERED):
                # STREAMED/NONE: the body goes upstream as it comes, so the pick is made now, on headers alone.
                return await self._decide(None, in_body=False)
            if self.request_mode == pb.BUFFERED:
                return [pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=pb.CommonResponse()))]
            return []
        if kind == "request_body":
            if self.decided:  # the pick was made on headers: the body passes
                return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse()))]
            chunk = req.request_body.body
            if len(self.body) + len(chunk) > self.cfg.max_body_bytes:
                return self._refuse_body(immediate(413, f"request body is larger than {self.cfg.max_body_bytes} "
                                                   "bytes (--max-body-bytes)", "request_too_large"), "too_large")
            if not self.p.budget.take(len(chunk)):
                return self._refuse_body(immediate(
                    503, "the picker holds as many request bodies as it may (--max-buffered-bytes)",
                    "gateway_overloaded", retry_after=self.cfg.retry_after), "overloaded")
            self.body += chunk
            self.taken += len(chunk)
            if not req.request_body.end_of_stream:
                return []
            try:
                return await self._decide(bytes(self.body), in_body=self.request_mode == pb.BUFFERED)
            finally:
                self._drop_body()
        if kind == "response_headers":
            return self._response_headers(req)
        if kind == "response_body":
            eos = req.response_body.end_of_stream
            if eos:
                self._finish()
            if self.response_mode == pb.FULL_DUPLEX_STREAMED:
                return [pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
                    body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                        body=req.response_body.body, end_of_stream=eos)))))]
            return [pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse()))]
        if kind == "request_trailers":
            return [pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind == "response_trailers":
            self._finish()
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    # -- the pick -------------------------------------------------------------------------------------------
    async def _decide(self, body: bytes | None, in_body: bool) -> list[pb.ProcessingResponse]:
        self.decided = True
        try:
            route, forwarded, key = self._route(body)
            dest = await self._pick(route, key)
        except Refusal as r:
            self.outcome = r.outcome
            self._count_refusal()
            self._end_hold()  # answered: no longer waiting, though the gateway may keep the stream open a while
            return [r.response]
        return destination_responses(dest, forwarded, in_body)

    def _route(self, body: bytes | None) -> tuple[Route | None, bytes | None, str | None]:
        """The route the request's model names, the body to send on (None: unchanged), its routing key."""
        pool = self.p.pool
        if not body:
            return None, None, None  # e.g. GET /v1/models: any ready backend of the pool answers it
        try:
            parsed = json.loads(body)
        except (ValueError, RecursionError) as e:
            raise Refusal(immediate(400, f"request body is not valid JSON: {e}", "invalid_json"),
                          "invalid_request") from None
        if not isinstance(parsed, dict):
            raise Refusal(immediate(400, "request body must be a JSON object", "invalid_value"), "invalid_request")
        model = parsed.get("model")
        if not isinstance(model, str) or not model:
            raise Refusal(immediate(400, "missing required field 'model'", "invalid_value", "model"),
                          "invalid_request")
        route = self.p.registry.route(model)
        if route is None or (pool is not None and route.endpoint.key != pool):
            raise Refusal(immediate(404, f"model '{model[:200]}' is not served by this pool", "model_not_found",
                                    "model"), "model_not_found")
        denied = self.p.keys.check(route.endpoint.key, model, self.headers.get("authorization"))
        if denied:
            raise Refusal(immediate(401, denied, "invalid_api_key"), "unauthorized")
        self.adapter = route.adapter
        key = routing_key(parsed, self.cfg.prefix_chars, route.adapter) if self.cfg.routing == "prefix" else None
        changed = False
        if model != route.model:  # a namespaced name: the engine answers to its served name
            parsed["model"] = route.model
            changed = True
        # The objective decides the priority, never the client: a tenant may not jump the queue.
        self.priority = self.p.objectives.priority(self.headers.get(OBJECTIVE_HEADER), route.endpoint.priorities)
        changed = set_engine_priority(parsed, self.priority) or changed
        forwarded = json.dumps(parsed, ensure_ascii=False, separators=(",", ":")).encode() if changed else body
        return route, forwarded, key

    def _candidates(self, ep: Endpoint) -> list[Backend]:
        candidates, _ = ep.candidates()
        if self.subset is not None:
            candidates = [b for b in candidates if hostport(b.url) in self.subset]
        return candidates

    async def _pick(self, route: Route | None, key: str | None) -> str:
        ep = route.endpoint if route is not None else self._pool_endpoint()
        self.ep = ep
        self.demand = self.p.demand[ep.key]
        loop = asyncio.get_running_loop()
        while True:
            if ep.removed:
                raise Refusal(immediate(404, f"model '{ep.model}' is no longer served", "model_not_found"),
                              "unavailable")
            if self.subset is not None and not self.subset:
                raise Refusal(immediate(503, "the gateway's endpoint subset is empty", "no_endpoint"), "unavailable")
            candidates = self._candidates(ep)
            if candidates:
                break
            if self.subset is not None and ep.candidates()[0]:
                raise Refusal(immediate(503, "no ready endpoint of this pool is in the gateway's subset "
                                        f"({', '.join(sorted(self.subset))[:400]})", "no_endpoint"), "unavailable")
            if self.p.registry.closing:
                raise Refusal(immediate(503, "the picker is shutting down; retry", "shutting_down", retry_after=1),
                              "unavailable")
            left = self._hold_left(loop)
            if left <= 0:
                raise Refusal(immediate(503, f"no backend of model '{ep.model}' became ready within "
                                        f"{self.cfg.picker_hold_timeout:g}s (it may still be scaling up from "
                                        "zero); retry later", "hold_timeout", retry_after=self.cfg.retry_after),
                              "hold_timeout")
            await ep.wait_changed(left)
        if self.cfg.picker_max_inflight:
            candidates = await self._wait_for_room(ep, loop)
        prefer = ep.adapter_use.warm(self.adapter) if self.adapter else ()
        chosen = self.p.router.pick(candidates, key, prefer)
        assert isinstance(chosen, Backend)
        self._end_hold()
        self._take(chosen)
        rest = sorted((b for b in candidates if b is not chosen), key=lambda b: (b.inflight, b.url))[:FALLBACKS]
        return ",".join(hostport(b.url) for b in [chosen, *rest])

    async def _wait_for_room(self, ep: Endpoint, loop: asyncio.AbstractEventLoop) -> list[Backend]:
        """The candidates with room under --picker-max-inflight, once this request's turn has come: it waits
        in the endpoint's flow queue (by priority, then tenant by tenant) while every backend is full, or
        while others wait before it. A sheddable request is shed instead of queued."""
        cap, flow = self.cfg.picker_max_inflight, self.p.flow(ep.key)
        turn: asyncio.Future[None] | None = None
        try:
            while True:
                candidates = self._candidates(ep)
                room = [b for b in candidates if self._has_room(b, cap)]
                # Nobody of this priority or above waits: it need not queue (it may still preempt, above).
                first = turn is None and flow.highest() < self.priority
                if room and (first or (turn is not None and (turn.done() or flow.head() is turn))):
                    if turn is not None:
                        flow.remove(turn, used=True)
                        turn = None
                    return room
                if self.priority < 0:
                    raise Refusal(immediate(429, f"every backend of model '{ep.model}' has {cap} requests in "
                                            "flight (--picker-max-inflight) and this request's objective is "
                                            "sheddable (priority below 0); retry later", "too_many_requests",
                                            retry_after=self.cfg.retry_after), "rejected")
                if self.p.registry.closing or ep.removed:
                    raise Refusal(immediate(503, "the picker is shutting down; retry", "shutting_down",
                                            retry_after=1), "unavailable")
                left = self._hold_left(loop)  # queued: held for KEDA too (queue depth is what it scales on)
                if left <= 0:
                    raise Refusal(immediate(503, f"every backend of model '{ep.model}' stayed full for "
                                            f"{self.cfg.picker_hold_timeout:g}s (--picker-hold-timeout); retry "
                                            "later", "queue_timeout", retry_after=self.cfg.retry_after),
                                  "hold_timeout")
                if turn is None or turn.done():  # first time, or woken without room (a proxy request took it)
                    again = turn is not None
                    if turn is not None:
                        flow.remove(turn)
                    turn = flow.enqueue(self.priority, self.tenant, front=again)
                changed = asyncio.ensure_future(ep.wait_changed(left))
                try:
                    await asyncio.wait([turn, changed], timeout=left, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    changed.cancel()
        finally:
            if turn is not None and flow.remove(turn):
                flow.wake()  # refused or gone with a turn it was given: the turn goes on to the next

    def _pool_endpoint(self) -> Endpoint:
        """A request without a model (GET /v1/models): the pool's endpoint, if the picker serves one."""
        eps = [e for e in self.p.registry.endpoints.values() if self.p.pool in (None, e.key)]
        if len(eps) != 1:
            raise Refusal(immediate(400, "the request names no model, and this picker serves "
                                    f"{len(eps)} endpoints (--pool names one)", "invalid_value", "model"),
                          "invalid_request")
        return eps[0]

    # -- counting -------------------------------------------------------------------------------------------
    def _hold_left(self, loop: asyncio.AbstractEventLoop) -> float:
        """Counted as held from its first wait (KEDA hears of it now: StreamIsActive); the seconds of
        --picker-hold-timeout left, from then."""
        if self.held_since is None:
            self.held_since = loop.time()
            self.demand.add(held=1)
        return self.held_since + self.cfg.picker_hold_timeout - loop.time()

    def _end_hold(self) -> None:
        if self.held_since is not None and self.ep is not None:
            self.demand.add(held=-1)
            waited = asyncio.get_running_loop().time() - self.held_since
            self.p.metrics.hold_seconds.labels(self.ep.key).observe(waited)
            self.held_since = None

    def _take(self, b: Backend) -> None:
        b.inflight += 1
        self.backend = b
        self.p.priorities_on(b)[self.priority] += 1
        self.demand.add(inflight=1)

    def _release(self) -> None:
        if self.backend is not None:
            self.backend.inflight -= 1
            self.p.forget_priority(self.backend, self.priority)
            self.backend = None
            self.demand.add(inflight=-1)
            if self.ep is not None:
                self.p.flow(self.ep.key).wake()  # room on a backend: the next in the flow queue may take it

    def _has_room(self, b: Backend, cap: int) -> bool:
        """Under the cap; or, up to twice the cap, while the backend runs a request of a lower priority than this
        one: the engine's priority scheduling preempts that one for it, so waiting here for a slot to free
        would only add a whole low-priority answer to this request's time to first token."""
        if b.inflight < cap:
            return True
        return b.inflight < 2 * cap and self.p.runs_lower_priority(b, self.priority)

    def _response_headers(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        served = served_endpoint(req.metadata_context)
        if served and self.ep is not None and self.backend is not None and hostport(self.backend.url) != served:
            # The gateway went down the fallback list: the load is on the one that served.
            other = next((b for b in self.ep.backends.values() if hostport(b.url) == served), None)
            if other is not None:
                self.backend.inflight -= 1
                self.p.forget_priority(self.backend, self.priority)
                other.inflight += 1
                self.p.priorities_on(other)[self.priority] += 1
                self.backend = other
        try:
            self.status = int(headers_of(req.response_headers.headers).get(":status", "0"))
        except ValueError:
            self.status = 0
        if self.backend is not None and self.status and self.status >= 500:
            self.backend.poke.set()  # let the health check look at it now
        if self.adapter and self.ep is not None and self.backend is not None and 200 <= (self.status or 0) < 300:
            self.ep.adapter_use.served(self.adapter, self.backend.url)
        if req.response_headers.end_of_stream:
            self._finish()
        return [pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=pb.CommonResponse()))]

    def _finish(self) -> None:
        if self.outcome is None:
            self.outcome = "ok" if self.status is not None and self.status < 400 else "backend_error"
        self._release()


class ObjectiveWatch:
    """The InferenceObjectives of the picker's namespace, kept current (kube.Informer); where the CRD is not
    installed or RBAC forbids it, the informer retries with back-off and the flags alone apply."""

    def __init__(self, api: KubeAPI, pool: str, objectives: Objectives):
        namespace, _, self.name = pool.partition("/")
        self.objectives = objectives
        self.informer = Informer(api, f"{OBJECTIVES_API}/namespaces/{namespace}/inferenceobjectives", None,
                                 self._changed)
        self._task: asyncio.Task | None = None

    def _changed(self) -> None:
        self.objectives.watched = pool_objectives(self.informer.objects.values(), self.name)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.informer.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


class EndpointPicker(pb_grpc.ExternalProcessorServicer):
    def __init__(self, cfg: GatewayConfig, registry: Registry, demand: DemandBoard, metrics: GatewayMetrics,
                 keys: ApiKeys, router: Router, budget: BodyBudget, ready: asyncio.Event):
        self.cfg, self.registry, self.demand, self.metrics = cfg, registry, demand, metrics
        self.keys, self.router, self.budget, self.ready = keys, router, budget, ready
        self.pool = cfg.pool
        self.objectives = Objectives.parse(cfg.objectives)
        self.streams = 0
        self._flows: dict[str, FlowQueue] = {}
        # backend -> the priorities of the requests this picker has in flight on it, counted (an entry goes when
        # its last request does: no backend outlives its requests here)
        self._priorities: dict[Backend, Counter[int]] = {}

    def priorities_on(self, b: Backend) -> Counter[int]:
        counts = self._priorities.get(b)
        if counts is None:
            counts = self._priorities[b] = Counter()
        return counts

    def runs_lower_priority(self, b: Backend, priority: int) -> bool:
        return any(p < priority for p in self._priorities.get(b, ()))

    def forget_priority(self, b: Backend, priority: int) -> None:
        counts = self._priorities.get(b)
        if counts is None:
            return
        counts[priority] -= 1
        if counts[priority] <= 0:
            del counts[priority]
        if not counts:
            del self._priorities[b]

    def flow(self, key: str) -> FlowQueue:
        flow = self._flows.get(key)
        if flow is None:
            flow = self._flows[key] = FlowQueue()
        return flow

    async def Process(self, request_iterator, context):  # noqa: N802 (the gRPC method's name)
        if not self.ready.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the picker has not listed its endpoints yet")
        if self.streams >= self.cfg.picker_max_streams:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.streams} requests in the picker (--picker-max-streams)")
        self.streams += 1
        try:
            async for resp in PickerStream(self).run(request_iterator):
                yield resp
        finally:
            self.streams -= 1


async def start_picker(picker: EndpointPicker, host: str, port: int,
                       tls: ScalerTLS | None = None) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(maximum_concurrent_rpcs=picker.cfg.picker_max_streams + 16)
    pb_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    bound = add_port(server, host, port, tls, "the endpoint picker")
    await server.start()
    return server, bound
