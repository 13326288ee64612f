"""Gateway configuration: one slotted dataclass that checks its own invariants (flags in cli.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

ROUTING_MODES = ("prefix", "least-loaded", "round-robin")
MiB = 2**20


@dataclass(slots=True)
class GatewayConfig:
    host: str = "0.0.0.0"
    port: int = 8080  # OpenAI-compatible proxy, /metrics, /health
    scaler_port: int = 9090  # KEDA external scaler (gRPC); 0 picks a free port
    # Backends: static (flags, a YAML file re-read on change) or Kubernetes EndpointSlices.
    backends: list[str] = field(default_factory=list)  # MODEL=URL, serving
    standby: list[str] = field(default_factory=list)  # MODEL=URL, warm pool
    adapters: list[str] = field(default_factory=list)  # MODEL=NAME: a LoRA adapter MODEL's backends serve
    backends_file: str | None = None
    kubernetes: bool = False
    namespaces: list[str] = field(default_factory=list)  # empty: every namespace
    kube_api: str | None = None  # API server URL; None: in-cluster (service account)
    # Routing.
    routing: str = "prefix"
    load_factor: float = 1.25  # CHWBL: no backend takes more than ceil(c * average load)
    load_floor: int = 0  # ... unless it has fewer than this in flight (idle batch slots: no need to spill)
    prefix_chars: int = 256  # the routing key: this many leading characters of the prompt
    max_attempts: int = 3  # backends tried per request (retries happen only before any byte reached the client)
    # Holding while an endpoint has no ready backend (scale from zero).
    max_held: int = 256  # per endpoint; over it: 429
    max_held_total: int = 1024  # all endpoints together; over it: 429
    max_held_bytes: int = 64 * MiB  # request bodies held per endpoint; over it: 429
    max_held_bytes_total: int = 128 * MiB  # request bodies held, all endpoints together; over it: 429
    hold_timeout: float = 300.0  # seconds; past it: 503 with Retry-After
    keepalive_interval: float = 5.0  # a held stream gets its headers and an SSE comment this often
    retry_after: int = 10  # Retry-After (seconds) on 429 and hold-timeout 503
    # Backend health: GET <backend>/ready.
    health_interval: float = 2.0  # for ready backends
    health_interval_cold: float = 0.25  # for backends not ready yet: a cold start ends within this
    connect_timeout: float = 5.0
    # Seconds without a byte from a backend (its headers, or the next chunk of a stream) before it counts as
    # hung. A non-streamed answer comes whole at the end, so this also bounds a non-streamed generation.
    read_timeout: float = 300.0
    # On SIGTERM: streams in flight may finish for this long (the chart sets it from the pod's grace period).
    shutdown_timeout: float = 45.0
    # Memory: request bodies are read whole (the model is in them) and kept until answered (for retries).
    max_body_bytes: int = 8 * MiB  # larger bodies: 413 (the engine's own limit)
    max_buffered_bytes: int = 256 * MiB  # bodies in memory at once (being read, held, in flight); over: 503
    # KEDA: target per serving replica of a trigger whose metadata has no targetValue (the operator's have one).
    scaler_target: float = 16.0
    api_keys_file: str | None = None
    # KEDA external scaler: a shared token callers must present (a file, re-read on change); streams bounded.
    scaler_token_file: str | None = None
    # KEDA external scaler over TLS: the server's certificate and key, and the CA whose client certificates
    # it requires (KEDA's, from the TriggerAuthentication the operator renders). PEM files, re-read on change.
    scaler_tls_cert: str | None = None
    scaler_tls_key: str | None = None
    scaler_tls_client_ca: str | None = None
    scaler_max_streams: int = 256  # StreamIsActive subscriptions at once (KEDA opens one per trigger)
    # Endpoint picker (picker.py): Envoy ext-proc gRPC for a Gateway API Inference Extension InferencePool.
    endpoint_picker: bool = False
    picker_port: int = 9002  # GIE's EPP port by convention; 0 picks a free port
    pool: str | None = None  # the one endpoint key (<namespace>/<name>) the picker picks for; None: any
    objectives: list[str] = field(default_factory=list)  # NAME=PRIORITY: InferenceObjective priorities
    picker_hold_timeout: float = 25.0  # seconds a pick may wait for a ready backend (keep under the gateway's)
    picker_max_inflight: int = 0  # per backend: a sheddable request finding all at it gets 429; 0: never shed
    picker_max_streams: int = 4096  # ext-proc streams (requests) at once; more: RESOURCE_EXHAUSTED
    picker_tls_cert: str | None = None
    picker_tls_key: str | None = None
    picker_tls_client_ca: str | None = None
    # OpenTelemetry traces (tracing.py): off without an endpoint.
    otlp_traces_endpoint: str | None = None
    trace_sample_ratio: float = 1.0
    debug_headers: bool = False  # X-Sluice-Backend / X-Sluice-Role on responses (exposes pod addresses)
    # Other gateway replicas (peers.py): each serves its own demand on --peer-port and sums the others'.
    peer_port: int = 9091  # 0 picks a free port
    peers: list[str] = field(default_factory=list)  # static peer URLs (http://host:peer-port)
    peer_service: str | None = None  # with --kubernetes: the headless Service whose EndpointSlices list peers
    peer_namespace: str | None = None  # its namespace; None: the pod's own
    peer_interval: float = 1.0  # seconds: counts are at most this old (edges arrive at once)
    peer_timeout: float = 10.0  # seconds a silent peer's last counts still count
    peer_token_file: str | None = None  # a shared token every replica presents and requires on the peer port

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_MODES:
            raise ValueError(f"--routing must be one of {', '.join(ROUTING_MODES)}, got {self.routing}")
        if self.load_factor < 1:
            raise ValueError(f"--load-factor must be >= 1, got {self.load_factor}")
        if self.load_floor < 0:
            raise ValueError(f"--load-floor must be >= 0, got {self.load_floor}")
        if self.prefix_chars < 1:
            raise ValueError(f"--prefix-chars must be >= 1, got {self.prefix_chars}")
        if self.max_attempts < 1:
            raise ValueError(f"--max-attempts must be >= 1, got {self.max_attempts}")
        if self.max_held < 0:
            raise ValueError(f"--max-held must be >= 0, got {self.max_held}")
        for name in ("max_held_total", "max_held_bytes", "max_held_bytes_total"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes must be >= 1, got {self.max_body_bytes}")
        if self.max_buffered_bytes < self.max_body_bytes:
            raise ValueError(f"--max-buffered-bytes ({self.max_buffered_bytes}) must be >= --max-body-bytes "
                             f"({self.max_body_bytes})")
        if self.read_timeout <= 0:
            raise ValueError(f"--read-timeout must be > 0, got {self.read_timeout}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}")
        if self.scaler_max_streams < 1:
            raise ValueError(f"--scaler-max-streams must be >= 1, got {self.scaler_max_streams}")
        if self.hold_timeout < 0:
            raise ValueError(f"--hold-timeout must be >= 0, got {self.hold_timeout}")
        if self.keepalive_interval <= 0:
            raise ValueError(f"--keepalive-interval must be > 0, got {self.keepalive_interval}")
        if self.health_interval <= 0 or self.health_interval_cold <= 0:
            raise ValueError("--health-interval must be > 0")
        if self.scaler_target <= 0:
            raise ValueError(f"--scaler-target must be > 0, got {self.scaler_target}")
        if bool(self.scaler_tls_cert) != bool(self.scaler_tls_key):
            raise ValueError("--scaler-tls-cert and --scaler-tls-key go together")
        if self.scaler_tls_client_ca and not self.scaler_tls_cert:
            raise ValueError("--scaler-tls-client-ca needs --scaler-tls-cert and --scaler-tls-key: client "
                             "certificates are checked in a TLS handshake")
        if not 0 <= self.peer_port <= 65535:
            raise ValueError(f"--peer-port must be a port number (0: any free one), got {self.peer_port}")
        for url in self.peers:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--peer takes a peer's http(s) URL (its --peer-port), got {url!r}")
        if self.peer_service and not self.kubernetes:
            raise ValueError("--peer-service finds peers through Kubernetes: add --kubernetes (or list --peer URLs)")
        if self.peer_interval <= 0:
            raise ValueError(f"--peer-interval must be > 0, got {self.peer_interval}")
        if self.peer_timeout < self.peer_interval:
            raise ValueError(f"--peer-timeout ({self.peer_timeout}) must be >= --peer-interval ({self.peer_interval})")
        if not 0 <= self.picker_port <= 65535:
            raise ValueError(f"--picker-port must be a port number (0: any free one), got {self.picker_port}")
        if self.picker_hold_timeout < 0:
            raise ValueError(f"--picker-hold-timeout must be >= 0, got {self.picker_hold_timeout}")
        if self.picker_max_inflight < 0:
            raise ValueError(f"--picker-max-inflight must be >= 0, got {self.picker_max_inflight}")
        if self.picker_max_streams < 1:
            raise ValueError(f"--picker-max-streams must be >= 1, got {self.picker_max_streams}")
        if bool(self.picker_tls_cert) != bool(self.picker_tls_key):
            raise ValueError("--picker-tls-cert and --picker-tls-key go together")
        if self.picker_tls_client_ca and not self.picker_tls_cert:
            raise ValueError("--picker-tls-client-ca needs --picker-tls-cert and --picker-tls-key")
        if self.pool is not None and not self.pool:
            raise ValueError("--pool takes an endpoint key (<namespace>/<name>, or a local model name)")
        for text in self.objectives:
            name, sep, value = text.partition("=")
            if not sep or not name or not value.lstrip("-").isdigit():
                raise ValueError(f"--objective takes NAME=PRIORITY with an integer priority, got {text!r}")
        if not 0.0 <= self.trace_sample_ratio <= 1.0:
            raise ValueError(f"--trace-sample-ratio must be within [0, 1], got {self.trace_sample_ratio}")
        if self.otlp_traces_endpoint is not None and not self.otlp_traces_endpoint.startswith(("http://", "https://")):
            raise ValueError(f"--otlp-traces-endpoint takes an http(s) URL, got {self.otlp_traces_endpoint!r}")
        if self.kubernetes and (self.backends or self.standby or self.adapters or self.backends_file):
            raise ValueError("--kubernetes discovers backends itself (and adapters from spec.adapters); drop "
                             "--backend/--standby/--adapter/--backends-file")
