"""The operator's own Prometheus metrics (docs/metrics.md#operator): reconcile passes and their
durations, its requests to the Kubernetes API, endpoints by phase, and whether this replica leads.

Each Loop has its own registry (tests run several operators in one process); `sluice operator
--metrics-port` serves it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PHASES = ("Pending", "Loading", "Ready", "Degraded", "Idle", "Failed")  # status.py


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.reconciles = Counter("sluice_operator_reconciles", "Reconcile passes over an endpoint, by result "
                                  "(ok, invalid: the spec does not validate, error: retried).", ["result"], registry=r)
        self.reconcile_seconds = Histogram("sluice_operator_reconcile_duration_seconds", "Duration of one "
                                           "reconcile pass over an endpoint.", buckets=RECONCILE_BUCKETS, registry=r)
        self.resync_rounds = Histogram("sluice_operator_resync_round_duration_seconds", "Duration of one resync "
                                       "round over every endpoint (its count: rounds done).", buckets=RECONCILE_BUCKETS,
                                       registry=r)
        self.api_requests = Counter("sluice_operator_api_requests", "Requests the operator made to the Kubernetes "
                                    "API, by method and HTTP status (error: no answer).", ["method", "code"],
                                    registry=r)
        self.endpoints = Gauge("sluice_operator_endpoints", "InferenceEndpoints by status phase, as this replica "
                               "last wrote them.", ["phase"], registry=r)
        self.leader = Gauge("sluice_operator_leader", "1 while this replica reconciles (holds the Lease, or runs "
                            "without leader election), else 0.", registry=r)
        self._phases: dict[tuple[str, str], str] = {}
        for phase in PHASES:
            self.endpoints.labels(phase).set(0)

    def count_request(self, method: str, code: int | str) -> None:
        self.api_requests.labels(method, str(code)).inc()

    def observe_reconcile(self, result: str, seconds: float) -> None:
        self.reconciles.labels(result).inc()
        self.reconcile_seconds.observe(seconds)

    def set_phase(self, key: tuple[str, str], phase: str | None) -> None:
        """The endpoint's phase now (None: it is gone)."""
        if phase is None:
            self._phases.pop(key, None)
        else:
            self._phases[key] = phase
        self._refresh()

    def keep_only(self, keys: set[tuple[str, str]]) -> None:
        """Forget endpoints not in `keys` (deleted while nothing reconciled them)."""
        for key in set(self._phases) - keys:
            del self._phases[key]
        self._refresh()

    def _refresh(self) -> None:
        counts = dict.fromkeys(PHASES, 0)
        for phase in self._phases.values():
            counts[phase] = counts.get(phase, 0) + 1
        for phase, n in counts.items():
            self.endpoints.labels(phase).set(n)

    def api_requests_total(self) -> float:
        return _total(self.api_requests)

    def reconciles_total(self) -> float:
        return _total(self.reconciles)

    def resync_rounds_total(self) -> float:
        return next(s.value for m in self.resync_rounds.collect() for s in m.samples if s.name.endswith("_count"))

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr, registry=self.registry)


def _total(counter: Counter) -> float:
    """A counter's value summed over its labels (tests and benchmarks read it)."""
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))
