"""One trace from the client through `sluice gateway` to `sluice serve` (issue 42, acceptance 4): both export
to an OTLP collector on 127.0.0.1; a request carrying a W3C traceparent yields, under that trace id, the
gateway's `gateway_request` span (child of the client's span), its `attempt` span, and the engine's
`llm_request` span as the attempt's child, with queue/prefill/decode under it. A retry shows as a second
attempt; a request without a traceparent gets a fresh trace that still spans both processes."""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
from gateway_fakes import GatewayProcess
from otlp_collector import OTLPCollector
from servers import SERVED_NAME

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def collector():
    with OTLPCollector() as c:
        yield c


@pytest.fixture(scope="module")
def engine(start_server, collector):
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # the SDK's batch delay: spans within 0.1 s, not 5 s
    try:
        return start_server("--otlp-traces-endpoint", collector.endpoint)
    finally:
        del os.environ["OTEL_BSP_SCHEDULE_DELAY"]


@pytest.fixture
def gateway(engine, collector, tmp_path):
    """start(serving URLs) -> a traced `sluice gateway` in front of them (round-robin), stopped after the test."""
    started = []

    def start(serving: list[str]) -> GatewayProcess:
        backends = tmp_path / "backends.json"
        backends.write_text(json.dumps({"endpoints": [{"model": SERVED_NAME, "name": "default/smollm2",
                                                       "serving": serving}]}))
        gw = GatewayProcess(["--backends-file", str(backends), "--otlp-traces-endpoint", collector.endpoint,
                             "--routing", "round-robin"], tmp_path / "gw.log")
        started.append(gw)
        return gw

    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"
    try:
        yield start
    finally:
        del os.environ["OTEL_BSP_SCHEDULE_DELAY"]
        for gw in started:
            gw.stop()


class BrokenBackend(BaseHTTPRequestHandler):
    """Ready by its /ready, but hangs up on every request: the gateway's attempt fails and it retries."""

    def do_GET(self):  # noqa: N802 - http.server's name
        body = b'{"status": "ready"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # noqa: N802
        self.close_connection = True
        self.connection.shutdown(2)

    def log_message(self, *args):
        pass


@pytest.fixture
def broken_backend():
    server = ThreadingHTTPServer(("127.0.0.1", 0), BrokenBackend)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def by_name(spans, name):
    return [s for s in spans if s.name == name]


def test_gateway_and_engine_spans_share_the_clients_trace(engine, gateway, collector):
    traced = gateway([engine.url])
    trace_id, client_span = os.urandom(16).hex(), os.urandom(8).hex()
    client = openai.OpenAI(base_url=f"{traced.url}/v1", api_key="x", max_retries=0)
    resp = client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0,
        extra_headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
    assert resp.choices[0].message.content
    spans = collector.wait_for(lambda _: {"gateway_request", "llm_request", "attempt"}
                               <= {s.name for s in collector.trace(trace_id)})
    spans = collector.trace(trace_id)
    (gw,) = by_name(spans, "gateway_request")
    (attempt,) = by_name(spans, "attempt")
    (engine,) = by_name(spans, "llm_request")
    assert {gw.service, attempt.service, engine.service} == {"sluice-gateway", "sluice-engine"}
    assert gw.service == "sluice-gateway" and engine.service == "sluice-engine"
    assert gw.parent_span_id == client_span
    assert attempt.parent_span_id == gw.span_id
    assert engine.parent_span_id == attempt.span_id  # the traceparent the gateway sent, not the client's
    assert gw.start_ns <= attempt.start_ns <= engine.start_ns <= engine.end_ns <= attempt.end_ns <= gw.end_ns
    assert engine.attributes["gen_ai.usage.output_tokens"] == resp.usage.completion_tokens
    phases = {s.name: s for s in spans if s.parent_span_id == engine.span_id}
    assert {"queue", "prefill", "decode"} <= set(phases)


def test_a_retry_is_a_second_attempt_and_no_traceparent_still_gives_one_trace(engine, gateway, collector,
                                                                             broken_backend):
    traced = gateway([broken_backend, engine.url])
    collector.clear()
    client = openai.OpenAI(base_url=f"{traced.url}/v1", api_key="x", max_retries=0)
    # Round-robin over [broken, engine]: of two requests, one tries the broken backend first.
    for _ in range(2):
        client.completions.create(model=SERVED_NAME, prompt="One, two,", max_tokens=2, temperature=0)

    def two_traces(spans):
        gws = by_name(spans, "gateway_request")
        return len(gws) == 2 and len(by_name(spans, "llm_request")) == 2

    spans = collector.wait_for(two_traces)
    retried = [g for g in by_name(spans, "gateway_request")
               if len([a for a in by_name(spans, "attempt") if a.parent_span_id == g.span_id]) == 2]
    assert len(retried) == 1, "one request should have tried the dead backend first"
    g = retried[0]
    assert g.parent_span_id == ""  # no traceparent from the client: the gateway's span is the root
    attempts = sorted((a for a in by_name(spans, "attempt") if a.parent_span_id == g.span_id),
                      key=lambda a: a.start_ns)
    assert attempts[0].status_code == 2  # the backend hung up
    (engine,) = [s for s in by_name(spans, "llm_request") if s.trace_id == g.trace_id]
    assert engine.parent_span_id == attempts[1].span_id
    assert any(name == "retry" for name, _, _ in g.events)
