"""The offload tier's index (issue 28; docs/architecture.md, "KV beyond one engine"): which evicted prefix blocks the
tier holds, by block name, in which of its slots, least recently used first.

The scheduler owns it, as it owns the device pool's bookkeeping: a cached block that the device pool evicts is
stored (`store`: a slot for its name, the tier's least recently used entry giving way when it is full), and a new
request's prefix continues in the tier after its device hits (`lookup`). The copies themselves ride in the step
(`SchedulerOutput.kv_stores`, `kv_loads`) and every rank's runner does them on its own shard of the KV
(worker/kv_tier.py). Entries a step loads are pinned until the step is taken (`take`), so a store later in the
same step never takes their slot: the runner stores before it loads.
"""

from __future__ import annotations

from collections import OrderedDict


class OffloadIndex:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.slots: OrderedDict[int, int] = OrderedDict()  # block name -> tier slot, least recently used first
        self._free = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()  # slots loaded by the step being scheduled
        self._stores: list[tuple[int, int]] = []  # (device block id, tier slot) for the next step that runs
        self._loads: list[tuple[int, int]] = []  # (tier slot, device block id)
        self._cleared = False
        # Statistics, in blocks (tokens = blocks x block size).
        self.stored = 0
        self.loaded = 0
        self.dropped = 0  # evicted blocks not stored: every slot pinned by this step
        self.received = 0  # blocks inserted from another engine

    def __len__(self) -> int:
        return len(self.slots)

    def lookup(self, names: list[int]) -> int:
        """How many of `names` (a request's next block names, in order) the tier holds from the first on."""
        n = 0
        for name in names:
            if name not in self.slots:
                break
            n += 1
        return n

    def load(self, name: int, block_id: int) -> None:
        """Copy the named entry into a device block with the step (an entry `lookup` found)."""
        slot = self.slots[name]
        self.slots.move_to_end(name)
        self._pinned.add(slot)
        self._loads.append((slot, block_id))
        self.loaded += 1

    def store(self, name: int, block_id: int) -> None:
        """A device block the pool is evicting, cached under `name`: saved into the tier with the step (before
        anything in the step overwrites it), unless the tier already holds that name."""
        slot = self._claim(name)
        if slot is not None:
            self._stores.append((block_id, slot))
            self.stored += 1

    def insert(self, name: int) -> int | None:
        """A slot for a block that arrives from elsewhere (another engine: kv_transfer/), its data written there
        by the caller before the next step; None when the tier holds the name already or every slot is pinned."""
        slot = self._claim(name)
        if slot is not None:
            self.received += 1
        return slot

    def _claim(self, name: int) -> int | None:
        """A slot for a new name: a free one, else the least recently used entry's (not one this step loads).
        None when the name is held already (now most recently used) or every slot is pinned (counted dropped)."""
        if name in self.slots:
            self.slots.move_to_end(name)
            return None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((k for k, s in self.slots.items() if s not in self._pinned), None)
            if victim is None:
                self.dropped += 1
                return None
            slot = self.slots.pop(victim)
        self.slots[name] = slot
        return slot

    def take(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The stores and loads for the step being emitted; their slots are no longer pinned after it."""
        stores, loads = self._stores, self._loads
        self._stores, self._loads = [], []
        if self._cleared:  # slots a clear() left pinned are free once their loads are done
            held = set(self.slots.values())
            self._free.extend(s for s in self._pinned if s not in held)
            self._cleared = False
        self._pinned.clear()
        return stores, loads

    def clear(self) -> None:
        """Forget every entry (a prefix-cache reset); copies already decided still go with the next step."""
        self.slots.clear()
        self._free = [s for s in range(self.num_slots - 1, -1, -1) if s not in self._pinned]
        self._cleared = True
