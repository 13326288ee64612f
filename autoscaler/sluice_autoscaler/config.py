"""Gateway configuration: one slotted dataclass that checks its own invariants (flags in cli.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

ROUTING_MODES = ("prefix", "least-loaded", "round-robin")


@dataclass(slots=True)
class GatewayConfig:
    host: str = "0.0.0.0"
    port: int = 8080  # OpenAI-compatible proxy, /metrics, /health
    scaler_port: int = 9090  # KEDA external scaler (gRPC); 0 picks a free port
    # Backends: static (flags, a YAML file re-read on change) or Kubernetes EndpointSlices.
    backends: list[str] = field(default_factory=list)  # MODEL=URL, serving
    standby: list[str] = field(default_factory=list)  # MODEL=URL, warm pool
    backends_file: str | None = None
    kubernetes: bool = False
    namespaces: list[str] = field(default_factory=list)  # empty: every namespace
    kube_api: str | None = None  # API server URL; None: in-cluster (service account)
    # Routing.
    routing: str = "prefix"
    load_factor: float = 1.25  # CHWBL: no backend takes more than ceil(c * average load)
    prefix_chars: int = 256  # the routing key: this many leading characters of the prompt
    max_attempts: int = 3  # backends tried per request (retries happen only before any byte reached the client)
    # Holding while an endpoint has no ready backend (scale from zero).
    max_held: int = 256  # per endpoint; over it: 429
    hold_timeout: float = 300.0  # seconds; past it: 503 with Retry-After
    keepalive_interval: float = 5.0  # a held stream gets its headers and an SSE comment this often
    retry_after: int = 10  # Retry-After (seconds) on 429 and hold-timeout 503
    # Backend health: GET <backend>/ready.
    health_interval: float = 2.0  # for ready backends
    health_interval_cold: float = 0.25  # for backends not ready yet: a cold start ends within this
    connect_timeout: float = 5.0
    # KEDA: target of the demand metric (held + in-flight requests) per serving replica.
    scaler_target: float = 16.0
    api_keys_file: str | None = None
    debug_headers: bool = False  # X-Sluice-Backend / X-Sluice-Role on responses (exposes pod addresses)

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_MODES:
            raise ValueError(f"--routing must be one of {', '.join(ROUTING_MODES)}, got {self.routing}")
        if self.load_factor < 1:
            raise ValueError(f"--load-factor must be >= 1, got {self.load_factor}")
        if self.prefix_chars < 1:
            raise ValueError(f"--prefix-chars must be >= 1, got {self.prefix_chars}")
        if self.max_attempts < 1:
            raise ValueError(f"--max-attempts must be >= 1, got {self.max_attempts}")
        if self.max_held < 0:
            raise ValueError(f"--max-held must be >= 0, got {self.max_held}")
        if self.hold_timeout < 0:
            raise ValueError(f"--hold-timeout must be >= 0, got {self.hold_timeout}")
        if self.keepalive_interval <= 0:
            raise ValueError(f"--keepalive-interval must be > 0, got {self.keepalive_interval}")
        if self.health_interval <= 0 or self.health_interval_cold <= 0:
            raise ValueError("--health-interval must be > 0")
        if self.scaler_target <= 0:
            raise ValueError(f"--scaler-target must be > 0, got {self.scaler_target}")
        if self.kubernetes and (self.backends or self.standby or self.backends_file):
            raise ValueError("--kubernetes discovers backends itself; drop --backend/--standby/--backends-file")
