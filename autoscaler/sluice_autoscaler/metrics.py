"""The gateway's Prometheus metrics. Names are a contract (rules, dashboards, the operator's Prometheus
trigger use them). Gauges are read from the registry and demand board at scrape time; counters and the
hold histogram are kept as requests finish.

    sluice_gateway_pending_requests{endpoint}         held: waiting for a ready backend
    sluice_gateway_inflight_requests{endpoint}        sent to a backend, not finished
    sluice_gateway_backends{endpoint,role,state}      backends by role (serving|standby), state (ready|cold)
    sluice_gateway_requests_total{endpoint,outcome}   finished requests (outcomes: see OUTCOMES)
    sluice_gateway_retries_total{endpoint}            requests re-sent to another backend
    sluice_gateway_standby_requests_total{endpoint}   requests the warm pool answered
    sluice_gateway_hold_seconds{endpoint}             time held before a backend took the request
    sluice_gateway_refused_requests_total{reason}     answered before an endpoint was known (see REFUSALS)
    sluice_gateway_peers                              other gateway replicas whose demand this one adds up
    sluice_gateway_model_name_conflicts{name,endpoint,holder}  1: `endpoint` claims `name`, `holder` has it
    sluice_gateway_version_requests_total{model,endpoint}  requests a split model (ServedModel) sent to a version
    sluice_gateway_version_weight{model,endpoint}          a version's weight in its split
    sluice_gateway_tenant_requests_total{tenant,endpoint}       requests a tenant sent (metered: tenants configured)
    sluice_gateway_tenant_tokens_total{tenant,endpoint,type}    tokens by type (prompt|completion), from the engines'
                                                                usage
    sluice_gateway_tenant_rate_limited_total{tenant,endpoint,limit}  429s by the limit hit (requests|tokens)

Tenant labels are the API keys file's tenant names (configured, bounded), or "none" for requests no tenant's key
carried.

The request gauges are this replica's own: Prometheus scrapes every replica and sums them itself.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from sluice_contract import (
    GATEWAY_BACKENDS_METRIC,
    GATEWAY_INFLIGHT_METRIC,
    GATEWAY_PENDING_METRIC,
    GATEWAY_SCALER_STREAMS_METRIC,
    GATEWAY_STANDBY_REQUESTS_METRIC,
    SERVING,
    STANDBY,
)

from .demand import DemandBoard
from .registry import Registry
from .versions import VersionCollector

OUTCOMES = (
    "ok",  # the backend answered 2xx (streams: to the end)
    "client_error",  # the backend answered 4xx (validation and the like)
    "backend_error",  # the backend answered 5xx and no other backend was left to try
    "request_failed",  # the backend answered a 5xx it attributed to the request (500 request_failed): not retried
    "backend_failed",  # the backend went away after the response began (streams end with an error event)
    "unavailable",  # no backend could be reached in --max-attempts tries (502)
    "rejected",  # 429: --max-held requests already waiting
    "rate_limited",  # 429: the tenant is over a requests or tokens per minute limit
    "hold_timeout",  # 503: no backend became ready within --hold-timeout
    "unauthorized",  # 401
    "client_gone",  # the client disconnected first
)
REFUSALS = (
    "unauthorized",  # 401 before the body was read: no key valid anywhere
    "too_large",  # 413: body over --max-body-bytes
    "overloaded",  # 503: --max-buffered-bytes of bodies already in memory
    "invalid_request",  # 400 (not JSON, no model) or 408 (body too slow)
    "model_not_found",  # 404
)
HOLD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)


class _Gauges:
    def __init__(self, registry: Registry, demand: DemandBoard):
        self.registry, self.demand = registry, demand

    def collect(self):
        pending = GaugeMetricFamily(GATEWAY_PENDING_METRIC,
                                    "Requests held because the endpoint has no ready backend.", labels=["endpoint"])
        inflight = GaugeMetricFamily(GATEWAY_INFLIGHT_METRIC,
                                     "Requests sent to a backend and not finished.", labels=["endpoint"])
        keys = set(self.registry.endpoints)
        for key, d in self.demand.items():
            keys.discard(key)
            pending.add_metric([key], d.held)
            inflight.add_metric([key], d.inflight)
        for key in sorted(keys):
            pending.add_metric([key], 0)
            inflight.add_metric([key], 0)
        # KEDA's operator holds one StreamIsActive stream per ScaledObject with the gateway's trigger, on one
        # gateway replica: none on any replica for an autoscaled endpoint means nothing will scale it from zero.
        streams = GaugeMetricFamily(GATEWAY_SCALER_STREAMS_METRIC, "KEDA's StreamIsActive streams open to this "
                                    "replica for the endpoint.", labels=["endpoint"])
        for key in sorted(set(self.registry.endpoints) | set(self.demand.subscribed_keys())):
            streams.add_metric([key], len(self.demand.subscribers(key)))
        backends = GaugeMetricFamily(GATEWAY_BACKENDS_METRIC, "Backends by role and readiness.",
                                     labels=["endpoint", "role", "state"])
        for key, ep in sorted(self.registry.endpoints.items()):
            for role in (SERVING, STANDBY):
                backends.add_metric([key, role, "ready"], ep.count(role, True))
                backends.add_metric([key, role, "cold"], ep.count(role, False))
        peers = GaugeMetricFamily("sluice_gateway_peers", "Other gateway replicas whose demand this replica "
                                  "adds to its own for KEDA.", value=self.demand.peers)
        conflicts = GaugeMetricFamily("sluice_gateway_model_name_conflicts", "Model names an endpoint claims "
                                      "that another endpoint holds (1 per conflict).",
                                      labels=["name", "endpoint", "holder"])
        for c in self.registry.conflicts:
            conflicts.add_metric([c.name, c.endpoint, c.holder], 1)
        yield pending
        yield inflight
        yield backends
        yield streams
        yield peers
        yield conflicts


class GatewayMetrics:
    def __init__(self, registry: Registry, demand: DemandBoard):
        self.prom = CollectorRegistry()
        self.prom.register(_Gauges(registry, demand))
        self.prom.register(VersionCollector(registry))  # ServedModels: requests and weight per version
        self.requests = Counter("sluice_gateway_requests", "Finished requests by outcome.",
                                ["endpoint", "outcome"], registry=self.prom)
        self.retries = Counter("sluice_gateway_retries", "Requests re-sent to another backend.",
                               ["endpoint"], registry=self.prom)
        self.standby = Counter(GATEWAY_STANDBY_REQUESTS_METRIC, "Requests sent to a warm-pool backend.",
                               ["endpoint"], registry=self.prom)
        self.refused = Counter("sluice_gateway_refused_requests", "Requests answered before an endpoint was "
                               "known, by reason.", ["reason"], registry=self.prom)
        for reason in REFUSALS:
            self.refused.labels(reason)
        self.hold_seconds = Histogram("sluice_gateway_hold_seconds", "Time a request was held before a "
                                      "backend took it.", ["endpoint"], buckets=HOLD_BUCKETS, registry=self.prom)

        self.tenant_requests = Counter("sluice_gateway_tenant_requests", "Requests by tenant (API keys file "
                                       "tenants; 'none': no tenant's key).", ["tenant", "endpoint"],
                                       registry=self.prom)
        self.tenant_tokens = Counter("sluice_gateway_tenant_tokens", "Tokens by tenant and type (prompt, "
                                     "completion), from the engines' usage.", ["tenant", "endpoint", "type"],
                                     registry=self.prom)
        self.tenant_limited = Counter("sluice_gateway_tenant_rate_limited", "Requests refused with 429 for a "
                                      "tenant's limit, by limit (requests, tokens).", ["tenant", "endpoint", "limit"],
                                      registry=self.prom)

    def tenant_used(self, tenant: str, endpoint: str, prompt: int, completion: int) -> None:
        self.tenant_requests.labels(tenant, endpoint).inc()
        self.tenant_tokens.labels(tenant, endpoint, "prompt").inc(prompt)
        self.tenant_tokens.labels(tenant, endpoint, "completion").inc(completion)

    def finished(self, endpoint: str, outcome: str) -> None:
        assert outcome in OUTCOMES, outcome
        self.requests.labels(endpoint, outcome).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.prom), CONTENT_TYPE_LATEST
