"""Endpoints and their backends, as discovery reports them and as health checks find them.

An endpoint is one model behind one key (`<namespace>/<name>` in a cluster, the model name locally) with
two classes of backend: serving replicas (what KEDA scales, 0..N) and standby replicas (the warm pool:
loaded, outside the serving set). Discovery says which backends exist and whether Kubernetes counts them
ready; the gateway's own GET /ready poll says whether they answer. Only backends that pass both take
requests.

Clients name an endpoint by one of the names it claims (sluice_contract.model_names): in a cluster
`<namespace>/<servedName>` always, the plain servedName when it is published cluster-wide or the gateway
serves one namespace. Each name has one holder: namespaced names are claimed before plain ones (so
`<namespace>/...` belongs to that namespace), and among claimants of one name the endpoint created first
keeps it. The others are reported (log, `conflicts`), never merged.

LoRA adapters (issue 26) are names too: an endpoint whose engines serve adapter `sql` claims `sql` by the same
rule as its served name (`<namespace>/sql`, and plain `sql` where the served name is published plain), and a
request naming it goes to the endpoint's backends, is held and counts in its demand like any other. An
adapter name never takes a name from a model: the order of claims is namespaced names before plain ones, within
each the served names before adapter names, then the endpoint created first. A name resolves to a `Route`:
the endpoint, and the model its engines answer to for that name (the served name, or the adapter's).

Model versions by weight (issue 42, versions.py): a split model's name (a ServedModel's, or a backends file's
`models:` entry) leads to one of its versions per request, and an alias to one version always. A split claims
its names before any endpoint does (it is the explicit intent; a version's own claim on the split's name is not
a conflict, since versions usually share the served name); the chosen version's served name is what the engines
are sent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp

from sluice_contract import SERVING, STANDBY, namespaced_model

from .config import GatewayConfig
from .versions import Split, SplitSpec

log = logging.getLogger("sluice.gateway")

HEALTH_PROBE_TIMEOUT_S = 5.0
HEALTH_TIMEOUTS_TOLERATED = 3  # probes in a row without an answer before a ready backend counts as down
# How long a backend that answered a request for a LoRA adapter counts as holding it (AdapterUse).
ADAPTER_WARM_S = 300.0


@dataclass(frozen=True, slots=True)
class EndpointSpec:
    """What discovery knows about one endpoint: its model and backends (URL -> listed ready)."""

    key: str
    model: str  # the served name: what the backends answer to
    serving: dict[str, bool] = field(default_factory=dict)
    standby: dict[str, bool] = field(default_factory=dict)
    # The names clients may send, the endpoint's own first (default: the model alone, as locally).
    names: tuple[str, ...] = ()
    namespace: str | None = None  # None: not from Kubernetes (static backends)
    created: str = ""  # creationTimestamp (RFC 3339 sorts by time): the older claimant keeps a name
    # LoRA adapters the backends serve beside the model (the engine answers to each by its own name), with the
    # names clients may send for each, the namespaced one first (empty: the adapter's name alone, as locally).
    adapters: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # spec.routing.objectives: objective name (header x-gateway-inference-objective) -> priority (higher first)
    priorities: dict[str, int] = field(default_factory=dict)

    def claimed(self) -> tuple[str, ...]:
        return self.names or (self.model,)

    def claimed_adapters(self) -> dict[str, tuple[str, ...]]:
        return {a: names or (a,) for a, names in self.adapters.items() if a != self.model}


@dataclass(frozen=True, slots=True)
class NameConflict:
    """A name `endpoint` claims (for its model or adapter `model`) that `holder` already has."""

    name: str
    endpoint: str
    holder: str
    model: str = ""


@dataclass(frozen=True, slots=True)
class Route:
    """Where a name a client sends leads: an endpoint, and the model its engines answer to for that name."""

    endpoint: Endpoint
    model: str  # the endpoint's served name, or one of its LoRA adapters
    parent: str | None = None  # an adapter's: the name clients send for the base model (as /v1/models shows)
    split: str | None = None  # a split model's (or its alias's) key: the name chose this version

    @property
    def adapter(self) -> str | None:
        return None if self.model == self.endpoint.model else self.model


@dataclass(eq=False, slots=True)
class Backend:
    url: str
    role: str  # serving | standby
    listed_ready: bool = True  # discovery's view (EndpointSlice condition); static backends: always
    healthy: bool = False  # our last GET /ready
    inflight: int = 0
    poke: asyncio.Event = field(default_factory=asyncio.Event)  # check health now
    task: asyncio.Task | None = None

    @property
    def ready(self) -> bool:
        return self.listed_ready and self.healthy


class AdapterUse:
    """Which backends answered each LoRA adapter of an endpoint lately: the gateway's guess at which replicas
    hold it loaded. Owner: the proxy (the only writer).

    NOTE: a guess, and a cheap one. An engine keeps --max-loras adapters in device slots and swaps the least
    recently used out; one that answered an adapter within ADAPTER_WARM_S most likely still has it (and its
    prefixes in the KV cache), one that never did must load it from disk first. The router prefers these
    backends only while one of them has room under the bounded-load rule, so a busy adapter spreads as far
    as its load needs (and each backend it spills onto counts as holding it from then on)."""

    def __init__(self, ttl: float = ADAPTER_WARM_S, clock: Callable[[], float] = time.monotonic):
        self.ttl, self.clock = ttl, clock
        self._last: dict[str, dict[str, float]] = {}  # adapter -> backend URL -> when it last answered it

    def served(self, adapter: str, url: str) -> None:
        now = self.clock()
        seen = self._last.setdefault(adapter, {})
        for u in [u for u, t in seen.items() if now - t > self.ttl]:  # bounded: no URL outlives its TTL
            del seen[u]
        seen[url] = now

    def missing(self, adapter: str, url: str) -> None:
        """The backend said it does not serve the adapter (404 model_not_found): not loaded there (yet)."""
        self._last.get(adapter, {}).pop(url, None)

    def warm(self, adapter: str) -> frozenset[str]:
        """The backends that answered the adapter within the TTL."""
        now = self.clock()
        return frozenset(u for u, t in self._last.get(adapter, {}).items() if now - t <= self.ttl)

    def keep(self, adapters: Iterable[str]) -> None:
        """Forget adapters the endpoint no longer lists."""
        wanted = set(adapters)
        for a in [a for a in self._last if a not in wanted]:
            del self._last[a]


class Endpoint:
    def __init__(self, key: str, model: str):
        self.key = key
        self.model = model  # the served name (requests are forwarded with it)
        self.names: tuple[str, ...] = (model,)  # what clients may send (only those it holds route here)
        self.adapters: dict[str, tuple[str, ...]] = {}  # LoRA adapter -> the names clients may send for it
        self.adapter_use = AdapterUse()
        self.priorities: dict[str, int] = {}  # objective -> priority (spec.routing.objectives); empty: none set
        self.namespace: str | None = None
        self.created = ""
        self.backends: dict[str, Backend] = {}
        self.removed = False
        self._changed = asyncio.Event()

    def candidates(self) -> tuple[list[Backend], bool]:
        """The backends a request may go to now, and whether the warm pool is among them.

        Ready serving backends take the traffic. While serving replicas are cold (none ready, or some
        still starting during a scale-up) ready standbys join in; once every serving replica is ready,
        traffic is back on the serving set alone.
        """
        serving = [b for b in self.backends.values() if b.role == SERVING]
        ready = [b for b in serving if b.ready]
        if ready and len(ready) == len(serving):
            return ready, False
        standby = [b for b in self.backends.values() if b.role == STANDBY and b.ready]
        return ready + standby, bool(standby)

    def count(self, role: str, ready: bool) -> int:
        return sum(1 for b in self.backends.values() if b.role == role and b.ready == ready)

    def notify(self) -> None:
        """Wake every request waiting on this endpoint (a backend became ready, or went away)."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait_changed(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


class Registry:
    def __init__(self, cfg: GatewayConfig):
        self.cfg = cfg
        self.endpoints: dict[str, Endpoint] = {}
        self._by_name: dict[str, Route] = {}  # every name a client may send -> its one holder
        self.conflicts: list[NameConflict] = []
        self.splits: dict[str, Split] = {}  # split model key -> its routing state (versions.py)
        # every name of a split model -> (the split, None), or of an alias -> (the split, the version's key)
        self._split_names: dict[str, tuple[Split, str | None]] = {}
        self._split_conflicts: set[tuple[str, str, str]] = set()  # (name, claimant, holder) logged once
        self.version_requests: dict[tuple[str, str], int] = {}  # (model, version endpoint) -> requests routed
        self.closing = False  # shutting down: held requests are answered (503) instead of waiting on
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=HEALTH_PROBE_TIMEOUT_S, sock_connect=self.cfg.connect_timeout),
            connector=aiohttp.TCPConnector(limit=0))

    def close(self) -> None:
        """Shutting down: wake every held request so it can be answered now."""
        self.closing = True
        for ep in self.endpoints.values():
            ep.notify()

    async def stop(self) -> None:
        tasks = [b.task for ep in self.endpoints.values() for b in ep.backends.values() if b.task]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session:
            await self._session.close()

    # -- lookups ---------------------------------------------------------------------------------------
    def route(self, name: str, headers: Mapping[str, str] | None = None) -> Route | None:
        """Where a request's `model` leads: the endpoint holding the name, and the model to forward. A split
        model's name picks one of its versions now (by the split's session header in `headers`, if sent) and
        counts the request for that version: call it once per request."""
        held = self._split_names.get(name)
        if held is None:
            return self._by_name.get(name)
        split, alias_of = held
        if alias_of is not None:
            key: str | None = alias_of if alias_of in self.endpoints else None
        else:
            session = headers.get(split.spec.session_header) if headers is not None else None
            key = split.pick(self._version_ready, session or None, known=self.endpoints.__contains__)
        if key is None:
            return None
        ep = self.endpoints[key]
        count = (split.spec.claimed()[0], key)
        self.version_requests[count] = self.version_requests.get(count, 0) + 1
        return Route(ep, ep.model, split=split.spec.key)

    def _version_ready(self, key: str) -> bool:
        ep = self.endpoints.get(key)
        return ep is not None and bool(ep.candidates()[0])

    def _split_route(self, split: Split, alias_of: str | None) -> Route | None:
        """A split name's route as /v1/models shows it (nothing picked, nothing counted): an alias's version, or
        the version the most new requests go to now."""
        if alias_of is None:
            known = split.eligible(self._version_ready, self.endpoints.__contains__)
            alias_of = max(known, key=lambda v: v.weight).endpoint if known else None
        ep = self.endpoints.get(alias_of) if alias_of else None
        return Route(ep, ep.model, split=split.spec.key) if ep is not None else None

    def by_model(self, name: str) -> Endpoint | None:
        """The endpoint a request's `model` names (one of the names it holds, its adapters' included; a split
        model's: the version most of its requests go to now)."""
        route = self._current_routes().get(name)
        return route.endpoint if route is not None else None

    def models(self) -> list[Endpoint]:
        """The endpoints reachable by some name, by key."""
        return sorted({id(r.endpoint): r.endpoint for r in self._current_routes().values()}.values(),
                      key=lambda e: e.key)

    def _current_routes(self) -> dict[str, Route]:
        routes = dict(self._by_name)
        for name, (split, alias_of) in self._split_names.items():
            route = self._split_route(split, alias_of)
            if route is not None:
                routes[name] = route
        return routes

    def routes(self) -> list[tuple[str, Route]]:
        """(name, route) for every name a client may send, sorted (a split model's: see _split_route)."""
        return sorted(self._current_routes().items(), key=lambda item: item[0])

    def names(self) -> list[tuple[str, Endpoint]]:
        """(name, endpoint) for every name a client may send, sorted."""
        return [(name, route.endpoint) for name, route in self.routes()]

    def resolve_key(self, endpoint: str | None, model: str | None, scaled_object: str) -> str:
        """The endpoint a KEDA ScaledObjectRef means: its `endpoint` metadata, else the endpoint in the
        ScaledObject's namespace serving its `model`, else `scaled_object` (<namespace>/<name> of the
        ScaledObject). A model is never resolved to another namespace's endpoint: its demand is not ours."""
        if endpoint and endpoint in self.endpoints:
            return endpoint
        namespace = scaled_object.partition("/")[0]
        if model:
            for name in (namespaced_model(namespace, model), model):
                ep = self.by_model(name)
                if ep is not None and ep.namespace in (None, namespace):
                    return ep.key
        return endpoint or scaled_object

    # -- discovery updates -----------------------------------------------------------------------------
    def apply(self, specs: Sequence[EndpointSpec | SplitSpec]) -> None:
        """Make the endpoints, their backends and the split models match discovery's list."""
        splits = [s for s in specs if isinstance(s, SplitSpec)]
        specs = [s for s in specs if isinstance(s, EndpointSpec)]
        for key in [k for k in self.splits if k not in {s.key for s in splits}]:
            log.info("split model %s removed", key)
            del self.splits[key]
        for sp in splits:
            if sp.key in self.splits:
                self.splits[sp.key].update(sp)
            else:
                self.splits[sp.key] = Split(sp)
                log.info("split model %s (%r) added: %s", sp.key, sp.model,
                         ", ".join(f"{v.endpoint} {v.weight}" for v in sp.versions))
        wanted = {s.key: s for s in specs}
        for key in list(self.endpoints):
            if key not in wanted:
                ep = self.endpoints.pop(key)
                for b in ep.backends.values():
                    self._stop_health(b)
                ep.removed = True
                ep.notify()
                log.info("endpoint %s removed", key)
        for spec in specs:
            ep = self.endpoints.get(spec.key)
            if ep is None:
                ep = self.endpoints[spec.key] = Endpoint(spec.key, spec.model)
                log.info("endpoint %s (model %r) added", spec.key, spec.model)
            ep.model, ep.names, ep.namespace, ep.created = spec.model, spec.claimed(), spec.namespace, spec.created
            ep.adapters = spec.claimed_adapters()
            ep.priorities = dict(spec.priorities)
            ep.adapter_use.keep(ep.adapters)
            if self._sync_backends(ep, spec):
                ep.notify()
        self._claim_names()

    def _claim_names(self) -> None:
        """Give every name one holder. Claims in this order: the endpoints' own (first, namespaced) names, then
        their adapters' namespaced names, then the cluster-wide names of models, then of adapters; within each
        pass the endpoint created first before later ones. Conflicts are logged when they appear."""
        by_name: dict[str, Route] = {}
        conflicts: list[NameConflict] = []
        order = sorted(self.endpoints.values(), key=lambda e: (e.created, e.key))
        passes: tuple[Callable[[Endpoint], Iterable[tuple[str, str, int]]], ...] = (
            lambda e: ((n, e.model, 0) for n in e.names[:1]),
            lambda e: ((n, a, 0) for a, names in e.adapters.items() for n in names[:1]),
            lambda e: ((n, e.model, i) for i, n in enumerate(e.names[1:], 1)),
            lambda e: ((n, a, i) for a, names in e.adapters.items() for i, n in enumerate(names[1:], 1)),
        )
        for claims_of in passes:
            for ep in order:
                for name, model, i in claims_of(ep):
                    # An adapter's parent: the base model's name of the same form (namespaced or plain).
                    parent = None
                    if model != ep.model:
                        parent = ep.names[i] if i < len(ep.names) else ep.names[0]
                    holder = by_name.setdefault(name, Route(ep, model, parent))
                    if holder.endpoint is not ep:
                        conflicts.append(NameConflict(name, ep.key, holder.endpoint.key, model))
        for name, route in list(by_name.items()):  # a parent name another endpoint holds: show the namespaced one
            if route.parent is not None and by_name.get(route.parent, route).endpoint is not route.endpoint:
                by_name[name] = Route(route.endpoint, route.model, route.endpoint.names[0])
        self._claim_split_names(by_name, conflicts)
        for c in set(conflicts) - set(self.conflicts):
            what = "its model" if c.model == self.endpoints[c.endpoint].model else f"its LoRA adapter {c.model!r}"
            log.warning("model name %r: endpoint %s claims it for %s, but %s holds it (namespaced names before plain "
                        "ones, models before adapters, then the endpoint created first); %s is not reachable by "
                        "that name", c.name, c.endpoint, what, c.holder, c.endpoint)
        self._by_name, self.conflicts = by_name, conflicts

    def _claim_split_names(self, by_name: dict[str, Route], conflicts: list[NameConflict]) -> None:
        """Split models' names and aliases, over the endpoints' claims: namespaced names before plain ones, a
        model's names before aliases, then by key. An endpoint that loses a name to a split is a conflict unless
        it is one of that split's versions (versions usually share the served name)."""
        names: dict[str, tuple[Split, str | None]] = {}
        splits = sorted(self.splits.values(), key=lambda s: s.spec.key)
        passes: tuple[Callable[[Split], Iterable[tuple[str, str | None]]], ...] = (
            lambda s: ((n, None) for n in s.spec.claimed()[:1]),
            lambda s: ((ns[0], s.spec.aliases[a]) for a, ns in s.spec.claimed_aliases().items()),
            lambda s: ((n, None) for n in s.spec.claimed()[1:]),
            lambda s: ((n, s.spec.aliases[a]) for a, ns in s.spec.claimed_aliases().items() for n in ns[1:]),
        )
        split_conflicts = set()
        for claims_of in passes:
            for split in splits:
                for name, alias_of in claims_of(split):
                    holder = names.setdefault(name, (split, alias_of))
                    if holder[0] is not split:
                        split_conflicts.add((name, split.spec.key, holder[0].spec.key))
        for c in split_conflicts - self._split_conflicts:
            log.warning("model name %r: split model %s claims it, but split model %s holds it", *c)
        self._split_conflicts = split_conflicts
        for name, (split, _) in names.items():
            route = by_name.pop(name, None)
            versions = {v.endpoint for v in split.spec.versions} | set(split.spec.aliases.values())
            if route is not None and route.endpoint.key not in versions:
                conflicts.append(NameConflict(name, route.endpoint.key, split.spec.key, route.model))
        conflicts[:] = [c for c in conflicts if not (c.name in names and c.endpoint in
                                                     {v.endpoint for v in names[c.name][0].spec.versions})]
        self._split_names = names

    def _sync_backends(self, ep: Endpoint, spec: EndpointSpec) -> bool:
        listed = {**{u: (STANDBY, r) for u, r in spec.standby.items()},
                  **{u: (SERVING, r) for u, r in spec.serving.items()}}
        changed = False
        for url in list(ep.backends):
            if url not in listed:
                self._stop_health(ep.backends.pop(url))
                log.info("endpoint %s: backend %s removed", ep.key, url)
                changed = True
        for url, (role, listed_ready) in listed.items():
            b = ep.backends.get(url)
            if b is None:
                b = ep.backends[url] = Backend(url, role, listed_ready)
                b.task = asyncio.get_running_loop().create_task(self._watch_health(ep, b))
                log.info("endpoint %s: %s backend %s added", ep.key, role, url)
                changed = True
            elif (b.role, b.listed_ready) != (role, listed_ready):
                b.role, b.listed_ready = role, listed_ready
                b.poke.set()  # e.g. a pod turned ready in its EndpointSlice: confirm at once
                changed = True
        return changed

    # -- health ----------------------------------------------------------------------------------------
    @staticmethod
    def _stop_health(b: Backend) -> None:
        if b.task:
            b.task.cancel()
        b.healthy = False

    def mark_failed(self, ep: Endpoint, b: Backend) -> None:
        """A request could not reach the backend: stop routing to it until /ready answers again."""
        if b.healthy:
            log.warning("endpoint %s: backend %s unreachable; not routing to it until /ready answers", ep.key, b.url)
            b.healthy = False
            ep.notify()
        b.poke.set()

    async def _probe(self, url: str) -> bool | None:
        """True: ready. False: refused or not ready. None: no answer in time (a busy engine, maybe)."""
        assert self._session is not None
        try:
            async with self._session.get(f"{url}/ready") as r:
                return r.status == 200
        except asyncio.TimeoutError:
            return None
        except (aiohttp.ClientError, OSError):
            return False

    async def _watch_health(self, ep: Endpoint, b: Backend) -> None:
        slow = 0
        while True:
            b.poke.clear()
            answer = await self._probe(b.url)
            # A ready backend that is merely slow to answer (CPU-bound, say) keeps its traffic for a while;
            # one that refuses connections or says not ready loses it at once.
            slow = slow + 1 if answer is None else 0
            ok = answer if answer is not None else (b.healthy and slow < HEALTH_TIMEOUTS_TOLERATED)
            if ok != b.healthy:
                b.healthy = ok
                log.info("endpoint %s: %s backend %s %s", ep.key, b.role, b.url,
                         "answers /ready" if ok else "does not answer /ready")
                ep.notify()
            interval = self.cfg.health_interval if ok else self.cfg.health_interval_cold
            try:
                await asyncio.wait_for(b.poke.wait(), interval)
            except asyncio.TimeoutError:
                pass
