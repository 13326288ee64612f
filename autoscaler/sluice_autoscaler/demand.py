"""Demand per endpoint: requests held (no ready backend yet) and in flight. KEDA reads it through the
external scaler, Prometheus through the gauges. It lives in the gateway because at zero replicas there is
no engine to report a queue: scaling from zero must not depend on engine metrics.

Subscribers (StreamIsActive streams) get the activity state pushed whenever it flips, and `True` again
whenever a hold begins (a new cold start to signal), so KEDA scales 0 -> 1 without waiting for its poll.

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
    key: str
    publish: Callable[[str, bool], None]
    held: int = 0
    inflight: int = 0
    held_bytes: int = 0  # request bodies of the held requests

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
        if self.active != was_active or (self.held > 0 and was_held == 0):
            self.publish(self.key, self.active)


class DemandBoard:
    """Demand by endpoint key, and the StreamIsActive subscribers by key (a key may be subscribed to before
    discovery lists it: KEDA may connect first)."""

    def __init__(self, max_subscribers: int = 256) -> None:
        self._by_key: dict[str, Demand] = {}
        self._subs: dict[str, set[asyncio.Queue[bool]]] = {}
        self.max_subscribers = max_subscribers
        self.held_total = 0  # requests held, all endpoints
        self.held_bytes_total = 0

    def __getitem__(self, key: str) -> Demand:
        """The entry of an endpoint the proxy serves (created on first use)."""
        d = self._by_key.get(key)
        if d is None:
            d = self._by_key[key] = Demand(key, self._publish)
        return d

    def get(self, key: str) -> Demand | None:
        return self._by_key.get(key)

    def prune(self, known: set[str]) -> None:
        """Drop idle entries of endpoints that are gone."""
        for key in [k for k, d in self._by_key.items() if k not in known and not d.active]:
            del self._by_key[key]

    def items(self) -> list[tuple[str, Demand]]:
        return sorted(self._by_key.items())

    # -- subscribers -----------------------------------------------------------------------------------
    @property
    def subscriber_count(self) -> int:
        return sum(len(s) for s in self._subs.values())

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

    def _publish(self, key: str, active: bool) -> None:
        for q in self._subs.get(key, ()):
            if q.full():
                q.get_nowait()
            q.put_nowait(active)
