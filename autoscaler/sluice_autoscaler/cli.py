"""`sluice gateway` flags. The `sluice` dispatcher imports this module to parse them, so only argparse here:
aiohttp and grpc load when the gateway runs. NOTE: the chart renders these flags; they are a contract like the
engine's."""

from __future__ import annotations

import argparse

from .config import ROUTING_MODES, GatewayConfig


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    d = GatewayConfig()
    p.add_argument("--host", default=d.host, help="address of both listeners")
    p.add_argument("--port", type=int, default=d.port, help="OpenAI-compatible proxy, /metrics, /health, /ready")
    p.add_argument("--scaler-port", type=int, default=d.scaler_port, help="KEDA external scaler (gRPC)")
    src = p.add_argument_group("backends")
    src.add_argument("--kubernetes", action="store_true",
                     help="discover backends from InferenceEndpoints and their Services' EndpointSlices")
    src.add_argument("-n", "--namespace", dest="namespaces", action="append", default=[], metavar="NAMESPACE",
                     help="with --kubernetes: watch this namespace (repeatable; default: all)")
    src.add_argument("--kube-api", default=None, help="with --kubernetes: API server URL (default: in-cluster)")
    src.add_argument("--backend", dest="backends", action="append", default=[], metavar="MODEL=URL",
                     help="a serving backend (repeatable)")
    src.add_argument("--standby", action="append", default=[], metavar="MODEL=URL",
                     help="a warm-pool backend: answers only while no serving backend is ready (repeatable)")
    src.add_argument("--adapter", dest="adapters", action="append", default=[], metavar="MODEL=NAME",
                     help="a LoRA adapter the backends of MODEL (a --backend/--standby model) serve: requests "
                          "naming it go to them (repeatable)")
    src.add_argument("--backends-file", default=None, help="YAML file of endpoints and backends, re-read on change")
    route = p.add_argument_group("routing")
    route.add_argument("--routing", default=d.routing, choices=ROUTING_MODES,
                       help="prefix: consistent hashing with bounded loads on the prompt prefix")
    route.add_argument("--load-factor", type=float, default=d.load_factor,
                       help="prefix routing: no backend takes more than this times the average load")
    route.add_argument("--load-floor", type=int, default=d.load_floor,
                       help="prefix routing: a backend with fewer requests in flight than this keeps its prefixes "
                            "whatever the average (set it to what an engine runs at once without queueing)")
    route.add_argument("--prefix-chars", type=int, default=d.prefix_chars,
                       help="prefix routing: leading characters of the prompt (chat: rendered messages) hashed")
    route.add_argument("--max-attempts", type=int, default=d.max_attempts,
                       help="backends tried per request; a retry happens only before any output was sent")
    hold = p.add_argument_group("holding (scale from zero)")
    hold.add_argument("--max-held", type=int, default=d.max_held,
                      help="requests held per endpoint while it has no ready backend; more get 429")
    hold.add_argument("--max-held-total", type=int, default=d.max_held_total,
                      help="requests held over all endpoints together; more get 429")
    hold.add_argument("--max-held-bytes", type=int, default=d.max_held_bytes,
                      help="bytes of request bodies held per endpoint; more get 429")
    hold.add_argument("--max-held-bytes-total", type=int, default=d.max_held_bytes_total,
                      help="bytes of request bodies held over all endpoints together; more get 429")
    hold.add_argument("--hold-timeout", type=float, default=d.hold_timeout,
                      help="seconds a request is held before 503 with Retry-After")
    hold.add_argument("--keepalive-interval", type=float, default=d.keepalive_interval,
                      help="a held streaming request gets an SSE comment this often (seconds)")
    hold.add_argument("--retry-after", type=int, default=d.retry_after, help="Retry-After on 429 and 503 (seconds)")
    p.add_argument("--health-interval", type=float, default=d.health_interval,
                   help="seconds between GET /ready polls of a ready backend (cold ones: every "
                        f"{d.health_interval_cold}s)")
    p.add_argument("--connect-timeout", type=float, default=d.connect_timeout)
    p.add_argument("--read-timeout", type=float, default=d.read_timeout,
                   help="seconds without a byte from a backend (headers, or a stream's next chunk) before it "
                        "counts as hung; bounds a non-streamed generation too")
    p.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="on SIGTERM, seconds open streams may run on (held requests get 503 at once); keep it "
                        "under the pod's terminationGracePeriodSeconds")
    mem = p.add_argument_group("memory")
    mem.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                     help="largest request body; larger ones get 413")
    mem.add_argument("--max-buffered-bytes", type=int, default=d.max_buffered_bytes,
                     help="request bodies in memory at once (being read, held, in flight); beyond: 503")
    p.add_argument("--scaler-target", type=float, default=d.scaler_target,
                   help="KEDA metric target per serving replica when a trigger's metadata has no targetValue "
                        "(the operator's triggers always carry the endpoint's targetQueueDepth)")
    p.add_argument("--api-keys-file", default=None,
                   help="YAML map of endpoint (or model, or \"*\") to API keys; once given, every endpoint needs a "
                        "key unless the file lists it under `open`; off by default")
    p.add_argument("--scaler-token-file", default=None,
                   help="file holding a token every KEDA external scaler call must present (trigger metadata "
                        "scalerToken, or gRPC metadata 'authorization: Bearer <token>'); off by default")
    p.add_argument("--scaler-tls-cert", default=None,
                   help="PEM certificate of the external scaler's gRPC port (with --scaler-tls-key: TLS; re-read "
                        "on change)")
    p.add_argument("--scaler-tls-key", default=None, help="PEM private key of --scaler-tls-cert")
    p.add_argument("--scaler-tls-client-ca", default=None,
                   help="PEM CA: every connection must present a client certificate it signed (KEDA's, from the "
                        "TriggerAuthentication the operator renders); off by default")
    p.add_argument("--scaler-max-streams", type=int, default=d.scaler_max_streams,
                   help="StreamIsActive subscriptions served at once; more are refused (RESOURCE_EXHAUSTED)")
    peers = p.add_argument_group("gateway replicas (KEDA sees their summed demand)")
    peers.add_argument("--peer-port", type=int, default=d.peer_port,
                       help="where this replica serves its own demand to the other replicas (0: a free port)")
    peers.add_argument("--peer", dest="peers", action="append", default=[], metavar="URL",
                       help="another replica's peer URL, http://HOST:PEER_PORT (repeatable; static peers)")
    peers.add_argument("--peer-service", default=None,
                       help="with --kubernetes: the headless Service whose EndpointSlices list the replicas")
    peers.add_argument("--peer-namespace", default=None,
                       help="the namespace of --peer-service (default: the pod's own)")
    peers.add_argument("--peer-interval", type=float, default=d.peer_interval,
                       help="seconds between peers' counts at most (a new hold arrives at once)")
    peers.add_argument("--peer-timeout", type=float, default=d.peer_timeout,
                       help="seconds a peer that stopped answering still counts with its last counts")
    peers.add_argument("--peer-token-file", default=None,
                       help="a file holding a shared token (a mounted Secret, re-read on change): every replica "
                            "presents it to the others and refuses peer calls without it")
    epp = p.add_argument_group("endpoint picker (Gateway API Inference Extension: Envoy ext-proc)")
    epp.add_argument("--endpoint-picker", action="store_true",
                     help="also serve Envoy's ext-proc on --picker-port: a GIE InferencePool's endpoint picker")
    epp.add_argument("--picker-port", type=int, default=d.picker_port, help="the picker's gRPC port (0: a free one)")
    epp.add_argument("--pool", default=None, metavar="NAMESPACE/NAME",
                     help="pick only for this endpoint (an InferencePool has one); others' models get 404")
    epp.add_argument("--objective", dest="objectives", action="append", default=[], metavar="NAME=PRIORITY",
                     help="an InferenceObjective's priority (header x-gateway-inference-objective; higher is more "
                          "important, below 0 sheddable; repeatable)")
    epp.add_argument("--picker-hold-timeout", type=float, default=d.picker_hold_timeout,
                     help="seconds a pick waits for a ready backend (scale from zero); keep it under the "
                          "gateway's ext-proc message timeout")
    epp.add_argument("--picker-max-inflight", type=int, default=d.picker_max_inflight,
                     help="requests in flight per backend beyond which sheddable requests get 429 (0: never)")
    epp.add_argument("--picker-max-streams", type=int, default=d.picker_max_streams,
                     help="ext-proc streams (requests) served at once")
    epp.add_argument("--picker-tls-cert", default=None, help="PEM certificate of the picker's port (TLS)")
    epp.add_argument("--picker-tls-key", default=None, help="PEM private key of --picker-tls-cert")
    epp.add_argument("--picker-tls-client-ca", default=None,
                     help="PEM CA: every connection must present a client certificate it signed")
    tr = p.add_argument_group("tracing (OpenTelemetry)")
    tr.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                    help="send a span per request (its hold and backend attempts) to this OTLP/HTTP collector, "
                         "e.g. http://collector:4318 (a URL without a path gets /v1/traces); the client's W3C "
                         "traceparent is its parent, and the engine gets the attempt's (default: off)")
    tr.add_argument("--trace-sample-ratio", type=float, default=d.trace_sample_ratio, metavar="RATIO",
                    help="share of requests without a traceparent that are traced; a traceparent's sampled flag "
                         "is always followed (default 1.0)")
    p.add_argument("--debug-headers", action="store_true",
                   help="add X-Sluice-Backend and X-Sluice-Role to responses (exposes backend addresses)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    fields = GatewayConfig.__dataclass_fields__
    return GatewayConfig(**{k: v for k, v in vars(args).items() if k in fields})


def run(args: argparse.Namespace) -> int:
    from .gateway import run as run_gateway

    return run_gateway(config_from_args(args))
