"""Attention metadata for one forward pass, reachable from every attention layer without threading
it through each layer's signature (as nano-vllm's context and vLLM's forward_context do)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionWorkspace:
    """Preallocated outputs of short-query attention, so a captured CUDA graph allocates nothing in the
    attention wrapper, and the split count that graph was captured with (worker/cuda_graphs.py)."""

    num_splits: int
    out: torch.Tensor  # [T, Hq, D], the model's dtype; shared by every layer (each consumes it at once)
    mid_o: torch.Tensor  # [T, Hq, num_splits, D] float32: partial outputs of split-KV decoding
    mid_lse: torch.Tensor  # [T, Hq, num_splits] float32: their log-sum-exps


@dataclass(slots=True)
class AttentionMetadata:
    # Ragged batch: sequence i owns query rows query_start_loc[i]:query_start_loc[i+1].
    query_start_loc: torch.Tensor  # [B+1] int32, on device
    seq_lens: torch.Tensor  # [B] int32: context length after this step (cached + new tokens)
    block_tables: torch.Tensor  # [B, max_blocks] int32; padded with 0
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block_id * block_size + offset) per new token
    max_query_len: int
    max_seq_len: int
    # Host copies, so the CPU reference path does not sync with the device per sequence.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    # What a backend derives once per step from the fields above and reuses in every layer.
    per_step: dict = field(default_factory=dict)
    # Set only for a batch a CUDA graph captures: where attention writes, and its fixed split count.
    workspace: AttentionWorkspace | None = None

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], tables: list[list[int]], slots: list[int],
              block_size: int, device: torch.device) -> AttentionMetadata:
        """Metadata of a ragged batch: per sequence, its new tokens' count, its context length after
        the step and its block table; per new token, its cache slot."""
        max_blocks = max(len(t) for t in tables)
        query_start = [0]
        for n in query_lens:
            query_start.append(query_start[-1] + n)
        return cls(
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32,
                                      device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
            block_size=block_size,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass(slots=True)
class ForwardContext:
    attn: AttentionMetadata
    kv_caches: list[torch.Tensor]  # per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
    # The step's tokens by LoRA adapter slot (lora/ops.py LoRASegments); None or empty: every token on the base.
    lora: object | None = None


_context: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[None]:
    global _context
    prev, _context = _context, ctx
    try:
        yield
    finally:
        _context = prev


def get_forward_context() -> ForwardContext:
    if _context is None:
        raise RuntimeError("attention called outside a forward context")
    return _context
