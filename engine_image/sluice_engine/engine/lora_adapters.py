"""The engine's LoRA bookkeeping, beside the engine rather than inside it: which adapters are served by name, those
unloaded while requests still run on them (dropped once the last of those ends), their ids, and their share of the
stats snapshot. The engine calls it at fixed points: a request added (`find`), a request finished (`settle`), a
snapshot (`stats`); the core loop and the adapter-list file load and unload through the engine.

What lives elsewhere: device slots and which adapters run (core/lora_slots.py, the scheduler's), and the weights
(the model runner's `lora`, lora/model.py), both told here when an adapter comes and goes.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Callable

from ..config import EngineConfig
from ..core.lora_slots import LoRABusy, LoRAError, LoRANotFound, LoRARef, LoRASlotTable
from ..sampling_params import InvalidParam

log = logging.getLogger("sluice.engine")


class LoRAAdapters:
    def __init__(self, slots: LoRASlotTable | None, scheduler, runner_lora, served_model_name: str,
                 on_change: Callable[[tuple[str, ...]], None]):
        """slots: None with LoRA off. runner_lora: the model runner's adapter weights (register/forget).
        on_change(names): the served names changed (the engine republishes its model info)."""
        self.slots = slots
        self._scheduler = scheduler
        self._weights = runner_lora
        self._base = served_model_name
        self._on_change = on_change
        self.served: dict[str, LoRARef] = {}
        self._unloading: dict[LoRARef, None] = {}
        self._ids = itertools.count(1)

    def find(self, name: str | None) -> LoRARef | None:
        """The adapter a request names (None: the base model); InvalidParam naming `model` if none is served."""
        if name is None:
            return None
        ref = self.served.get(name)
        if ref is None:
            known = ", ".join(sorted(self.served)) or "none (start with --enable-lora --lora-modules)"
            raise InvalidParam("model", f"no LoRA adapter {name!r}; adapters: {known}")
        return ref

    def load(self, name: str, path: str) -> LoRARef:
        """Serve the PEFT adapter in `path` as model `name` from now on. LoRAError (a ValueError) names what is
        wrong: LoRA off, the name taken, an adapter that does not fit the model."""
        if self.slots is None:
            raise LoRAError("LoRA adapters need --enable-lora", param=None)
        if not name or name == self._base:
            raise LoRAError(f"adapter name {name!r} is the base model's served name" if name
                            else "lora_name is empty")
        if name in self.served:
            raise LoRAError(f"LoRA adapter {name!r} is already loaded (from {self.served[name].path}); unload it "
                            "first")
        if any(ref.name == name for ref in self._unloading):
            raise LoRABusy(f"LoRA adapter {name!r} was unloaded and requests still run on it: load it again once "
                           "they finish")
        ref = LoRARef(name, next(self._ids), str(path))
        self._weights.register(ref)  # reads and checks it (AdapterError is a ValueError)
        self.served[name] = ref
        self._on_change(tuple(sorted(self.served)))
        return ref

    def unload(self, name: str) -> int:
        """Stop serving adapter `name`: new requests on it are refused from now on; those already on it run to
        their end, and it leaves its slot and the host once the last has (the count returned)."""
        ref = self.served.pop(name, None)
        if ref is None:
            raise LoRANotFound(f"no LoRA adapter {name!r} is loaded"
                               + (f"; adapters: {', '.join(sorted(self.served))}" if self.served else ""))
        self._unloading[ref] = None
        self._on_change(tuple(sorted(self.served)))
        return self._drop_unloaded().get(ref, 0)

    def settle(self, ref: LoRARef | None) -> None:
        """A request on `ref` has finished: an unloaded adapter it was the last user of goes."""
        if ref is not None and ref in self._unloading:
            self._drop_unloaded()

    def _drop_unloaded(self) -> dict[LoRARef, int]:
        """Drop the unloaded adapters no unfinished request uses; how many still use each of the others."""
        users = Counter(r.lora for r in self._scheduler.requests.values() if r.lora in self._unloading
                        and not r.is_finished)
        for ref in [ref for ref in self._unloading if not users[ref]]:
            del self._unloading[ref]
            self._scheduler.forget_lora(ref)
            self._weights.forget(ref)  # rank 0's copy now; the other ranks' with the next step
            log.info("LoRA adapter %r unloaded", ref.name)
        return users

    def stats(self, metrics) -> dict:
        """The stats snapshot's LoRA fields (metrics.py StatsSnapshot); none with LoRA off."""
        if self.slots is None:
            return {}
        m = metrics
        return dict(max_lora=self.slots.max_loras,
                    lora_running=tuple(sorted(self.slots.running_adapters)),  # each pins a slot
                    lora_waiting=tuple(sorted({r.lora.name for r in self._scheduler.waiting if r.lora is not None})),
                    lora_prompt_tokens=dict(m.lora_prompt_tokens), lora_generation_tokens=dict(m.lora_generation_tokens),
                    lora_requests=dict(m.lora_requests), lora_goodput=dict(m.lora_goodput))


def check_lora_config(cfg: EngineConfig, served_model_name: str) -> list[tuple[str, str]]:
    """The adapters of --lora-modules (name, path), refused with a reason where they cannot work."""
    if not cfg.enable_lora:
        if cfg.lora_modules:
            raise ValueError("--lora-modules needs --enable-lora")
        if cfg.lora_modules_file:
            raise ValueError("--lora-modules-file needs --enable-lora")
        return []
    if cfg.max_loras < 1 or cfg.max_lora_rank < 1:
        raise ValueError("--max-loras and --max-lora-rank must be at least 1")
    if cfg.max_cpu_loras is not None and cfg.max_cpu_loras < cfg.max_loras:
        raise ValueError(f"--max-cpu-loras ({cfg.max_cpu_loras}) must be at least --max-loras ({cfg.max_loras})")
    modules: list[tuple[str, str]] = []
    for spec in cfg.lora_modules:
        name, eq, path = spec.partition("=")
        if not eq or not name or not path:
            raise ValueError(f"--lora-modules takes name=path, not {spec!r}")
        if name == served_model_name:
            raise ValueError(f"--lora-modules: adapter name {name!r} is the base model's served name")
        if any(name == n for n, _ in modules):
            raise ValueError(f"--lora-modules: adapter name {name!r} given twice")
        modules.append((name, path))
    return modules
