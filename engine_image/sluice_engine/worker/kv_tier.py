"""The KV offload tier's memory on one rank (issue 28; docs/architecture.md, "KV beyond one engine"): a second pool
of KV blocks, laid out as the paged cache's ([2, slots, block_size, kv_heads, head_dim] per layer of this rank,
the cache's dtype), that the step's stores and loads copy to and from (`SchedulerOutput.kv_stores`/`kv_loads`;
which block goes where is the scheduler's index, core/kv_offload.py).

On CPU the tier is another host allocation (mapped lazily, like the cache: resident once used) and a move is an
index copy per layer. On a GPU it is pinned host memory and each block is one asynchronous copy on the step's
stream, so the host does not wait for the device: copies and forward run in stream order (stores before loads,
loads before the forward that reads them, a later step's store after an earlier step's load of the same slot).
"""

from __future__ import annotations

import time

import torch

from .host_memory import lazy_zeros


class KVTier:
    def __init__(self, num_slots: int, caches: list[torch.Tensor]):
        self.num_slots = num_slots
        self.on_device = caches[0].device.type != "cpu"
        shape = (2, num_slots, *caches[0].shape[2:])
        dtype = caches[0].dtype
        if self.on_device:
            self.layers = [torch.empty(shape, dtype=dtype, pin_memory=True) for _ in caches]
        else:
            self.layers = [lazy_zeros(shape, dtype) for _ in caches]
        self.bytes_per_slot = sum(t[:, 0].numel() * t.element_size() for t in self.layers)
        # Host time spent issuing the copies (on CPU: doing them), for the metrics.
        self.store_seconds = 0.0
        self.load_seconds = 0.0

    @property
    def nbytes(self) -> int:
        return self.bytes_per_slot * self.num_slots

    def move(self, caches: list[torch.Tensor], stores: list[tuple[int, int]], loads: list[tuple[int, int]]) -> None:
        """Stores (device block -> tier slot), then loads (tier slot -> device block), on every layer."""
        if stores:
            t = time.perf_counter()
            self._copy(caches, stores, to_tier=True)
            self.store_seconds += time.perf_counter() - t
        if loads:
            t = time.perf_counter()
            self._copy(caches, loads, to_tier=False)
            self.load_seconds += time.perf_counter() - t

    def write(self, slots: list[int], data: torch.Tensor) -> None:
        """Blocks from elsewhere into tier slots: data [len(slots), layers, 2, block_size, kv_heads, head_dim]."""
        idx = torch.tensor(slots, dtype=torch.long)
        for layer, tier in enumerate(self.layers):
            part = data[:, layer].transpose(0, 1)  # [2, n, block_size, kv_heads, head_dim]
            if tier.dtype == torch.float8_e4m3fn:
                tier, part = tier.view(torch.uint8), part.contiguous().view(torch.uint8)
            tier.index_copy_(1, idx, part.to(tier.device))

    def _copy(self, caches: list[torch.Tensor], pairs: list[tuple[int, int]], to_tier: bool) -> None:
        for cache, tier in zip(caches, self.layers, strict=True):
            if cache.dtype == torch.float8_e4m3fn:  # index and copy ops take no float8: move the bytes
                cache, tier = cache.view(torch.uint8), tier.view(torch.uint8)
            if self.on_device:
                for a, b in pairs:
                    if to_tier:
                        tier[:, b].copy_(cache[:, a], non_blocking=True)
                    else:
                        cache[:, b].copy_(tier[:, a], non_blocking=True)
                continue
            src = torch.tensor([a for a, _ in pairs], dtype=torch.long)
            dst = torch.tensor([b for _, b in pairs], dtype=torch.long)
            if to_tier:
                tier.index_copy_(1, dst, cache.index_select(1, src))
            else:
                cache.index_copy_(1, dst, tier.index_select(1, src))
