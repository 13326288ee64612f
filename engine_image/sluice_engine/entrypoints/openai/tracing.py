"""OpenTelemetry traces of the engine's requests (--otlp-traces-endpoint; docs/metrics.md "Tracing").

One `llm_request` span (kind SERVER) per HTTP completion request, a child of the W3C `traceparent` the request
came with (the gateway's, or the client's), with one child span per engine request (choice) for each stage:

    llm_request ─┬─ queue     arrival in the engine → first scheduled       (the engine core's times)
                 ├─ prefill   first scheduled → first token
                 └─ decode    first token → last token (as the API process received it)

and the time the API process spent detokenizing as an event (`detokenize`) with its seconds. The times are the
ones the engine already keeps for its metrics (Request.arrival_time, first_scheduled_time, first_token_time),
sent to the API process on a request's first delta only while tracing is on (RequestOutput.timing): nothing is
added to the step loop, and the spans are built after the request finishes, with explicit start and end times.

Sampling is parent-based: a sampled traceparent is always followed, an unsampled one never; a request without
one is sampled at --trace-sample-ratio. Spans are batched and exported over OTLP/HTTP (protobuf) from a
background thread.

Off (the default), build_app holds no tracer and nothing here imports the SDK: a request costs one `if`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import urlsplit

from ...engine.output import RequestOutput

SERVICE_NAME = "sluice-engine"
SPAN_NAME = "llm_request"


def otlp_traces_url(endpoint: str) -> str:
    """The collector's traces URL: an endpoint given without a path (http://collector:4318) gets OTLP/HTTP's
    /v1/traces, as the SDK's OTEL_EXPORTER_OTLP_ENDPOINT does; a path given is used as it is."""
    return endpoint.rstrip("/") + "/v1/traces" if urlsplit(endpoint).path in ("", "/") else endpoint


class EngineTracer:
    """The engine's tracer: its own TracerProvider (never the process-global one: tests run several apps in a
    process), a parent-based ratio sampler, and a batch processor exporting to the collector."""

    def __init__(self, endpoint: str | None, sample_ratio: float, model: str, exporter: Any = None):
        """exporter: a span exporter to use instead of OTLP/HTTP to `endpoint` (tests: the SDK's in-memory one,
        exported at once)."""
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import SpanKind, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create({"service.name": SERVICE_NAME, "gen_ai.request.model": model})
        self.provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(sample_ratio)))
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=otlp_traces_url(endpoint or ""))
            self.provider.add_span_processor(BatchSpanProcessor(exporter))
        else:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("sluice_engine")
        self.model = model
        self._propagator = TraceContextTextMapPropagator()
        self._server, self._internal = SpanKind.SERVER, SpanKind.INTERNAL
        self._in_context = set_span_in_context

    @classmethod
    def from_config(cls, cfg, model: str) -> EngineTracer | None:
        """The tracer of --otlp-traces-endpoint, or None (off: nothing of the SDK is imported)."""
        if getattr(cfg, "otlp_traces_endpoint", None) is None:
            return None
        return cls(cfg.otlp_traces_endpoint, cfg.trace_sample_ratio, model)

    def start(self, headers: Mapping[str, str], operation: str, body: Any) -> RequestTrace | None:
        """The span of a request that has just arrived (headers: its HTTP headers, whose traceparent and
        tracestate are the parent), or None when it is not sampled. operation: "chat" or "text_completion"
        (gen_ai.operation.name); body: the request, for its model and sampling attributes."""
        parent = self._propagator.extract(headers)
        attrs = {"gen_ai.operation.name": operation, "gen_ai.system": "sluice",
                 "gen_ai.request.model": body.model or self.model}
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
        for key, v in (("gen_ai.request.max_tokens", max_tokens), ("gen_ai.request.temperature", body.temperature),
                       ("gen_ai.request.top_p", body.top_p), ("gen_ai.request.seed", body.seed)):
            if v is not None:
                attrs[key] = v
        if body.n != 1:
            attrs["gen_ai.request.choice.count"] = body.n
        span = self.tracer.start_span(SPAN_NAME, context=parent, kind=self._server, attributes=attrs)
        if not span.is_recording():
            return None
        return RequestTrace(self, span)

    def shutdown(self) -> None:
        """Export what is batched and stop the exporter (the server's shutdown)."""
        self.provider.shutdown()


class RequestTrace:
    """One request's `llm_request` span while it runs. Who calls what: the route starts it (EngineTracer.start),
    serving wraps each choice's delta stream (`wrap`) and names the request (`set_request_id`), the route ends
    it when the response is complete or has failed (`end`)."""

    def __init__(self, tracer: EngineTracer, span):
        self._tracer = tracer
        self.span = span
        # monotonic -> epoch ns, fixed once per request (the engine's times are time.monotonic()).
        self._offset_ns = time.time_ns() - time.monotonic_ns()
        self._prompt_tokens = self._output_tokens = self._cached_tokens = 0
        self._finish_reasons: list[str] = []
        self._ended = False

    def _ns(self, monotonic: float) -> int:
        return int(monotonic * 1e9) + self._offset_ns

    def set_request_id(self, request_id: str) -> None:
        self.span.set_attribute("gen_ai.response.id", request_id)

    async def wrap(self, index: int, n: int, gen: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """Choice `index` (of n per prompt)'s delta stream, passed through; its stages are recorded when its last
        delta arrives."""
        timing = None
        async for out in gen:
            if out.timing is not None:
                timing = out.timing
            if out.finished:
                self._choice_done(index, n, timing, time.monotonic(), out)
            yield out

    def _choice_done(self, index: int, n: int, timing, finished: float, out: RequestOutput) -> None:
        if index % n == 0:  # the prompt counted once per distinct prompt, as the response's usage counts it
            self._prompt_tokens += out.num_prompt_tokens
            self._cached_tokens += out.num_cached_tokens
        self._output_tokens += out.num_output_tokens
        if out.finish_reason is not None:
            self._finish_reasons.append(out.finish_reason)
        if timing is None:  # no token was made (an error before the first), or the engine was not timing
            return
        arrived, scheduled, first = timing
        tr = self._tracer
        ctx = tr._in_context(self.span)
        attrs = {"sluice.choice.index": index} if n != 1 or index else {}
        for name, a, b in (("queue", arrived, scheduled), ("prefill", scheduled, first), ("decode", first, finished)):
            child = tr.tracer.start_span(name, context=ctx, kind=tr._internal, start_time=self._ns(a), attributes=attrs)
            child.end(end_time=self._ns(max(a, b)))
        # vLLM's span attributes for the same intervals (seconds), on the request's span (the first choice's).
        if index == 0:
            self.span.set_attributes({
                "gen_ai.latency.time_in_queue": scheduled - arrived,
                "gen_ai.latency.time_to_first_token": first - arrived,
                "gen_ai.latency.time_in_model_prefill": first - scheduled,
                "gen_ai.latency.time_in_model_decode": finished - first,
                "gen_ai.latency.e2e": finished - arrived,
            })
        if out.detokenize_seconds is not None:
            self.span.add_event("detokenize", {"sluice.detokenize.seconds": out.detokenize_seconds, **attrs},
                                timestamp=self._ns(finished))

    def end(self, error: BaseException | None = None) -> None:
        """The response is complete (error None) or failed: the span ends now with its usage and outcome."""
        if self._ended:
            return
        self._ended = True
        span = self.span
        span.set_attributes({"gen_ai.usage.input_tokens": self._prompt_tokens,
                             "gen_ai.usage.output_tokens": self._output_tokens,
                             "gen_ai.usage.cached_tokens": self._cached_tokens})
        if self._finish_reasons:
            span.set_attribute("gen_ai.response.finish_reasons", self._finish_reasons)
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            status = getattr(error, "status", None)
            if isinstance(status, int):
                span.set_attribute("http.response.status_code", status)
            span.set_attribute("error.type", type(error).__name__)
            span.set_status(Status(StatusCode.ERROR, str(error)[:200]))
        else:
            span.set_attribute("http.response.status_code", 200)
        span.end()
