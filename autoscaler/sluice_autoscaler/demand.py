"""Demand per endpoint: requests held (no ready backend yet) and in flight. KEDA reads it through the
external scaler, Prometheus through the gauges. It lives in the gateway because at zero replicas there is
no engine to report a queue: scaling from zero must not depend on engine metrics.

Several gateway replicas each hold their own requests; KEDA's calls reach one of them (it keeps one gRPC
connection per scaler address, and the Service puts that connection on one pod). So the board keeps two
things apart:
- this replica's own counts (`Demand`, written by the proxy only), which peers.py serves to the others;
- the counts the other replicas last reported (`PeerCounts`, written by peers.py only).
The external scaler answers with their sum (`total`). The Prometheus gauges show this replica's own counts
(Prometheus scrapes every replica and sums them itself).

Subscribers (StreamIsActive streams) get the summed activity pushed whenever it flips, and `True` again
whenever a hold begins on any replica (a new cold start to signal), so KEDA scales 0 -> 1 without waiting
for its poll, whichever replica holds the request.

Entries are created only by the proxy, for endpoints discovery listed; the external scaler only reads them,
so callers naming made-up endpoints cannot grow the board. Subscriptions are bounded in number, and each
subscriber's queue is bounded too (a reader that stops reading loses the oldest states, not memory).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

SUBSCRIBER_QUEUE = 8  # states queued per subscriber; older ones are dropped (the newest is what counts)


@dataclass(slots=True)
class Demand:
    """One endpoint's requests on this replica. Owner: the proxy (the only writer)."""

    key: str
    on_edge: Callable[[str, bool], None]  # (key, a hold began): activity flipped or a hold began
    held: int = 0
    inflight: int = 0
    held_bytes: int = 0  # request bodies of the held requests
    hold_starts: int = 0  # times `held` rose from 0: peers compare it to see a new cold start

    @property
    def active(self) -> bool:
        return self.held + self.inflight > 0

    @property
    def value(self) -> int:
        """The scaling metric: requests the endpoint owes an answer to."""
        return self.held + self.inflight

    def add(self, held: int = 0, inflight: int = 0) -> None:
        was_active, was_held = self.active, self.held
        self.held += held
        self.inflight += inflight
        assert self.held >= 0 and self.inflight >= 0, (self.held, self.inflight)
        hold_began = self.held > 0 and was_held == 0
        if hold_began:
            self.hold_starts += 1
        if self.active != was_active or hold_began:
            self.on_edge(self.key, hold_began)


@dataclass(frozen=True, slots=True)
class PeerCounts:
    """One endpoint's requests on another replica, as it last reported them."""

    held: int = 0
    inflight: int = 0
    hold_starts: int = 0


class DemandBoard:
    """Demand by endpoint key (this replica's and its peers'), and the StreamIsActive subscribers by key
    (a key may be subscribed to before discovery lists it: KEDA may connect first)."""

    def __init__(self, max_subscribers: int = 256) -> None:
        self._by_key: dict[str, Demand] = {}
        self._peers: dict[str, dict[str, PeerCounts]] = {}  # peer (its URL) -> key -> counts
        self._subs: dict[str, set[asyncio.Queue[bool]]] = {}
        self._pushed: dict[str, bool] = {}  # the summed activity subscribers last got, by key
        self.max_subscribers = max_subscribers
        self.held_total = 0  # requests held by this replica, all endpoints
        self.held_bytes_total = 0
        # Bumped on every edge of this replica's own demand; peers long-poll for a change (peers.py).
        self.epoch = 0
        self._epoch_changed = asyncio.Event()

    def __getitem__(self, key: str) -> Demand:
        """This replica's entry of an endpoint the proxy serves (created on first use)."""
        d = self._by_key.get(key)
        if d is None:
            d = self._by_key[key] = Demand(key, self._local_edge)
        return d

    def get(self, key: str) -> Demand | None:
        return self._by_key.get(key)

    def prune(self, known: set[str]) -> None:
        """Drop idle entries of endpoints that are gone."""
        for key in [k for k, d in self._by_key.items() if k not in known and not d.active]:
            del self._by_key[key]
        for key in [k for k in self._pushed if k not in known and k not in self._subs]:
            del self._pushed[key]

    def items(self) -> list[tuple[str, Demand]]:
        return sorted(self._by_key.items())

    # -- the sum over replicas --------------------------------------------------------------------------
    def total(self, key: str) -> tuple[bool, int]:
        """(active, held + in-flight) of an endpoint over this replica and every peer that reports."""
        held, inflight = self.totals(key)
        return held + inflight > 0, held + inflight

    def totals(self, key: str) -> tuple[int, int]:
        """(held, in-flight) of an endpoint over this replica and every peer that reports."""
        own = self._by_key.get(key)
        held, inflight = (own.held, own.inflight) if own is not None else (0, 0)
        for counts in self._peers.values():
            c = counts.get(key)
            if c is not None:
                held, inflight = held + c.held, inflight + c.inflight
        return held, inflight

    @property
    def peers(self) -> int:
        """Peers whose counts are part of the sum."""
        return len(self._peers)

    def local_counts(self) -> dict[str, PeerCounts]:
        """This replica's own counts, as peers read them."""
        return {k: PeerCounts(d.held, d.inflight, d.hold_starts) for k, d in self._by_key.items()}

    def set_peer(self, peer: str, counts: dict[str, PeerCounts] | None) -> None:
        """A peer's latest report (None: it is gone, or silent too long). Owner: peers.py."""
        old = self._peers.pop(peer, {})
        if counts is not None:
            self._peers[peer] = counts
        new = counts or {}
        for key in old.keys() | new.keys():
            before, after = old.get(key), new.get(key)
            hold_began = after is not None and after.held > 0 and (
                before is None or after.hold_starts != before.hold_starts)
            if hold_began or before is None or after is None or (before.held + before.inflight > 0) != (
                    after.held + after.inflight > 0):
                self._refresh(key, hold_began)

    async def wait_epoch(self, seen: int, timeout: float) -> None:
        """Until this replica's demand has an edge after epoch `seen`, or `timeout` seconds."""
        if self.epoch != seen:
            return
        try:
            await asyncio.wait_for(self._epoch_changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def _local_edge(self, key: str, hold_began: bool) -> None:
        self.epoch += 1
        changed, self._epoch_changed = self._epoch_changed, asyncio.Event()
        changed.set()
        self._refresh(key, hold_began)

    # -- subscribers -----------------------------------------------------------------------------------
    @property
    def subscriber_count(self) -> int:
        return sum(len(s) for s in self._subs.values())

    def subscribed_keys(self) -> list[str]:
        return list(self._subs)

    def subscribers(self, key: str) -> set[asyncio.Queue[bool]]:
        return self._subs.get(key, set())

    def subscribe(self, key: str) -> asyncio.Queue[bool] | None:
        """A queue of activity states for the key; None when --scaler-max-streams are already open."""
        if self.subscriber_count >= self.max_subscribers:
            return None
        q: asyncio.Queue[bool] = asyncio.Queue(SUBSCRIBER_QUEUE)
        self._subs.setdefault(key, set()).add(q)
        return q

    def unsubscribe(self, key: str, q: asyncio.Queue[bool]) -> None:
        subs = self._subs.get(key)
        if subs is not None:
            subs.discard(q)
            if not subs:
                del self._subs[key]

    def _refresh(self, key: str, hold_began: bool) -> None:
        """Push the summed activity when it flipped, and `True` again when a hold began anywhere."""
        active = self.total(key)[0]
        if active == self._pushed.get(key, False) and not (hold_began and active):
            return
        self._pushed[key] = active
        for q in self._subs.get(key, ()):
            if q.full():
                q.get_nowait()
            q.put_nowait(active)
