"""Which LoRA adapter sits in which device slot (issue 26): host bookkeeping for the scheduler.

The model runner holds `max_loras` slots of adapter weights (slot 0 = no adapter). A request on an adapter is
admitted only when its adapter has a slot: the one it already sits in, a free one, or one whose adapter no
running request uses (least recently used first), which is then reloaded. The step that needs a reload says so
(`SchedulerOutput.lora_loads`), so every rank loads it before that step's forward. Slots in use are pinned by
reference counts, so no step ever holds more distinct adapters than there are slots.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


class LoRAError(ValueError):
    """A LoRA adapter cannot be loaded (a 400 at the API): the message says why, `param` the request field."""

    def __init__(self, message: str, param: str | None = "lora_name"):
        super().__init__(message)
        self.param = param


class LoRABusy(LoRAError):
    """The name is of an adapter unloaded while requests still run on it: it can be loaded again once they end."""


class LoRANotFound(LookupError):
    """No adapter of that name is loaded (a 404 at the API)."""


@dataclass(frozen=True, slots=True)
class LoRARef:
    """One registration of an adapter: its served name, an id no other registration in this engine has (a name
    unloaded and loaded again from other files is another adapter: its KV and its slot are not the old one's),
    and the directory every rank reads its weights from."""

    name: str
    id: int
    path: str


class LoRASlotTable:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self._slot_of: OrderedDict[LoRARef, int] = OrderedDict()  # resident adapters, least recently used first
        self._users: dict[LoRARef, int] = {}  # running requests per adapter
        self._free = list(range(max_loras, 0, -1))  # slots 1..max_loras, never used yet
        self.loads = 0  # adapters loaded into a slot (a swap counts)

    def slot(self, name: LoRARef | None) -> int:
        return 0 if name is None else self._slot_of[name]

    def acquire(self, name: LoRARef | None, loads: list[tuple[int, LoRARef]]) -> int | None:
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

    def release(self, name: LoRARef | None) -> None:
        if name is None:
            return
        left = self._users.get(name, 0) - 1
        if left > 0:
            self._users[name] = left
        else:
            self._users.pop(name, None)

    def forget(self, name: LoRARef) -> None:
        """An adapter unloaded from the server: its slot is free again (no running request may use it)."""
        assert not self._users.get(name), f"adapter {name} is in use"
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            self._free.append(slot)

    @property
    def running_adapters(self) -> list[str]:
        return [ref.name for ref, k in self._users.items() if k]

    @property
    def resident(self) -> list[str]:
        """The adapters in a slot now, least recently used first."""
        return [ref.name for ref in self._slot_of]
