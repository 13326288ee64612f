"""Attention over the paged KV cache on CPU with the C++ kernel (cpu_kernels/paged_attention.cpp) for
short queries -- decode and speculative verification, most of a busy server's attention time -- and
the torch reference for prompt chunks, where SDPA's blocked matmuls are the better tool.

Why a kernel: the torch path copies every decoding sequence's blocks into a padded batch before SDPA
reads them (the K/V bytes cross memory three times, and padding adds more); at batch 32 that gather and
SDPA were a third of a decode step. The kernel reads each sequence's keys and values once, in place."""

from __future__ import annotations

import ctypes

import torch

from ..forward_context import AttentionMetadata
from .torch_paged import SHORT_QUERY_LEN, TorchPagedAttention, long_query

_KERNELS = {torch.float32: "sluice_paged_attention_f32", torch.bfloat16: "sluice_paged_attention_bf16"}


class CpuPagedAttention(TorchPagedAttention):
    name = "cpu"

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib

    def attend(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float,
               kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        # NOTE: an FP8 cache never gets here (the engine refuses --kv-cache-dtype fp8 with this backend); one
        # would take the torch path below, whose dtype test it fails.
        if (q.dtype not in _KERNELS or kv_cache.dtype != q.dtype
                or not self._lib.sluice_paged_attention_supports_head_dim(q.shape[2])):
            return super().attend(q, k, v, kv_cache, meta, scale, kv_scale)
        plan = meta.per_step.get("cpu_paged")
        if plan is None:  # once per step, shared by every layer
            starts = [0]
            for n in meta.query_lens_cpu:
                starts.append(starts[-1] + n)
            long = [i for i, n in enumerate(meta.query_lens_cpu) if n > SHORT_QUERY_LEN]
            plan = meta.per_step["cpu_paged"] = (starts, long, meta.block_tables.contiguous(),
                                                 meta.seq_lens.contiguous(), meta.query_start_loc.contiguous())
        starts, long, tables, seq_lens, query_start = plan
        if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if len(long) < meta.num_seqs:
            _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
            getattr(self._lib, _KERNELS[q.dtype])(
                out.data_ptr(), out.stride(0), q.data_ptr(), q.stride(0), kv_cache[0].data_ptr(),
                kv_cache[1].data_ptr(), tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(),
                query_start.data_ptr(), meta.num_seqs, q.shape[1], num_kv_heads, head_dim, block_size,
                SHORT_QUERY_LEN, scale, torch.get_num_threads(),
            )
        for i in long:
            out[starts[i] : starts[i + 1]] = long_query(q, k, v, kv_cache, meta, i, starts[i], starts[i + 1], scale)
        return out
