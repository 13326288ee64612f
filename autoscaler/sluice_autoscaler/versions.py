"""Model versions by weight (issue 42): one name clients send, split over several endpoints (the versions).

A `ServedModel` (sluice.dev/v1alpha1, or a backends file's `models:` entry) names a model, its versions (each an
endpoint with a weight) and aliases (a name that leads to one version only). The registry resolves the model's
name to one version per request with `Split.pick`:

- Only versions with weight > 0 and a ready backend take requests; their weights are renormalised among them.
  A version with weight 0 never gets a new request (its requests in flight finish where they are).
- None of the weighted versions ready (all scaled to zero, say): the request goes to the weighted choice anyway
  and is held there, which wakes that version from zero as any held request does.
- No session key: smooth weighted round-robin (nginx's): deterministic, so 90/10 over 1,000 requests gives
  exactly 900/100, and the versions interleave (no bursts of 9 in a row).
- A session key (the split's session header): the key's hash is a point in [0, 1), and the versions own
  consecutive intervals of it in a fixed order (the spec's), sized by weight. The same key goes to the same
  version while weights are unchanged, and moving weight between two versions moves only the sessions in the
  interval that changed hands (90/10 -> 80/20 moves a tenth of the sessions, all of them v1 -> v2).

`VersionCollector` exposes the requests each version got as `sluice_gateway_version_requests_total{model,endpoint}`
and the weights as `sluice_gateway_version_weight{model,endpoint}`; the registry keeps the counts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

DEFAULT_SESSION_HEADER = "x-session-id"
VERSION_REQUESTS_METRIC = "sluice_gateway_version_requests"  # _total added by the exposition
VERSION_WEIGHT_METRIC = "sluice_gateway_version_weight"


@dataclass(frozen=True, slots=True)
class Version:
    endpoint: str  # the endpoint's key (<namespace>/<name> in a cluster; a backends file's `name` or model)
    weight: int


@dataclass(frozen=True, slots=True)
class SplitSpec:
    """What discovery knows about one split model: its names, versions and aliases."""

    key: str  # <namespace>/<name> of the ServedModel; locally the model name
    model: str  # the name clients send (its plain form)
    versions: tuple[Version, ...]
    names: tuple[str, ...] = ()  # the names clients may send for it, the namespaced one first (default: model)
    aliases: dict[str, str] = field(default_factory=dict)  # alias -> the endpoint key it leads to
    alias_names: dict[str, tuple[str, ...]] = field(default_factory=dict)  # alias -> names (default: alias)
    session_header: str = DEFAULT_SESSION_HEADER
    namespace: str | None = None

    def claimed(self) -> tuple[str, ...]:
        return self.names or (self.model,)

    def claimed_aliases(self) -> dict[str, tuple[str, ...]]:
        return {a: self.alias_names.get(a) or (a,) for a in self.aliases}


def session_point(key: str) -> float:
    """A session key as a point in [0, 1): stable across processes and gateway replicas (not Python's hash)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64


def traffic_shares(weights: Mapping[str, int], ready: Callable[[str], bool]) -> dict[str, float]:
    """Each version's share of new requests now, in [0, 1]: the weights renormalised over the ready versions
    with weight > 0; none of those ready, the weights as written (the request is held at the chosen version)."""
    live = {v: w for v, w in weights.items() if w > 0 and ready(v)} or {v: w for v, w in weights.items() if w > 0}
    total = sum(live.values())
    return {v: (live.get(v, 0) / total if total else 0.0) for v in weights}


class Split:
    """One split model's routing state. Owner: the registry (discovery replaces `spec`; the proxy picks)."""

    def __init__(self, spec: SplitSpec):
        self.spec = spec
        self._current: dict[str, int] = {}  # smooth weighted round-robin: each version's running credit

    def update(self, spec: SplitSpec) -> None:
        if {v.endpoint: v.weight for v in spec.versions} != {v.endpoint: v.weight for v in self.spec.versions}:
            self._current.clear()  # new weights: start the round afresh (it is exact again from here on)
        self.spec = spec

    def eligible(self, ready: Callable[[str], bool], known: Callable[[str], bool] = lambda _: True) -> list[Version]:
        """The versions a request may go to: weighted and ready; none ready: weighted (it is held there).
        `known`: whether the version's endpoint exists at all (one discovery has not listed takes nothing)."""
        weighted = [v for v in self.spec.versions if v.weight > 0 and known(v.endpoint)]
        return [v for v in weighted if ready(v.endpoint)] or weighted

    def pick(self, ready: Callable[[str], bool], session: str | None = None,
             known: Callable[[str], bool] = lambda _: True) -> str | None:
        """The endpoint key of the version that takes the next request (None: no known version has weight)."""
        versions = self.eligible(ready, known)
        if not versions:
            return None
        total = sum(v.weight for v in versions)
        if session:
            point, upto = session_point(session) * total, 0
            for v in versions:
                upto += v.weight
                if point < upto:
                    return v.endpoint
            return versions[-1].endpoint
        best: Version | None = None
        for v in versions:
            self._current[v.endpoint] = self._current.get(v.endpoint, 0) + v.weight
            if best is None or self._current[v.endpoint] > self._current[best.endpoint]:
                best = v
        assert best is not None
        self._current[best.endpoint] -= total
        return best.endpoint


class VersionCollector:
    """Prometheus collector over the registry's splits (register it on the gateway's CollectorRegistry)."""

    def __init__(self, registry):  # registry.Registry (not imported: it imports this module)
        self.registry = registry

    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        requests = CounterMetricFamily(VERSION_REQUESTS_METRIC, "Requests sent to each version of a split model "
                                       "(ServedModel).", labels=["model", "endpoint"])
        weights = GaugeMetricFamily(VERSION_WEIGHT_METRIC, "Each version's weight in its split model.",
                                    labels=["model", "endpoint"])
        counts = dict(self.registry.version_requests)
        for split in sorted(self.registry.splits.values(), key=lambda s: s.spec.key):
            model = split.spec.claimed()[0]
            for v in split.spec.versions:
                counts.setdefault((model, v.endpoint), 0)
                weights.add_metric([model, v.endpoint], v.weight)
        for (model, endpoint), n in sorted(counts.items()):
            requests.add_metric([model, endpoint], n)
        yield requests
        yield weights
