"""A tiny OTLP/HTTP trace collector on 127.0.0.1 for tests: it takes POST /v1/traces (protobuf
ExportTraceServiceRequest, what the SDK's OTLP/HTTP exporter sends, gzip or not), keeps every span as a plain
`CollectedSpan`, and answers 200 with an empty ExportTraceServiceResponse.

    with OTLPCollector() as collector:
        start a server with --otlp-traces-endpoint collector.endpoint (http://127.0.0.1:PORT/v1/traces)
        spans = collector.wait_for(lambda spans: any(s.name == "llm_request" for s in spans))
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class CollectedSpan:
    service: str  # the resource's service.name
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root span
    kind: int  # the proto's SpanKind (2: server, 3: client, 1: internal)
    start_ns: int
    end_ns: int
    attributes: dict = field(default_factory=dict)
    events: list[tuple[str, int, dict]] = field(default_factory=list)  # (name, time ns, attributes)
    status_code: int = 0  # 0 unset, 1 ok, 2 error
    resource: dict = field(default_factory=dict)


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attrs(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


def parse_export(body: bytes) -> list[CollectedSpan]:
    """The spans of one ExportTraceServiceRequest."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        resource = _attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(CollectedSpan(
                    service=resource.get("service.name", ""), name=s.name, trace_id=s.trace_id.hex(),
                    span_id=s.span_id.hex(), parent_span_id=s.parent_span_id.hex(), kind=s.kind,
                    start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano, attributes=_attrs(s.attributes),
                    events=[(e.name, e.time_unix_nano, _attrs(e.attributes)) for e in s.events],
                    status_code=s.status.code, resource=resource))
    return out


class OTLPCollector:
    def __init__(self) -> None:
        self.spans: list[CollectedSpan] = []
        self.requests = 0
        self._cond = threading.Condition()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                spans = parse_export(body)
                with collector._cond:
                    collector.spans.extend(spans)
                    collector.requests += 1
                    collector._cond.notify_all()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):  # quiet
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-collector", daemon=True)

    def start(self) -> OTLPCollector:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> OTLPCollector:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_for(self, done: Callable[[list[CollectedSpan]], bool], timeout: float = 20) -> list[CollectedSpan]:
        """The spans collected so far once done(spans) holds; AssertionError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not done(self.spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"collector: condition not met in {timeout}s; spans: "
                                         f"{[(s.service, s.name, s.trace_id) for s in self.spans]}")
                self._cond.wait(left)
            return list(self.spans)

    def trace(self, trace_id: str) -> list[CollectedSpan]:
        with self._cond:
            return [s for s in self.spans if s.trace_id == trace_id]

    def clear(self) -> None:
        with self._cond:
            self.spans.clear()
