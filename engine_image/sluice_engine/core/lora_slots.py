"""Which LoRA adapter sits in which device slot (issue 26): host bookkeeping for the scheduler.

The model runner holds `max_loras` slots of adapter weights (slot 0 = no adapter). A request on an adapter is
admitted only when its adapter has a slot: the one it already sits in, a free one, or one whose adapter no
running request uses (least recently used first), which is then reloaded. The step that needs a reload says so
(`SchedulerOutput.lora_loads`), so every rank loads it before that step's forward. Slots in use are pinned by
reference counts, so no step ever holds more distinct adapters than there are slots.
"""

from __future__ import annotations

from collections import OrderedDict


class LoRASlotTable:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # resident adapters, least recently used first
        self._users: dict[str, int] = {}  # running requests per adapter
        self._free = list(range(max_loras, 0, -1))  # slots 1..max_loras, never used yet
        self.loads = 0  # adapters loaded into a slot (a swap counts)

    def slot(self, name: str | None) -> int:
        return 0 if name is None else self._slot_of[name]

    def acquire(self, name: str | None, loads: list[tuple[int, str]]) -> int | None:
        """A slot for a request on `name` (0: no adapter), pinned until release(); None when every slot is
        pinned by other adapters. A (slot, name) to load is appended to `loads`."""
        if name is None:
            return 0
        slot = self._slot_of.get(name)
        if slot is None:
            if self._free:
                slot = self._free.pop()
            else:
                victim = next((n for n in self._slot_of if not self._users.get(n)), None)
                if victim is None:
                    return None
                slot = self._slot_of.pop(victim)
            self._slot_of[name] = slot
            loads.append((slot, name))
            self.loads += 1
        self._slot_of.move_to_end(name)
        self._users[name] = self._users.get(name, 0) + 1
        return slot

    def release(self, name: str | None) -> None:
        if name is None:
            return
        left = self._users.get(name, 0) - 1
        if left > 0:
            self._users[name] = left
        else:
            self._users.pop(name, None)

    def forget(self, name: str) -> None:
        """An adapter unloaded from the server: its slot is free again (no running request may use it)."""
        assert not self._users.get(name), f"adapter {name} is in use"
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            self._free.append(slot)

    @property
    def running_adapters(self) -> list[str]:
        return [n for n, k in self._users.items() if k]
