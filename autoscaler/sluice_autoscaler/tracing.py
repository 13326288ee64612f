"""OpenTelemetry traces of the gateway's requests (--otlp-traces-endpoint, --trace-sample-ratio; docs/metrics.md
"Tracing"): a span per request, its hold and its backend attempts, under the client's W3C traceparent, and the
traceparent the engine gets, so the engine's `llm_request` span lands in the same trace under the attempt.

    gateway_request (SERVER)  ─┬─ hold      (INTERNAL)  held while no backend was ready
                               ├─ attempt   (CLIENT)    one per backend tried; event `retry` on the request
                               │    └─ llm_request      the engine's (engine_image/.../entrypoints/openai/tracing.py)
                               └─ attempt ...

Sampling is parent-based, as the engine's: a sampled traceparent is always followed, an unsampled one never; a
request without one is sampled at --trace-sample-ratio, and the engine then gets the gateway's decision in the
traceparent it is sent (flag 00: the engine does not sample it either).

Off (no endpoint), `GatewayTracer.from_flags` returns None and nothing of the SDK is imported; the proxy uses
`NO_SPAN`, whose methods do nothing, so a request costs one `if` and a few empty calls.

How the proxy calls it (every method is cheap and never raises for the proxy's state):

    Proxy.__init__:      self.tracer = GatewayTracer.from_flags(cfg.otlp_traces_endpoint, cfg.trace_sample_ratio)
    Proxy.stop:          if self.tracer is not None: self.tracer.shutdown()
    Proxy._route (once the endpoint is known, before Exchange):
                         span = self.tracer.start_request(request.headers, ep.key, model) \\
                                if self.tracer is not None else NO_SPAN
                         ... Exchange(..., span=span)
    Exchange._hold       (where held_since is first set):      self.span.hold_start()
    Exchange._end_hold   (inside `if self.holding:`):          self.span.hold_end()
    Exchange._run        (after pick, attempts += 1):          self.span.attempt_start(b.url, attempts)
                         (after `result = await self._forward(b)`):
                             if isinstance(result, Failure): self.span.attempt_end(result.status, result.reason)
                                                             self.span.retry(result.reason)   # if it goes on
                             else: self.span.attempt_end(result.status)
    Exchange._exchange   (after `headers = {...}`):            self.span.apply_upstream(headers)
    Exchange.run finally:                                       self.span.end(status_code, self.outcome or "client_gone")
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

SERVICE_NAME = "sluice-gateway"
SPAN_NAME = "gateway_request"
_EMPTY: dict[str, str] = {}
_TRACE_HEADERS = ("traceparent", "tracestate")


def otlp_traces_url(endpoint: str) -> str:
    """An endpoint given without a path (http://collector:4318) gets OTLP/HTTP's /v1/traces."""
    return endpoint.rstrip("/") + "/v1/traces" if urlsplit(endpoint).path in ("", "/") else endpoint


class _NoSpan:
    """The span of an untraced request: every method does nothing; the client's own traceparent (if any) goes on
    to the engine as it came (the proxy forwards the client's headers)."""

    __slots__ = ()
    recording = False

    def hold_start(self) -> None: ...
    def hold_end(self) -> None: ...
    def attempt_start(self, backend_url: str, n: int) -> None: ...
    def attempt_end(self, status: int | None = None, error: str | None = None) -> None: ...
    def retry(self, reason: str) -> None: ...
    def event(self, name: str, **attributes: Any) -> None: ...
    def end(self, status_code: int | None, outcome: str) -> None: ...

    def headers_for_upstream(self) -> dict[str, str]:
        return _EMPTY

    def apply_upstream(self, headers: dict[str, str]) -> None:
        """Put headers_for_upstream() into the headers of the request to the backend, replacing the client's
        traceparent/tracestate whatever their case (a no-op for an untraced request: the client's go on)."""
        up = self.headers_for_upstream()
        if up:
            for k in [k for k in headers if k.lower() in _TRACE_HEADERS]:
                del headers[k]
            headers.update(up)


NO_SPAN = _NoSpan()


class _Unsampled(_NoSpan):
    """A request the gateway decided not to sample: the engine is told so (traceparent flag 00) and follows."""

    __slots__ = ("_headers",)

    def __init__(self, headers: dict[str, str]):
        self._headers = headers

    def headers_for_upstream(self) -> dict[str, str]:
        return self._headers


class GatewayTracer:
    def __init__(self, endpoint: str | None, sample_ratio: float = 1.0, service_name: str = SERVICE_NAME,
                 exporter: Any = None):
        """exporter: a span exporter instead of OTLP/HTTP to `endpoint` (tests: the SDK's in-memory one, exported
        at once); otherwise spans are batched and sent from a background thread."""
        if not 0 <= sample_ratio <= 1:
            raise ValueError(f"--trace-sample-ratio must be in [0, 1], got {sample_ratio}")
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        # Its own provider, never the process-global one (tests run several gateways in one process).
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                                       sampler=ParentBased(TraceIdRatioBased(sample_ratio)))
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_traces_url(endpoint or ""))))
        else:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("sluice_autoscaler")
        self.propagator = TraceContextTextMapPropagator()
        self.kinds = SpanKind
        self.error_status = lambda msg: Status(StatusCode.ERROR, msg)
        self.in_context = set_span_in_context

    @classmethod
    def from_flags(cls, otlp_endpoint: str | None, sample_ratio: float = 1.0,
                   service_name: str = SERVICE_NAME) -> GatewayTracer | None:
        """The tracer of --otlp-traces-endpoint, or None when it is not set (nothing of the SDK imported)."""
        if not otlp_endpoint:
            return None
        if not otlp_endpoint.startswith(("http://", "https://")):
            raise ValueError("--otlp-traces-endpoint must be an http:// or https:// URL (OTLP over HTTP, e.g. "
                             f"http://collector:4318/v1/traces), got {otlp_endpoint!r}")
        return cls(otlp_endpoint, sample_ratio, service_name)

    def start_request(self, headers: Mapping[str, str], endpoint_key: str, model: str) -> RequestSpan | _NoSpan:
        """The span of a request that has just been routed (headers: the client's, whose traceparent/tracestate
        are the parent; endpoint_key: the endpoint's namespace/name; model: the name the client asked for).
        An unsampled request gets a span that does nothing but tell the engine it is unsampled."""
        parent = self.propagator.extract(headers)
        span = self.tracer.start_span(SPAN_NAME, context=parent, kind=self.kinds.SERVER,
                                      attributes={"sluice.endpoint": endpoint_key, "gen_ai.request.model": model})
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=self.in_context(span))
        if not span.is_recording():
            return _Unsampled(carrier)
        return RequestSpan(self, span)

    def shutdown(self) -> None:
        """Export what is batched and stop the exporter (the gateway's shutdown)."""
        self.provider.shutdown()


class RequestSpan:
    """A sampled request's span (see the module's docstring for who calls what)."""

    recording = True

    def __init__(self, tracer: GatewayTracer, span):
        self._t = tracer
        self.span = span
        self._ctx = tracer.in_context(span)
        self._hold_start: int | None = None
        self._attempt = None  # the attempt span in flight
        self._upstream: dict[str, str] = {}
        self._ended = False

    def event(self, name: str, **attributes: Any) -> None:
        self.span.add_event(name, attributes)

    def hold_start(self) -> None:
        """The request starts waiting for a ready backend (a no-op if it already is)."""
        if self._hold_start is None:
            self._hold_start = time.time_ns()

    def hold_end(self) -> None:
        """A backend took it, or the hold ended otherwise: the `hold` child span, from hold_start to now."""
        start, self._hold_start = self._hold_start, None
        if start is not None:
            hold = self._t.tracer.start_span("hold", context=self._ctx, kind=self._t.kinds.INTERNAL, start_time=start)
            end = time.time_ns()
            hold.set_attribute("sluice.hold.seconds", (end - start) / 1e9)
            hold.end(end_time=end)

    def attempt_start(self, backend_url: str, n: int) -> None:
        """Attempt n (1, 2, ...) on the backend the router picked: an `attempt` child span (CLIENT), current for
        headers_for_upstream until attempt_end."""
        self.attempt_end(error="superseded")  # a previous attempt the proxy did not end
        self.span.add_event("pick", {"sluice.backend": backend_url, "sluice.attempt": n})
        host = urlsplit(backend_url)
        attrs: dict[str, Any] = {"sluice.backend": backend_url, "sluice.attempt": n}
        if host.hostname:
            attrs["server.address"] = host.hostname
        if host.port:
            attrs["server.port"] = host.port
        self._attempt = self._t.tracer.start_span("attempt", context=self._ctx, kind=self._t.kinds.CLIENT,
                                                  attributes=attrs)
        self._upstream = {}
        self._t.propagator.inject(self._upstream, context=self._t.in_context(self._attempt))

    def headers_for_upstream(self) -> dict[str, str]:
        """traceparent (and tracestate) for the request to the backend: the current attempt's, else the request
        span's. They replace the client's own."""
        if not self._upstream:
            self._t.propagator.inject(self._upstream, context=self._ctx)
        return self._upstream

    apply_upstream = _NoSpan.apply_upstream

    def attempt_end(self, status: int | None = None, error: str | None = None) -> None:
        """The current attempt is over: the backend's status (if it answered) and why it failed (if it did)."""
        a, self._attempt = self._attempt, None
        if a is None:
            return
        if status is not None:
            a.set_attribute("http.response.status_code", status)
        if error is not None:
            a.set_attribute("error.type", error[:200])
            a.set_status(self._t.error_status(error[:200]))
        a.end()

    def retry(self, reason: str) -> None:
        """The attempt failed and the request goes on to another backend (or is given up)."""
        self.span.add_event("retry", {"sluice.retry.reason": reason[:200]})

    def end(self, status_code: int | None, outcome: str) -> None:
        """The request is over: its status to the client (None: it never got one) and the gateway's outcome
        (the label of sluice_gateway_requests_total). Ends a hold or attempt left open."""
        if self._ended:
            return
        self._ended = True
        self.hold_end()
        self.attempt_end(error=outcome if outcome != "ok" else None)
        span = self.span
        span.set_attribute("sluice.outcome", outcome)
        if status_code is not None:
            span.set_attribute("http.response.status_code", status_code)
        if (status_code is not None and status_code >= 500) or outcome in ("unavailable", "hold_timeout", "backend_failed",
                                                                             "backend_error", "client_gone"):
            span.set_status(self._t.error_status(outcome))
        span.end()
