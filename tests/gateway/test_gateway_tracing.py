"""The gateway's tracing API (autoscaler/sluice_autoscaler/tracing.py) on the SDK's in-memory exporter: the spans a
request makes (hold, attempts, retries), parent-based sampling, and the traceparent the engine gets."""

import subprocess
import sys

import pytest

from sluice_autoscaler.tracing import NO_SPAN, GatewayTracer, otlp_traces_url

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def traceparent(sampled: bool = True) -> str:
    return f"00-{TRACE_ID}-{PARENT_ID}-{'01' if sampled else '00'}"


def make(ratio: float = 1.0):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    return GatewayTracer(None, ratio, exporter=exporter), exporter


def test_off_imports_nothing_and_costs_nothing():
    assert GatewayTracer.from_flags(None, 1.0) is None
    assert NO_SPAN.headers_for_upstream() == {}
    NO_SPAN.hold_start(), NO_SPAN.hold_end(), NO_SPAN.attempt_start("http://b", 1), NO_SPAN.attempt_end(200)
    NO_SPAN.retry("x"), NO_SPAN.end(200, "ok")
    code = ("import sys, sluice_autoscaler.tracing, sluice_autoscaler.proxy; "
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_flags_checked():
    with pytest.raises(ValueError, match="--otlp-traces-endpoint"):
        GatewayTracer.from_flags("collector:4317", 1.0)
    with pytest.raises(ValueError, match="--trace-sample-ratio"):
        GatewayTracer.from_flags("http://c:4318", 2.0)
    assert otlp_traces_url("http://c:4318") == "http://c:4318/v1/traces"


def test_a_held_request_retried_on_a_second_backend():
    tracer, exporter = make()
    span = tracer.start_request({"traceparent": traceparent()}, "ns/ep", "ns/model")
    span.hold_start()
    span.hold_start()  # a second call while held changes nothing
    span.hold_end()
    span.attempt_start("http://10.0.0.1:8000", 1)
    first = span.headers_for_upstream()["traceparent"]
    span.attempt_end(503, "backend http://10.0.0.1:8000 answered 503")
    span.retry("backend http://10.0.0.1:8000 answered 503")
    span.attempt_start("http://10.0.0.2:8000", 2)
    second = span.headers_for_upstream()["traceparent"]
    span.attempt_end(200)
    span.end(200, "ok")
    spans = exporter.get_finished_spans()
    by_name: dict = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    (root,) = by_name["gateway_request"]
    assert root.resource.attributes["service.name"] == "sluice-gateway"
    assert format(root.context.trace_id, "032x") == TRACE_ID and format(root.parent.span_id, "016x") == PARENT_ID
    assert root.attributes["sluice.endpoint"] == "ns/ep" and root.attributes["sluice.outcome"] == "ok"
    assert root.attributes["http.response.status_code"] == 200
    assert [e.name for e in root.events] == ["pick", "retry", "pick"]
    (hold,) = by_name["hold"]
    assert hold.parent.span_id == root.context.span_id and hold.end_time >= hold.start_time
    a1, a2 = sorted(by_name["attempt"], key=lambda s: s.attributes["sluice.attempt"])
    assert a1.attributes["server.address"] == "10.0.0.1" and a1.attributes["http.response.status_code"] == 503
    assert not a1.status.is_ok and a2.status.is_unset
    # The engine's parent is the attempt that sent it the request, in the client's trace, sampled.
    for a, header in ((a1, first), (a2, second)):
        assert header == f"00-{TRACE_ID}-{format(a.context.span_id, '016x')}-01"
        assert a.parent.span_id == root.context.span_id


def test_end_closes_what_was_left_open_and_marks_errors():
    tracer, exporter = make()
    span = tracer.start_request({}, "ns/ep", "m")
    span.hold_start()
    span.end(503, "hold_timeout")
    span.end(503, "hold_timeout")  # once only
    names = sorted(s.name for s in exporter.get_finished_spans())
    assert names == ["gateway_request", "hold"]
    root = next(s for s in exporter.get_finished_spans() if s.name == "gateway_request")
    assert not root.status.is_ok and root.parent is None


@pytest.mark.parametrize(("headers", "ratio", "recording"), [
    ({"traceparent": traceparent(True)}, 0.0, True),
    ({"traceparent": traceparent(False)}, 1.0, False),
    ({}, 0.0, False),  # the gateway's no: the engine hears it (sampled bit 0) and does not sample either
])
def test_sampling_is_parent_based_and_passed_on(headers, ratio, recording):
    tracer, exporter = make(ratio)
    span = tracer.start_request(headers, "ns/ep", "m")
    assert span.recording == recording
    span.attempt_start("http://b:1", 1)
    up = span.headers_for_upstream()["traceparent"]
    assert bool(int(up.split("-")[3], 16) & 1) == recording  # the sampled bit (0x02: a random trace id)
    if headers:
        assert up.split("-")[1] == TRACE_ID
    span.attempt_end(200)
    span.end(200, "ok")
    assert bool(exporter.get_finished_spans()) == recording


def test_apply_upstream_replaces_the_clients_trace_headers():
    tracer, _ = make()
    span = tracer.start_request({"traceparent": traceparent()}, "ns/ep", "m")
    span.attempt_start("http://b:1", 1)
    headers = {"Traceparent": traceparent(), "TraceState": "a=b", "Content-Type": "application/json"}
    span.apply_upstream(headers)
    assert set(headers) == {"traceparent", "Content-Type"}
    assert headers["traceparent"] == span.headers_for_upstream()["traceparent"] != traceparent()
    untraced = {"Traceparent": traceparent()}
    NO_SPAN.apply_upstream(untraced)
    assert untraced == {"Traceparent": traceparent()}  # the client's own goes on
