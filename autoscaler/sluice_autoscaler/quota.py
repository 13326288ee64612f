"""Per-tenant request and token limits, enforced across gateway replicas.

A tenant (auth.py: the `tenants` section of the API keys file) may have limits per minute on requests and on
tokens (prompt + generated), over all endpoints together and per endpoint. Each limit is a sliding window of
the last 60 seconds, kept as one bucket per second.

Tokens are not known until the engine answers, so a request reserves its worst case up front (an estimate of
its prompt from the body's size, plus max_tokens x n) and settles to the engine's `usage` when it ends: a
request is admitted only if its reservation fits what the window has left, and the window then counts what
was actually used. A request whose usage never came back (the client left mid-stream) keeps the tokens the
gateway saw: its prompt estimate plus one token per streamed chunk.

Across replicas (the design choice, see docs/gateway.md "Tenants and quotas"): each replica serves its own
buckets to the others on the peer port it already runs for KEDA's demand (peers.py), and admits a request
against its own window plus the others' last reported windows. No new datastore; the others' counts are at
most --peer-interval old, so two replicas together may admit up to one interval's worth of requests past a
limit (each sees the other's usage that much late). Per-replica shares (limit / replicas) would need no
exchange but refuse a tenant whose traffic lands on one replica at half its limit; Redis would be exact but
is a datastore to run, secure and keep available in the request path.

Owner: the proxy admits and settles (the only writer of this replica's buckets); peers.py writes the others'.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

WINDOW_S = 60  # limits are per minute
ALL_ENDPOINTS = "*"  # the scope of a tenant's limit over all endpoints together
# A request without max_tokens may generate up to the model's context; the reservation assumes this many.
DEFAULT_RESERVED_COMPLETION = 256
BYTES_PER_PROMPT_TOKEN = 4  # the prompt estimate from the body's size (settled to the true count after)


@dataclass(frozen=True, slots=True)
class Limits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    @property
    def empty(self) -> bool:
        return self.requests_per_minute is None and self.tokens_per_minute is None


@dataclass(slots=True)
class Window:
    """One (tenant, scope)'s use on this replica: {second: [requests, tokens]} within the last WINDOW_S."""

    buckets: dict[int, list[int]] = field(default_factory=dict)

    def trim(self, now: int) -> None:
        for sec in [s for s in self.buckets if s <= now - WINDOW_S]:
            del self.buckets[sec]

    def add(self, sec: int, requests: int, tokens: int) -> None:
        b = self.buckets.setdefault(sec, [0, 0])
        b[0] += requests
        b[1] += tokens

    def totals(self, now: int) -> tuple[int, int]:
        r = t = 0
        for sec, (nr, nt) in self.buckets.items():
            if sec > now - WINDOW_S:
                r += nr
                t += nt
        return r, t


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is over a limit: for the 429's message and Retry-After."""

    tenant: str
    scope: str  # an endpoint key, or ALL_ENDPOINTS
    limit: str  # "requests" | "tokens"
    value: int  # the limit per minute
    used: int  # in the window now (all replicas)
    wanted: int  # what this request needs (1 request, or its token reservation)
    retry_after: int  # seconds until the window has room, at the earliest

    @property
    def message(self) -> str:
        where = "over all endpoints" if self.scope == ALL_ENDPOINTS else f"on endpoint {self.scope}"
        what = "requestsPerMinute" if self.limit == "requests" else "tokensPerMinute"
        if self.limit == "tokens" and self.wanted > self.value:
            return (f"tenant '{self.tenant}' {what} limit {self.value} {where}: this request reserves {self.wanted} "
                    "tokens (prompt estimate + max_tokens x n), more than the limit; lower max_tokens")
        return (f"tenant '{self.tenant}' {what} limit {self.value} {where} reached ({self.used} used in the last "
                f"minute, this request needs {self.wanted}); retry after {self.retry_after}s")


@dataclass(slots=True)
class Ticket:
    """An admitted request's reservation, settled once when it ends."""

    tenant: str
    scopes: tuple[str, ...]
    sec: int
    reserved: int
    settled: bool = False


class UsageBoard:
    """This replica's windows, and the other replicas' last reported ones."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock  # wall clock: replicas compare bucket seconds with each other
        self.local: dict[tuple[str, str], Window] = {}
        self.peers: dict[str, dict[tuple[str, str], dict[int, tuple[int, int]]]] = {}

    def _now(self) -> int:
        return int(self.clock())

    # -- admission (the proxy) -------------------------------------------------------------------------------
    def used(self, tenant: str, scope: str, now: int) -> tuple[int, int, Window | None]:
        w = self.local.get((tenant, scope))
        r, t = w.totals(now) if w else (0, 0)
        for windows in self.peers.values():
            for sec, (nr, nt) in windows.get((tenant, scope), {}).items():
                if sec > now - WINDOW_S:
                    r += nr
                    t += nt
        return r, t, w

    def _retry_after(self, tenant: str, scope: str, now: int, over: int, column: int) -> int:
        """Seconds until the buckets that age out first free `over` of the column (requests or tokens)."""
        per_sec: dict[int, int] = {}
        w = self.local.get((tenant, scope))
        for sec, b in (w.buckets.items() if w else ()):
            per_sec[sec] = per_sec.get(sec, 0) + b[column]
        for windows in self.peers.values():
            for sec, b in windows.get((tenant, scope), {}).items():
                per_sec[sec] = per_sec.get(sec, 0) + b[column]
        freed = 0
        for sec in sorted(s for s in per_sec if s > now - WINDOW_S):
            freed += per_sec[sec]
            if freed >= over:
                return max(1, sec + WINDOW_S - now)
        return WINDOW_S

    def admit(self, tenant: str, limits: Iterable[tuple[str, Limits]], reserve: int) -> Ticket | Refusal:
        """Admit one request reserving `reserve` tokens under every (scope, limits) given, or say which limit
        it is over. Admitted: the request and its reservation count in each scope's window at once."""
        now = self._now()
        scopes = []
        for scope, lim in limits:
            if lim.empty:
                continue
            r, t, _ = self.used(tenant, scope, now)
            if lim.requests_per_minute is not None and r + 1 > lim.requests_per_minute:
                return Refusal(tenant, scope, "requests", lim.requests_per_minute, r, 1,
                               self._retry_after(tenant, scope, now, r + 1 - lim.requests_per_minute, 0))
            if lim.tokens_per_minute is not None and t + reserve > lim.tokens_per_minute:
                over = t + reserve - lim.tokens_per_minute
                wait = WINDOW_S if reserve > lim.tokens_per_minute else self._retry_after(tenant, scope, now, over, 1)
                return Refusal(tenant, scope, "tokens", lim.tokens_per_minute, t, reserve, wait)
            scopes.append(scope)
        for scope in scopes:
            w = self.local.setdefault((tenant, scope), Window())
            w.trim(now)
            w.add(now, 1, reserve)
        return Ticket(tenant, tuple(scopes), now, reserve)

    def settle(self, ticket: Ticket, tokens: int) -> None:
        """The request ended having used `tokens`: its reservation gives way to them."""
        if ticket.settled:
            return
        ticket.settled = True
        now = self._now()
        for scope in ticket.scopes:
            w = self.local.setdefault((ticket.tenant, scope), Window())
            if ticket.sec in w.buckets:  # still in the window: take the reservation back where it was counted
                w.buckets[ticket.sec][1] -= ticket.reserved
                w.add(now, 0, tokens)
            elif ticket.sec > now - WINDOW_S:
                w.add(now, 0, tokens - ticket.reserved)
            else:  # the reservation aged out while the request ran: what it used counts from now
                w.add(now, 0, tokens)
            w.trim(now)

    # -- the peer exchange (peers.py) ------------------------------------------------------------------------
    def local_snapshot(self) -> dict[str, list[list[int]]]:
        """This replica's windows for its peers: {"<tenant>\\t<scope>": [[second, requests, tokens], ...]}."""
        now = self._now()
        out = {}
        for (tenant, scope), w in list(self.local.items()):
            w.trim(now)
            if w.buckets:
                out[f"{tenant}\t{scope}"] = [[s, r, t] for s, (r, t) in sorted(w.buckets.items())]
            else:
                del self.local[(tenant, scope)]
        return out

    def set_peer(self, peer: str, snapshot: dict[tuple[str, str], dict[int, tuple[int, int]]] | None) -> None:
        if snapshot is None:
            self.peers.pop(peer, None)
        else:
            self.peers[peer] = snapshot


def parse_snapshot(payload: object, known_tenants: Iterable[str]) -> dict[tuple[str, str], dict[int, tuple[int, int]]]:
    """A peer's `usage` as the board keeps it; ValueError when malformed. Tenants this replica does not know
    (its keys file is older or newer) are dropped: they cannot be admitted here anyway."""
    if not isinstance(payload, dict):
        raise ValueError("usage must be an object")
    known = set(known_tenants)
    out: dict[tuple[str, str], dict[int, tuple[int, int]]] = {}
    for name, rows in payload.items():
        tenant, sep, scope = str(name).partition("\t")
        if not sep or not isinstance(rows, list) or len(rows) > WINDOW_S + 1:
            raise ValueError(f"bad usage entry {name!r}")
        buckets = {}
        for row in rows:
            if not (isinstance(row, list) and len(row) == 3 and all(
                    isinstance(n, int) and not isinstance(n, bool) for n in row)):
                raise ValueError(f"bad usage bucket for {name!r}")
            buckets[row[0]] = (row[1], row[2])
        if tenant in known:
            out[(tenant, scope)] = buckets
    return out


def prompt_estimate(body_bytes: int) -> int:
    """A prompt's tokens guessed from its request body's size (settled to the engine's count after)."""
    return math.ceil(body_bytes / BYTES_PER_PROMPT_TOKEN)


def reservation(body: dict, body_bytes: int) -> int:
    """Worst-case tokens of a request: its prompt estimated from the body's size, plus what it may generate."""
    n = body.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
    most = body.get("max_completion_tokens", body.get("max_tokens"))
    if not (isinstance(most, int) and not isinstance(most, bool) and most >= 0):
        most = DEFAULT_RESERVED_COMPLETION
    return prompt_estimate(body_bytes) + most * n


@dataclass(slots=True)
class RequestMeter:
    """A metered request's tenant, endpoint and reservation, settled when the exchange ends."""

    board: UsageBoard
    tenant: str  # a configured tenant's name, or auth.NO_TENANT
    endpoint: str
    prompt_estimate: int
    ticket: Ticket | None = None  # None: no limit applies (counted, not limited)
    strip: bool = False  # the gateway asked the engine for stream usage: the client must not see it

    def finish(self, prompt: int | None, completion: int | None, chunks: int) -> tuple[int, int]:
        """(prompt, completion) tokens to count: the engine's usage, or without it (the client left mid-stream,
        the backend failed) the prompt estimate and one token per chunk seen; nothing if no chunk came."""
        if prompt is None or completion is None:
            prompt, completion = (self.prompt_estimate, chunks) if chunks else (0, 0)
        if self.ticket is not None:
            self.board.settle(self.ticket, prompt + completion)
        return prompt, completion
