"""How much memory the KV cache gets: pure arithmetic over measured figures (no torch, no device), so
every case, from an 8B target with a 1B draft on an H200 to a 100 MB model on a small card, is tested
offline. worker/memory_profile.py measures the figures; this module turns them into a number of blocks.

On a device (CUDA without --kv-cache-memory) one sum must stay within `total x --gpu-memory-utilization`:

    used by others      other processes, this process's CUDA context, non-torch buffers, allocator slack
  + weights             target + draft: every tensor the engine holds before the KV cache exists
  + activation peak     the larger of one target step and one draft step (they never run at once)
  + CUDA-graph pool     memory captured graphs keep for themselves and the scratch KV block (an estimate: worker/memory_profile.py)
  + KV cache            target + draft

The draft model needs a cache slot for every token the target's cache holds (it shadows the same
requests), so both caches hold the same number of tokens. They share the block size, so they get the
same number of blocks, and the KV budget splits between them in proportion to their bytes per token.

With --kv-cache-memory (any device), or on CPU without it (1 GiB), the KV budget is that number and
the target and draft caches come out of it together.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30

# The flags that move the figures, named in every refusal.
_ADVICE = ("raise --gpu-memory-utilization, lower --max-num-batched-tokens (or --max-num-seqs) to shrink "
           "the activations, or set --kv-cache-memory")


class InsufficientMemory(ValueError):
    """Not even one KV block fits what is left: the engine cannot start."""


@dataclass(frozen=True, slots=True)
class KVShape:
    """What one token costs in each cache, on this rank."""

    bytes_per_token: int  # target
    draft_bytes_per_token: int = 0  # 0: no draft model
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.bytes_per_token < 1 or self.draft_bytes_per_token < 0 or self.block_size < 1:
            raise ValueError(f"bad KV shape {self}")

    @property
    def has_draft(self) -> bool:
        return self.draft_bytes_per_token > 0

    @property
    def bytes_per_block(self) -> int:
        """One block in each cache: what one more block of capacity costs."""
        return (self.bytes_per_token + self.draft_bytes_per_token) * self.block_size


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """The figures measured on the device, in bytes (memory_profile.measure_device_memory)."""

    total: int
    utilization: float  # --gpu-memory-utilization
    used_by_others: int
    weights: int
    activation_peak: int  # of one target step at the largest token budget
    draft_weights: int = 0
    draft_activation_peak: int = 0  # of one draft forward at the largest token budget
    # The decode CUDA graphs' pool and the scratch KV block (memory_profile.cuda_graph_pool_bytes): an estimate.
    cuda_graph_pool: int = 0

    @property
    def limit(self) -> int:
        return int(self.total * self.utilization)

    @property
    def activations(self) -> int:
        # The draft proposes, then the target runs its step: one stream, one after the other, so the
        # caching allocator reuses the same memory for both (and frees cached blocks before it fails).
        return max(self.activation_peak, self.draft_activation_peak)

    @property
    def kv_budget(self) -> int:
        """What is left for the two caches (negative when even the rest does not fit)."""
        return (self.limit - self.used_by_others - self.weights - self.draft_weights - self.activations
                - self.cuda_graph_pool)


@dataclass(frozen=True, slots=True)
class KVPlan:
    """The number of blocks of each cache and the line that says why (logged at start-up)."""

    num_blocks: int  # of the target's cache
    draft_num_blocks: int  # of the draft's cache: num_blocks with a draft, else 0
    kv: KVShape
    summary: str

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.kv.block_size

    @property
    def target_bytes(self) -> int:
        return self.num_blocks * self.kv.block_size * self.kv.bytes_per_token

    @property
    def draft_bytes(self) -> int:
        return self.draft_num_blocks * self.kv.block_size * self.kv.draft_bytes_per_token


def fixed_kv_budget(device_type: str, kv_cache_memory: int | None) -> tuple[int, str] | None:
    """(bytes, where they come from) when the KV budget is a set number rather than what the device
    leaves: --kv-cache-memory on every device, 1 GiB on CPU without it. None: measure (CUDA)."""
    if kv_cache_memory is not None:
        return kv_cache_memory, "--kv-cache-memory"
    if device_type != "cuda":
        return DEFAULT_CPU_KV_CACHE_BYTES, "the CPU default"
    return None


def plan_from_device(mem: DeviceMemory, kv: KVShape) -> KVPlan:
    """The most blocks (the same number in each cache) whose bytes fit what the device leaves."""
    head = (f"memory: total {fmt_bytes(mem.total)} x {mem.utilization:.2f} = {fmt_bytes(mem.limit)}; "
            f"others {fmt_bytes(mem.used_by_others)}; "
            f"{_weights(mem.weights, mem.draft_weights, kv.has_draft)}; "
            f"{_activations(mem.activation_peak, mem.draft_activation_peak, kv.has_draft)}; "
            f"graphs {fmt_bytes(mem.cuda_graph_pool)}")
    budget = mem.kv_budget
    if budget < kv.bytes_per_block:
        raise InsufficientMemory(
            f"no room for the KV cache: {head}; leaves {fmt_bytes(budget)}, less than one block "
            f"({fmt_bytes(kv.bytes_per_block)}{' for target + draft' if kv.has_draft else ''}); {_ADVICE}")
    return _plan(budget // kv.bytes_per_block, kv, head)


def plan_from_budget(kv_budget: int, source: str, kv: KVShape, *, weights: int, draft_weights: int = 0,
                     activation_peak: int | None = None, draft_activation_peak: int = 0) -> KVPlan:
    """The most blocks (the same number in each cache) within a set KV budget. Weights and the
    activation peak (None: not profiled) only go into the summary: they do not move the budget."""
    acts = ("activations not profiled" if activation_peak is None
            else _activations(activation_peak, draft_activation_peak, kv.has_draft))
    head = (f"memory: KV budget {fmt_bytes(kv_budget)} ({source}); "
            f"{_weights(weights, draft_weights, kv.has_draft)}; {acts}")
    if kv_budget < kv.bytes_per_block:
        raise InsufficientMemory(
            f"KV cache budget of {kv_budget} bytes ({source}) is less than one block "
            f"({kv.bytes_per_block} bytes{' for target + draft' if kv.has_draft else ''}); raise --kv-cache-memory")
    return _plan(kv_budget // kv.bytes_per_block, kv, head)


def _plan(num_blocks: int, kv: KVShape, head: str) -> KVPlan:
    caches = f"{num_blocks} blocks (target)" + (f" + {num_blocks} blocks (draft)" if kv.has_draft else "")
    summary = (f"{head}; KV {fmt_bytes(num_blocks * kv.bytes_per_block)} = {caches} "
               f"= {num_blocks * kv.block_size} tokens")
    return KVPlan(num_blocks, num_blocks if kv.has_draft else 0, kv, summary)


def _weights(target: int, draft: int, has_draft: bool) -> str:
    return f"weights {fmt_bytes(target)}" + (f" (+draft {fmt_bytes(draft)})" if has_draft else "")


def _activations(target: int, draft: int, has_draft: bool) -> str:
    return f"activations peak {fmt_bytes(target)}" + (f" (draft {fmt_bytes(draft)})" if has_draft else "")


def fmt_bytes(n: int) -> str:
    """GiB from 1 GiB up, MiB below: a start-up log line, not an accounting record."""
    if abs(n) >= 1 << 30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB"
