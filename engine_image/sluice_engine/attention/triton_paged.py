"""Attention over the paged KV cache with the Triton kernels in `triton_kernels.py` (the CUDA path).

On CPU the kernels run only in Triton's interpreter (TRITON_INTERPRET=1 set before this module is
imported): slow, and there for tests.
"""

from __future__ import annotations

import torch
import triton

from ..forward_context import AttentionMetadata
from . import triton_kernels as tk

# Flash-decoding: split a sequence's keys across programs only when the batch alone leaves SMs idle,
# and never into chunks shorter than this (each split costs a partial output and a merge).
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 32
# Only batches of short queries split (decode, speculative verification): a prefill tile already has
# work enough, and partial outputs cost T x Hq x splits x D floats.
SPLIT_MAX_QUERY_LEN = 16


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many programs share one (sequence, KV head)'s key range: about two waves over the SMs."""
    want = triton.cdiv(2 * num_sms, num_seqs * num_kv_heads)
    most = triton.cdiv(max_seq_len, MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, most, MAX_SPLITS))


class TritonPagedAttention:
    name = "triton"

    def __init__(self, device: torch.device, num_splits: int | None = None):
        """num_splits: a fixed split count for short-query batches (tests); None chooses from the shapes."""
        if device.type != "cuda" and not tk.INTERPRETER_READY:
            raise ValueError(
                f"--attention-backend triton on {device.type} runs only in Triton's interpreter: set "
                "TRITON_INTERPRET=1 in the environment before triton is first imported (slow; meant for "
                "tests), or use --attention-backend torch"
            )
        self.num_splits = num_splits
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else 1)

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        tk.store_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)

    def attend(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        ws = meta.workspace
        if ws is not None:  # a captured graph's batch: its split count and buffers, fixed at capture
            t = q.shape[0]
            return tk.paged_attention(
                q, kv_cache[0], kv_cache[1], meta.query_start_loc, meta.seq_lens, meta.block_tables,
                meta.max_query_len, scale, num_splits=ws.num_splits, out=ws.out[:t],
                mid=(ws.mid_o[:t], ws.mid_lse[:t]),
            )
        splits = 1
        if meta.max_query_len <= SPLIT_MAX_QUERY_LEN:
            splits = self.num_splits or choose_num_splits(meta.num_seqs, kv_cache.shape[3], meta.max_seq_len,
                                                          self.num_sms)
        return tk.paged_attention(
            q, kv_cache[0], kv_cache[1], meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.max_query_len, scale, num_splits=splits,
        )
