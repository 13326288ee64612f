"""The decoder layers of a GGUF served in its own blocks on CPU, run as one C++ call per step
(cpu_kernels/ggml_decoder.cpp): the same kernels in the same order as `DecoderLayer` makes them one op at a time
through GgmlLayerOps, GgmlCpuAttention and GgufBlockLinear, so the same floats, without ~10 trips from Python into
C per layer (about a quarter of a batch-1 decode step of the bundled model).

`GgmlDecoderStack.build(model, lib)` returns None for a model it does not cover, which keeps the layer loop:
anything but the ggml ops and attention, a projection that is not a bias-free GgufBlockLinear (LoRA wraps them),
Q/K norms, tensor or pipeline parallelism. SLUICE_CPU_FUSED_DECODER=off keeps the loop too (comparisons).
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

from ..attention.ggml_cpu import KV_DTYPE, GgmlCpuAttention, step_plan
from ..cpu_kernels.quant import GgufBlockLinear
from ..forward_context import get_forward_context
from ..layer_ops.ggml_ops import GgmlLayerOps

log = logging.getLogger("sluice.engine")

_p = ctypes.c_void_p


class _Layer(ctypes.Structure):  # ggml_decoder.cpp SluiceGgmlLayer
    _fields_ = [("input_norm", _p), ("post_attention_norm", _p), ("qkv", _p), ("o", _p), ("gate_up", _p),
                ("down", _p), ("qkv_fmt", ctypes.c_int32), ("o_fmt", ctypes.c_int32), ("gate_up_fmt", ctypes.c_int32),
                ("down_fmt", ctypes.c_int32), ("k_cache", _p), ("v_cache", _p)]


class _Shape(ctypes.Structure):  # ggml_decoder.cpp SluiceGgmlShape
    _fields_ = [("hidden", ctypes.c_int32), ("heads", ctypes.c_int32), ("kv_heads", ctypes.c_int32),
                ("head_dim", ctypes.c_int32), ("intermediate", ctypes.c_int32), ("block_size", ctypes.c_int32),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


def enabled() -> bool:
    return os.environ.get("SLUICE_CPU_FUSED_DECODER", "on").lower() not in ("0", "off", "false", "no")


class GgmlDecoderStack:
    """Runs `layers` (a model's DecoderLayers) as one call: `(x, cos_sin) -> (last layer's output, residual)`,
    what LlamaForCausalLM's layer loop returns. Reads the step's attention metadata and KV caches from the
    forward context, as the layers do."""

    def __init__(self, layers, lib, max_tokens: int = 0):
        self._layers = layers
        self._lib = lib
        self._call = lib.sluice_ggml_decoder_layers
        first = layers[0]
        attn, mlp = first.self_attn, first.mlp
        self._shape = _Shape(first.input_layernorm.weight.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.intermediate, 0,
                             first.input_layernorm.eps, attn.scale)
        self._table = (_Layer * len(layers))()
        for row, layer in zip(self._table, layers, strict=True):
            a, m = layer.self_attn, layer.mlp
            row.input_norm = layer.input_layernorm.weight.data_ptr()
            row.post_attention_norm = layer.post_attention_layernorm.weight.data_ptr()
            for name, linear in (("qkv", a.qkv_proj), ("o", a.o_proj), ("gate_up", m.gate_up_proj),
                                 ("down", m.down_proj)):
                setattr(row, name, linear.packed.data_ptr())
                setattr(row, name + "_fmt", linear.gemm_code)
        self._caches_key = None  # the KV caches the table points at (set on first use, again if reallocated)
        # The steps' scratch, for the token budget, written once now: its pages are faulted in at start, not by the
        # first big prefill (~27 KB per token for the bundled model; a first touch costs ~0.1-5 ms/MB).
        per_token = lib.sluice_ggml_decoder_work_floats(ctypes.byref(self._shape))
        # (empty, then written: torch.zeros may hand back calloc's untouched pages)
        self._work = torch.empty(max_tokens * per_token, dtype=torch.float32).fill_(0.0) if max_tokens > 0 else None

    @classmethod
    def build(cls, model, lib, max_tokens: int = 0) -> GgmlDecoderStack | None:
        """The stack for `model`'s layers, or None where it does not cover them (see the module docstring)."""
        if lib is None or not hasattr(lib, "sluice_ggml_decoder_layers") or not enabled():
            return None
        layers = list(model.layers)
        shard = model.shard
        if not layers or shard.tp != 1 or shard.pp != 1 or not isinstance(model.ops, GgmlLayerOps):
            return None
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            if not isinstance(a.backend, GgmlCpuAttention) or a.q_norm is not None:
                return None
            linears = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
            if not all(type(lin) is GgufBlockLinear and lin.bias is None for lin in linears):
                return None
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if not all(w.dtype == torch.float32 and w.is_contiguous() for w in norms):
                return None
        log.info("CPU decoder: %d GGUF layers run as one C++ call per step", len(layers))
        return cls(layers, lib, max_tokens)

    def _bind_caches(self, caches: list[torch.Tensor], block_size: int) -> None:
        key = (id(caches), len(caches), caches[0].data_ptr() if caches else 0, block_size)
        if key == self._caches_key:
            return
        for row, layer in zip(self._table, self._layers, strict=True):
            cache = caches[layer.self_attn.cache_idx]
            assert cache.dtype == KV_DTYPE and cache.is_contiguous()
            row.k_cache, row.v_cache = cache[0].data_ptr(), cache[1].data_ptr()
        self._shape.block_size = block_size
        self._caches_key = key

    def __call__(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = get_forward_context()
        meta = ctx.attn
        caches = ctx.kv_caches
        self._bind_caches(caches, caches[0].shape[2])
        tables, seq_lens, query_start = step_plan(meta)
        t = x.shape[0]
        out = x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # the caller's x stays as it is
        stream = torch.empty_like(out)
        cos, sin = (c.contiguous() for c in cos_sin)
        slots = meta.slot_mapping.contiguous()
        self._call(ctypes.byref(self._table), len(self._layers), ctypes.byref(self._shape), out.data_ptr(),
                   stream.data_ptr(), t, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                   tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(), query_start.data_ptr(), meta.num_seqs,
                   torch.get_num_threads(), 0 if self._work is None else self._work.data_ptr(),
                   0 if self._work is None else self._work.numel())
        return out, stream
