"""Attention with llama.cpp's CPU arithmetic, bit for bit, over an fp16 paged KV cache
(cpu_kernels/ggml_attention.cpp): the backend of a GGUF served in its own quantized blocks on CPU.

Why: such a model quantizes every matmul's activations to 8 bits per block, as llama.cpp does, and that
rounding amplifies any difference in any op into different tokens wherever two were close (docs/BENCHMARKS.md,
"llama.cpp parity"). With this backend, layer_ops/ggml_ops.py and the quantized GEMM each rounding as llama.cpp
does, a GGUF gives the greedy answers it gives under llama-server. The cache is fp16, llama.cpp's default:
half the bytes of fp32, twice the tokens in the same budget. Its K rows are kept in GGUF's rotary-pair order
(the kernel's sums run in that order); nothing else reads this cache.

The engine selects it by itself (worker/model_runner.py) for a GGUF served in its blocks (--quantization auto on a
GGUF, q8_0, q4_0, q4_1) with the C++ CPU path; `--quantization none` keeps the fp32 path and its cache."""

from __future__ import annotations

import ctypes

import torch

from ..forward_context import AttentionMetadata

KV_DTYPE = torch.float16


class GgmlCpuAttention:
    name = "ggml"

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                 kv_scale: torch.Tensor | None = None) -> None:
        assert kv_cache.dtype == KV_DTYPE, "the ggml backend keeps an fp16 cache"
        t, h, d = k.shape
        if not t:
            return
        k, v = _rows(k), _rows(v)
        self._lib.sluice_ggml_write_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), kv_cache[0].data_ptr(),
                                       kv_cache[1].data_ptr(), meta.slot_mapping.data_ptr(), t, h, d,
                                       torch.get_num_threads())

    def attend(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float,
               kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        tables, seq_lens, query_start = step_plan(meta)
        t, heads, d = q.shape
        q = _rows(q)
        out = torch.empty(t, heads, d, dtype=torch.float32)
        if t:
            self._lib.sluice_ggml_attention(
                out.data_ptr(), heads * d, q.data_ptr(), q.stride(0), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
                tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(), query_start.data_ptr(), meta.num_seqs, heads,
                kv_cache.shape[3], d, kv_cache.shape[2], ctypes.c_float(scale), torch.get_num_threads())
        return out


def step_plan(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's view of the step's metadata (block tables, sequence lengths, query starts, contiguous), made
    once per step and shared by every layer (and by models/ggml_decoder.py's one-call layers)."""
    plan = meta.per_step.get("ggml_cpu")
    if plan is None:
        plan = meta.per_step["ggml_cpu"] = (meta.block_tables.contiguous(), meta.seq_lens.contiguous(),
                                            meta.query_start_loc.contiguous())
    return plan


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] fp32 with heads and dims contiguous within a row (rows may be apart: a view of qkv)."""
    x = x.float()
    t, h, d = x.shape
    if x.stride(2) != 1 or x.stride(1) != d:
        x = x.contiguous()
    return x
