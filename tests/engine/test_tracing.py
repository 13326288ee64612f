"""OpenTelemetry traces of the engine's requests (entrypoints/openai/tracing.py, --otlp-traces-endpoint): the
sampling rules and the span's shape on the SDK's in-memory exporter, then a real `sluice serve` exporting to an
OTLP/HTTP collector on 127.0.0.1 (tests/support/otlp_collector.py)."""

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from otlp_collector import OTLPCollector

from sluice_engine.engine.output import RequestOutput
from sluice_engine.entrypoints.openai.tracing import EngineTracer, otlp_traces_url

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def traceparent(trace_id: str = TRACE_ID, parent: str = PARENT_ID, sampled: bool = True) -> str:
    return f"00-{trace_id}-{parent}-{'01' if sampled else '00'}"


def body(**kw):
    fields = {"model": None, "max_tokens": 8, "temperature": 0.0, "top_p": None, "seed": None, "n": 1}
    return SimpleNamespace(**{**fields, **kw})


@pytest.fixture
def memory_tracer():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    def make(ratio: float = 1.0):
        exporter = InMemorySpanExporter()
        return EngineTracer(None, ratio, "smollm2", exporter=exporter), exporter
    return make


def test_otlp_traces_url():
    assert otlp_traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert otlp_traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert otlp_traces_url("http://c:4318/custom/traces") == "http://c:4318/custom/traces"


def test_off_by_default_imports_no_sdk():
    """Without --otlp-traces-endpoint the API server holds no tracer and never imports the SDK or an exporter
    (the API package itself is FastAPI's import, fastapi.telemetry: a no-op without a provider)."""
    assert EngineTracer.from_config(SimpleNamespace(otlp_traces_endpoint=None), "m") is None
    code = ("import sys; import sluice_engine.entrypoints.openai.server, sluice_engine.entrypoints.serve_cli; "
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_config_checks_the_flags():
    from sluice_engine.config import EngineConfig

    with pytest.raises(ValueError, match="--trace-sample-ratio"):
        EngineConfig(trace_sample_ratio=1.5)
    with pytest.raises(ValueError, match="--otlp-traces-endpoint"):
        EngineConfig(otlp_traces_endpoint="collector:4317")


@pytest.mark.parametrize(("headers", "ratio", "traced"), [
    ({"traceparent": traceparent(sampled=True)}, 0.0, True),  # a sampled parent is followed whatever the ratio
    ({"traceparent": traceparent(sampled=False)}, 1.0, False),  # an unsampled one never
    ({}, 1.0, True),
    ({}, 0.0, False),
])
def test_parent_based_sampling(memory_tracer, headers, ratio, traced):
    tracer, exporter = memory_tracer(ratio)
    trace = tracer.start(headers, "chat", body())
    assert (trace is not None) == traced
    if trace is not None:
        trace.end()
        (span,) = exporter.get_finished_spans()
        if headers:
            assert format(span.context.trace_id, "032x") == TRACE_ID
            assert format(span.parent.span_id, "016x") == PARENT_ID


@pytest.mark.asyncio
async def test_span_shape_from_the_engine_times(memory_tracer):
    tracer, exporter = memory_tracer()
    trace = tracer.start({"traceparent": traceparent()}, "text_completion", body(max_tokens=5))
    now = time.monotonic()
    times = (now - 0.30, now - 0.25, now - 0.10)  # arrival, first scheduled, first token

    async def deltas():
        yield RequestOutput("r-0", [1, 2], "", [], finished=False, num_prompt_tokens=7, num_output_tokens=2,
                            timing=times)
        yield RequestOutput("r-0", [3], "", [], finished=True, finish_reason="length", num_prompt_tokens=7,
                            num_output_tokens=3, detokenize_seconds=0.001)

    trace.set_request_id("cmpl-r")
    got = [o async for o in trace.wrap(0, 1, deltas())]
    assert len(got) == 2
    trace.end()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"llm_request", "queue", "prefill", "decode"}
    root = spans["llm_request"]
    assert root.resource.attributes["service.name"] == "sluice-engine"
    a = root.attributes
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (7, 3)
    assert a["gen_ai.request.max_tokens"] == 5 and a["gen_ai.response.id"] == "cmpl-r"
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert a["gen_ai.latency.time_in_queue"] == pytest.approx(0.05)
    for name in ("queue", "prefill", "decode"):
        assert spans[name].parent.span_id == root.context.span_id
    q, p, d = spans["queue"], spans["prefill"], spans["decode"]
    assert q.end_time == p.start_time and p.end_time == d.start_time
    assert (q.end_time - q.start_time) == pytest.approx(0.05e9, rel=1e-3)
    assert (p.end_time - p.start_time) == pytest.approx(0.15e9, rel=1e-3)
    assert [e.name for e in root.events] == ["detokenize"]


# -- a real server exporting to a collector ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def collector():
    with OTLPCollector() as c:
        yield c


@pytest.fixture(scope="module")
def traced_server(start_server, collector):
    # Batches leave every 100 ms instead of the SDK's 5 s (OTEL_BSP_SCHEDULE_DELAY is the SDK's own variable).
    old = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"
    try:
        return start_server("--otlp-traces-endpoint", collector.endpoint)
    finally:
        if old is None:
            del os.environ["OTEL_BSP_SCHEDULE_DELAY"]
        else:
            os.environ["OTEL_BSP_SCHEDULE_DELAY"] = old


def _client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _request_spans(collector, trace_id):
    def done(spans):
        ids = [s for s in spans if s.trace_id == trace_id]
        return any(s.name == "llm_request" for s in ids) and sum(s.name == "decode" for s in ids) >= 1
    collector.wait_for(done)
    return {s.name: s for s in collector.trace(trace_id)}


@pytest.mark.slow
def test_a_traced_request_exports_its_engine_span(traced_server, collector):
    trace_id = os.urandom(16).hex()
    resp = _client(traced_server).chat.completions.create(
        model=traced_server.model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12,
        temperature=0, extra_headers={"traceparent": traceparent(trace_id)})
    spans = _request_spans(collector, trace_id)
    root = spans["llm_request"]
    assert root.service == "sluice-engine" and root.kind == 2  # SERVER
    assert root.parent_span_id == PARENT_ID
    assert root.attributes["gen_ai.usage.input_tokens"] == resp.usage.prompt_tokens
    assert root.attributes["gen_ai.usage.output_tokens"] == resp.usage.completion_tokens
    assert root.attributes["gen_ai.response.id"] == resp.id
    assert root.attributes["gen_ai.request.max_tokens"] == 12
    q, p, d = spans["queue"], spans["prefill"], spans["decode"]
    for child in (q, p, d):
        assert child.parent_span_id == root.span_id
    # Ordered, contiguous, and within the request's span.
    assert root.start_ns <= q.start_ns <= q.end_ns == p.start_ns <= p.end_ns == d.start_ns <= d.end_ns <= root.end_ns
    assert p.end_ns > p.start_ns  # a prefill takes time
    (detok,) = [e for e in root.events if e[0] == "detokenize"]
    assert detok[2]["sluice.detokenize.seconds"] > 0


@pytest.mark.slow
def test_a_streamed_completion_and_sampling_by_the_parent(traced_server, collector):
    client = _client(traced_server)
    unsampled = os.urandom(16).hex()
    client.completions.create(model=traced_server.model, prompt="One, two,", max_tokens=4, temperature=0,
                              extra_headers={"traceparent": traceparent(unsampled, sampled=False)})
    trace_id = os.urandom(16).hex()
    stream = client.completions.create(model=traced_server.model, prompt="One, two,", max_tokens=6, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_headers={"traceparent": traceparent(trace_id)})
    usage = [c.usage for c in stream if c.usage is not None][-1]
    spans = _request_spans(collector, trace_id)
    root = spans["llm_request"]
    assert root.attributes["gen_ai.operation.name"] == "text_completion"
    assert root.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens == 6
    assert spans["decode"].end_ns <= root.end_ns
    assert collector.trace(unsampled) == []  # exported before the sampled one's spans, had it been sampled
