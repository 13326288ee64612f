"""Attention over the paged KV cache with the Triton kernels in `triton_kernels.py` (the CUDA path).

On CPU the kernels run only in Triton's interpreter (TRITON_INTERPRET=1 set before this module is
imported): slow, and there for tests. Each step's launch (split count, tiles) comes from the fixed set in
attention/kernel_buckets.py, so warm-up can compile every variant before the server is ready. The backend keeps the
launches it has issued (`issued`): eager steps' and those captured into CUDA graphs, i.e. what is compiled;
warm-up reports that set rather than a prediction.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..forward_context import AttentionMetadata
from . import triton_kernels as tk
from .kernel_buckets import SPLIT_MAX_QUERY_LEN, AttentionLaunch, block_m_for, choose_attention_launch


class TritonPagedAttention:
    name = "triton"

    def __init__(self, device: torch.device, num_splits: int | None = None):
        """num_splits: a fixed split count (one of kernel_buckets.SPLIT_CHOICES) for short-query batches
        (tests); None chooses from the batch (kernel_buckets.choose_attention_launch)."""
        if device.type != "cuda" and not tk.INTERPRETER_READY:
            raise ValueError(
                f"--attention-backend triton on {device.type} runs only in Triton's interpreter: set "
                "TRITON_INTERPRET=1 in the environment before triton is first imported (slow; meant for "
                "tests), or use --attention-backend torch"
            )
        self.num_splits = num_splits
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else 1)
        # Every launch attend() has issued, eager or while a CUDA graph captured it: the variants compiled.
        # Written by the thread that runs the forward; read after warm-up.
        self.issued: set[AttentionLaunch] = set()

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                 kv_scale: torch.Tensor | None = None) -> None:
        tk.store_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping, kv_scale)

    def launch(self, meta: AttentionMetadata, group: int, num_kv_heads: int) -> AttentionLaunch:
        """The step's launch, chosen once per step (every layer has the same batch and heads)."""
        launch = meta.per_step.get("triton_launch")
        if launch is None:
            launch = self.choose(meta.max_query_len, meta.seq_lens_cpu, group, num_kv_heads)
            meta.per_step["triton_launch"] = launch
        return launch

    def choose(self, max_query_len: int, seq_lens: Sequence[int], group: int, num_kv_heads: int) -> AttentionLaunch:
        """The launch for a batch (max_query_len new tokens at most, contexts seq_lens after the step). The
        model runner asks it too, to pick the CUDA graph of a decode step: graph and eager steps agree."""
        if self.num_splits is not None and max_query_len <= SPLIT_MAX_QUERY_LEN:
            return AttentionLaunch(self.num_splits, block_m_for(max_query_len, group))
        return choose_attention_launch(max_query_len, seq_lens, group, num_kv_heads, self.num_sms)

    def attend(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float,
               kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        hkv = kv_cache.shape[3]
        group = q.shape[1] // hkv
        ws = meta.workspace
        if ws is not None:  # a captured graph's batch: its split count and buffers, fixed at capture
            t = q.shape[0]
            launch = AttentionLaunch(ws.num_splits, block_m_for(meta.max_query_len, group))
            self.issued.add(launch)
            return tk.paged_attention(
                q, kv_cache[0], kv_cache[1], meta.query_start_loc, meta.seq_lens, meta.block_tables,
                meta.max_query_len, scale, launch=launch, out=ws.out[:t], mid=(ws.mid_o[:t], ws.mid_lse[:t]),
                kv_scale=kv_scale,
            )
        launch = self.launch(meta, group, hkv)
        self.issued.add(launch)
        return tk.paged_attention(
            q, kv_cache[0], kv_cache[1], meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.max_query_len, scale, launch=launch, kv_scale=kv_scale,
        )
