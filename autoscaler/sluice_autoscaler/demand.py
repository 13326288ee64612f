"""Demand per endpoint: requests held (no ready backend yet) and in flight. KEDA reads it through the
external scaler, Prometheus through the gauges. It lives in the gateway because at zero replicas there is
no engine to report a queue: scaling from zero must not depend on engine metrics.

Subscribers (StreamIsActive streams) get the activity state pushed whenever it flips, and `True` again
whenever a hold begins (a new cold start to signal), so KEDA scales 0 -> 1 without waiting for its poll.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass(slots=True)
class Demand:
    held: int = 0
    inflight: int = 0
    subscribers: set[asyncio.Queue[bool]] = field(default_factory=set)

    @property
    def active(self) -> bool:
        return self.held + self.inflight > 0

    @property
    def value(self) -> int:
        """The scaling metric: requests the endpoint owes an answer to."""
        return self.held + self.inflight

    def _publish(self, active: bool) -> None:
        for q in self.subscribers:
            q.put_nowait(active)

    def add(self, held: int = 0, inflight: int = 0) -> None:
        was_active, was_held = self.active, self.held
        self.held += held
        self.inflight += inflight
        assert self.held >= 0 and self.inflight >= 0, (self.held, self.inflight)
        if self.active != was_active or (self.held > 0 and was_held == 0):
            self._publish(self.active)


class DemandBoard:
    """Demand by endpoint key. A key exists as soon as anyone asks (KEDA may ask before discovery)."""

    def __init__(self) -> None:
        self._by_key: dict[str, Demand] = {}

    def __getitem__(self, key: str) -> Demand:
        d = self._by_key.get(key)
        if d is None:
            d = self._by_key[key] = Demand()
        return d

    def items(self) -> list[tuple[str, Demand]]:
        return sorted(self._by_key.items())

    def subscribe(self, key: str) -> asyncio.Queue[bool]:
        q: asyncio.Queue[bool] = asyncio.Queue()
        self[key].subscribers.add(q)
        return q

    def unsubscribe(self, key: str, q: asyncio.Queue[bool]) -> None:
        self[key].subscribers.discard(q)
