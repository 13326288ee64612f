"""LoRA on a loaded model (issue 26): its decoder projections wrapped in LoRALinear layers, and adapters loaded
into device slots as the scheduler asks (SchedulerOutput.lora_loads).

Sharded as the base layers are (distributed/layout.py): a column-parallel layer (the fused QKV, gate/up) holds
the rows of B for its output columns and all of A; a row-parallel one (o, down) holds the columns of A for its
input slice and all of B, so its delta B (A_r x_r) is a partial sum like its base output, and the all-reduce
after the layer adds both up: sum_r B A_r x_r = B A x. A pipeline stage holds its own layers' pairs. Every rank
reads an adapter's files itself (SchedulerOutput.lora_loads carries the path), so on several nodes the adapter
must be at the same path on each.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from ..core.lora_slots import LoRARef
from ..distributed.layout import RankShard
from ..model_config import ModelConfig
from .adapter import LoRAAdapter
from .layer import LoRALinear

log = logging.getLogger("sluice.engine")


def _layer_slices(sh: RankShard, mc: ModelConfig) -> dict[str, tuple[int, list[tuple[str, int, int]]]]:
    """Our fused projections on this rank: attribute path -> (in_features, [(HF projection, column offset,
    width)])."""
    q, kv, inter, hidden = sh.num_heads * mc.head_dim, sh.num_kv_heads * mc.head_dim, sh.intermediate, mc.hidden_size
    return {
        "self_attn.qkv_proj": (hidden, [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)]),
        "self_attn.o_proj": (q, [("o_proj", 0, hidden)]),
        "mlp.gate_up_proj": (hidden, [("gate_proj", 0, inter), ("up_proj", inter, inter)]),
        "mlp.down_proj": (inter, [("down_proj", 0, hidden)]),
    }


def shard_pair(sh: RankShard, mc: ModelConfig, proj: str, a: torch.Tensor,
               b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of a projection's (A [rank, in], B [out, rank]): B's rows of a column-parallel layer's
    output slice, A's columns of a row-parallel layer's input slice (the base layer's own slices)."""
    d = mc.head_dim
    heads = slice(sh.first_head * d, (sh.first_head + sh.num_heads) * d)
    inter = slice(sh.tp_rank * sh.intermediate, (sh.tp_rank + 1) * sh.intermediate)
    if proj == "q_proj":
        return a, b[heads]
    if proj in ("k_proj", "v_proj"):
        return a, b[sh.first_kv_head * d : (sh.first_kv_head + sh.num_kv_heads) * d]
    if proj in ("gate_proj", "up_proj"):
        return a, b[inter]
    if proj == "o_proj":
        return a[:, heads], b
    return a[:, inter], b  # down_proj


class LoRAModel:
    """The model's LoRA layers, and the adapters' weights on the host: every registered adapter, or with
    --max-cpu-loras the most recently used ones (a slot load of one that is not there reads its files again)."""

    def __init__(self, model: torch.nn.Module, mc: ModelConfig, shard: RankShard, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, max_cpu_loras: int | None = None):
        self.mc = mc
        self.shard = shard
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.host: OrderedDict[LoRARef, LoRAAdapter] = OrderedDict()  # least recently used first
        self.host_loads = 0  # adapters read from disk (registrations and re-reads)
        # (layer index in the whole model, HF projection) -> the LoRALinear that holds it on this rank
        self.layers: dict[tuple[int, str], LoRALinear] = {}
        for i, layer in enumerate(model.layers, start=shard.first_layer):
            for path, (fan_in, slices) in _layer_slices(shard, mc).items():
                owner_name, attr = path.split(".")
                owner = getattr(layer, owner_name)
                wrapped = LoRALinear(getattr(owner, attr), fan_in, slices, max_loras + 1, max_rank, dtype, device)
                setattr(owner, attr, wrapped)
                for proj, _, _ in slices:
                    self.layers[(i, proj)] = wrapped

    def register(self, ref: LoRARef) -> LoRAAdapter:
        """Read and check an adapter (AdapterError names what is wrong); it goes into a slot when a step first
        needs it."""
        adapter = self._read(ref)
        log.info("LoRA adapter %r: rank %d on %s (%s)", ref.name, adapter.rank, ", ".join(adapter.target_modules),
                 ref.path)
        return adapter

    def forget(self, ref: LoRARef) -> None:
        self.host.pop(ref, None)

    def _read(self, ref: LoRARef) -> LoRAAdapter:
        adapter = LoRAAdapter.load(ref.name, ref.path, self.mc, self.max_rank)
        self.host_loads += 1
        self.host[ref] = adapter
        while self.max_cpu_loras is not None and len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return adapter

    def load_slot(self, slot: int, ref: LoRARef) -> None:
        adapter = self.host.get(ref)
        if adapter is None:
            # Evicted from the host (--max-cpu-loras): its files again. They were checked at registration;
            # NOTE: files changed under a registered adapter fail this step (unload the adapter first).
            adapter = self._read(ref)
        else:
            self.host.move_to_end(ref)
        for (layer, proj), wrapped in self.layers.items():
            pair = adapter.weights.get((layer, proj))
            if pair is None:
                wrapped.set_slot(slot, proj, None, None)
            else:
                a, b = shard_pair(self.shard, self.mc, proj, *pair)
                wrapped.set_slot(slot, proj, a, b * adapter.scaling)
