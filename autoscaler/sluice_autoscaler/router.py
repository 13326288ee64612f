"""Which backend takes a request: consistent hashing with bounded loads (CHWBL) on the prompt's prefix,
least-loaded when a request has no prefix, or round-robin (a baseline for benchmarks).

CHWBL (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded Loads", 2018): every backend
owns many points on a hash ring; a key walks clockwise from its hash and takes the first backend whose
load stays within ceil(c * (total load + 1) / n). Requests that share a prefix therefore land on the
backend that has the prefix in its KV cache, and a hot prefix spills onto the next backends on the ring
instead of overloading one. Adding or removing a backend moves only the keys it gains or owned.

A request may come with backends to prefer (those that hold its LoRA adapter: registry.AdapterUse). The
preference is soft: it picks among them, by the same walk, while one has room under the bound of all the
candidates; when none has, the request is routed as if it had none.
Pure: no I/O; loads are the callers' in-flight counts.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Collection, Iterator, Sequence
from typing import Protocol

VNODES = 128  # points per backend on the ring: keeps the split even within a few percent


class Routable(Protocol):
    @property
    def url(self) -> str: ...

    @property
    def inflight(self) -> int: ...


def hash64(data: str) -> int:
    # surrogatepass: a prompt may hold a lone surrogate (valid JSON, not valid UTF-8); it still hashes.
    return int.from_bytes(hashlib.blake2b(data.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


class HashRing:
    """VNODES points per backend id on a 64-bit ring."""

    def __init__(self, ids: Sequence[str], vnodes: int = VNODES):
        points = sorted((hash64(f"{i}#{v}"), i) for i in ids for v in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._ids = [i for _, i in points]
        self.size = len(set(ids))

    def walk(self, key: str) -> Iterator[str]:
        """Distinct backend ids clockwise from the key's hash: its preference order."""
        n = len(self._ids)
        if n == 0:
            return
        start = bisect.bisect(self._hashes, hash64(key))
        seen: set[str] = set()
        for step in range(n):
            i = self._ids[(start + step) % n]
            if i not in seen:
                seen.add(i)
                yield i
                if len(seen) == self.size:
                    return


def load_bound(total_load: int, n: int, load_factor: float) -> int:
    """The most requests one of n backends may hold after taking one more (the CHWBL bound)."""
    return math.ceil(load_factor * (total_load + 1) / n)


def first_with_room(ring: HashRing, key: str, loads: dict[str, int], bound: int) -> str | None:
    """The first backend on the key's walk whose load stays within `bound` with one more request."""
    for i in ring.walk(key):
        if i in loads and loads[i] + 1 <= bound:
            return i
    return None


def chwbl_pick(ring: HashRing, key: str, loads: dict[str, int], load_factor: float) -> str:
    """The first backend on the key's walk with room under the bound. One always has room: the least
    loaded one holds at most floor(total / n) < bound."""
    found = first_with_room(ring, key, loads, load_bound(sum(loads.values()), len(loads), load_factor))
    if found is not None:
        return found
    return min(loads, key=lambda i: (loads[i], i))  # unreachable while the ring holds every id


class Router:
    def __init__(self, mode: str = "prefix", load_factor: float = 1.25, load_floor: int = 0):
        self.mode = mode
        self.load_factor = load_factor
        # A backend with fewer requests in flight than this is never over the bound: while every engine has
        # idle batch slots, spilling a prefix to another backend only costs a cache miss (0: CHWBL as published).
        self.load_floor = load_floor
        self._rings: dict[tuple[str, ...], HashRing] = {}
        self._turn = 0

    def _ring(self, ids: tuple[str, ...]) -> HashRing:
        ring = self._rings.get(ids)
        if ring is None:
            if len(self._rings) > 64:  # candidate sets change with readiness; keep the cache small
                self._rings.clear()
            ring = self._rings[ids] = HashRing(ids)
        return ring

    def pick(self, candidates: Sequence[Routable], key: str | None,
             prefer: Collection[str] = ()) -> Routable | None:
        """`prefer`: URLs to choose among first while one has room (round-robin, a baseline, ignores it)."""
        if not candidates:
            return None
        ordered = sorted(candidates, key=lambda b: b.url)
        self._turn += 1
        if self.mode == "round-robin":
            return ordered[self._turn % len(ordered)]
        bound = max(load_bound(sum(b.inflight for b in ordered), len(ordered), self.load_factor), self.load_floor)
        if prefer:
            # NOTE: the bound stays that of every candidate, so a preferred backend never takes more than any
            # backend may; among the preferred, the same walk (or least load) decides as among all.
            preferred = [b for b in ordered if b.url in prefer]
            if any(b.inflight + 1 <= bound for b in preferred):
                ordered = preferred
        if self.mode == "prefix" and key:
            by_id = {b.url: b for b in ordered}
            loads = {u: b.inflight for u, b in by_id.items()}
            chosen = first_with_room(self._ring(tuple(by_id)), key, loads, bound)
            assert chosen is not None  # the least loaded of all has room; of the preferred, one was seen to
            return by_id[chosen]
        # Least-loaded; ties rotate so equal backends share the work.
        least = min(b.inflight for b in ordered)
        tied = [b for b in ordered if b.inflight == least]
        return tied[self._turn % len(tied)]
