"""Decoder projections held in a GPU quantization format (fp8, awq, gptq; sluice_engine/quant/), served by the
Triton kernels of quant/triton_gemm.py: `--quantization fp8|awq|gptq`, or auto on a checkpoint whose config.json
has a quantization_config.

A quantized checkpoint: every decoder projection the checkpoint holds packed (q/k/v/o, gate/up/down; AWQ and
GPTQ `qweight`/`qzeros`/`scales`[/`g_idx`], FP8 `weight` e4m3 + `weight_scale`) becomes a QuantLinear, built
here from the packed tensors *before* the model is constructed (LlamaForCausalLM's `linear` factory picks
them up), so no dense copy of a quantized layer is ever allocated. Projections a checkpoint keeps dense
(modules_to_not_convert, ignored_layers), the embeddings, norms and the output layer stay dense and are
loaded by models/loader.py, which skips the tensors of the layers built here.

Fused projections: the model runs q/k/v as one qkv_proj and gate/up as one gate_up_proj. Their quantized
parts are concatenated along the output dimension where that is exact, which is everywhere but one case:
- AWQ: qweight/qzeros pack 8 output columns per int32 along N and each part's N is a multiple of 8 (its own
  packing needs it); scales are per column; groups run along K, which the parts share. Exact.
- GPTQ: qweight packs along K (whole columns), scales per column, qzeros 8 columns per int32. Exact when
  the parts share one g_idx: always without act-order, and with it when the parts were quantized from the
  same input (the order comes from the input's Hessian, as for q/k/v and gate/up). Parts whose g_idx differ
  run as separate kernel calls side by side (quant/linear.py ConcatQuantLinear).
- FP8: weights stack by rows; per-channel scales concatenate; per-tensor scales that differ between the
  parts become per-channel (each part's scale over its rows; the e4m3 values are unchanged, nothing is
  requantized), equal ones stay one scale. Exact.

Tensor and pipeline parallelism: each rank builds its shard as the dense loader does: qkv_proj and
gate_up_proj split along N (this rank's heads and intermediate columns; AWQ/GPTQ need the split at multiples
of 8), o_proj and down_proj along K (AWQ: at multiples of the group size, refused otherwise; GPTQ: at
multiples of 8, and where the split does not fall on group boundaries the slice keeps every group's scales
and an explicit g_idx picks them); a pipeline stage builds only its layers.

`--quantization fp8` on a dense checkpoint quantizes the loaded weights at start-up (`quantize_fp8_linears`):
per-output-channel absmax scales, e4m3 values (dynamic weight quantization; the dense weights are on the
device until each layer is replaced, so the peak is the dense model's).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from ..distributed.layout import RankShard
from ..model_config import ModelConfig
from ..quant.checkpoint import QuantCheckpoint
from ..quant.fp8 import Fp8Weights, quantize_fp8
from ..quant.linear import ConcatQuantLinear, QuantLinear
from ..quant.registry import weights_class
from .llama import LlamaForCausalLM, dense_linear

log = logging.getLogger("sluice.engine")

# A checkpoint module is quantized when it holds this tensor.
_MARKER = {"awq": "qweight", "gptq": "qweight", "fp8": "weight_scale"}
# Tensors of quantized checkpoints that serving weight-only does not use (static activation scales, FP8
# KV-cache scales): the dense loader passes over them.
AUX_TENSORS = ("input_scale", "output_scale", "k_scale", "v_scale", "kv_scale")
QUANT_MODULES = (QuantLinear, ConcatQuantLinear)


def _parts(module: str, mc: ModelConfig, sh: RankShard) -> tuple[list[tuple[str, int, int]], str]:
    """The checkpoint modules a model projection is made of, each with this rank's [start, end) along the
    axis the projection is split on ("out" for column-parallel, "in" for row-parallel)."""
    d = mc.head_dim
    heads = (sh.first_head * d, (sh.first_head + sh.num_heads) * d)
    kv = (sh.first_kv_head * d, (sh.first_kv_head + sh.num_kv_heads) * d)
    inter = (sh.tp_rank * sh.intermediate, (sh.tp_rank + 1) * sh.intermediate)
    return {
        "self_attn.qkv_proj": ([("self_attn.q_proj", *heads), ("self_attn.k_proj", *kv),
                                ("self_attn.v_proj", *kv)], "out"),
        "self_attn.o_proj": ([("self_attn.o_proj", *heads)], "in"),
        "mlp.gate_up_proj": ([("mlp.gate_proj", *inter), ("mlp.up_proj", *inter)], "out"),
        "mlp.down_proj": ([("mlp.down_proj", *inter)], "in"),
    }[module]


def require_kernels(method: str) -> None:
    """The Triton GEMM kernels import (triton is there), or ValueError at start-up rather than at the first step."""
    try:
        from ..quant import triton_gemm  # noqa: F401
    except ImportError as e:
        raise ValueError(f"--quantization {method}: the Triton kernels need the triton package ({e})") from e


class QuantLinears:
    """The decoder projections of one rank's shard of a quantized checkpoint, built up front; called as the
    model's `linear` factory, it hands each out (a dense nn.Linear for those the checkpoint keeps dense)."""

    def __init__(self, model_dir: Path, mc: ModelConfig, shard: RankShard, dtype: torch.dtype,
                 device: torch.device):
        self.ckpt = ckpt = QuantCheckpoint(model_dir)  # the tensors stay on CPU until a layer is built
        self.method = ckpt.method
        require_kernels(self.method)
        self.mc, self.shard, self.dtype, self.device = mc, shard, dtype, device
        self.modules: dict[str, nn.Module] = {}
        self.counts = {"concatenated": 0, "side by side": 0, "dense": 0}
        for local in range(shard.num_layers):
            for module in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
                built = self._build(shard.first_layer + local, module)
                if built is not None:
                    self.modules[f"layers.{local}.{module}"] = built.to(device)

    def _build(self, layer: int, module: str) -> nn.Module | None:
        parts, axis = _parts(module, self.mc, self.shard)
        prefixes = [f"model.layers.{layer}.{name}." for name, _, _ in parts]
        quantized = [self.ckpt.has(p + _MARKER[self.method]) for p in prefixes]
        if not any(quantized):
            self.counts["dense"] += 1
            return None  # a layer the checkpoint keeps dense: nn.Linear, loaded by models/loader.py
        if not all(quantized):
            raise ValueError(f"{self.ckpt.model_dir}: layer {layer}: {', '.join(prefixes)} are fused into one "
                             f"projection but only some of them are {self.method}-quantized")
        cls = weights_class(self.method)
        weights, biases = [], []
        for prefix, (_, start, end) in zip(prefixes, parts, strict=True):
            w = self.ckpt.linear(prefix)
            n, k = w.shape
            full = n if axis == "out" else k
            try:
                if (start, end) != (0, full):
                    w = w.narrow_out(start, end) if axis == "out" else w.narrow_in(start, end)
            except ValueError as e:
                sh = self.shard
                raise ValueError(f"--quantization {self.method} with --tensor-parallel-size {sh.tp}: {prefix}: "
                                 f"{e}") from e
            weights.append(w)
            b = self.ckpt.get(prefix + "bias")
            biases.append(None if b is None else (b[start:end] if axis == "out" else b))
        bias = None
        if any(b is not None for b in biases):
            if axis == "in" or not all(b is not None for b in biases):
                raise ValueError(f"{self.ckpt.model_dir}: layer {layer} {module}: a bias on only some parts, or "
                                 "on a row-parallel projection, is not supported")
            bias = torch.cat(biases).to(self.dtype)
        fused = weights[0] if len(weights) == 1 else cls.cat_out(weights)
        if fused is not None:
            self.counts["concatenated"] += 1
            return QuantLinear(fused, bias)
        self.counts["side by side"] += 1
        sizes = [w.shape[0] for w in weights]
        part_biases = [None] * len(weights) if bias is None else list(bias.split(sizes))
        return ConcatQuantLinear([QuantLinear(w, b) for w, b in zip(weights, part_biases, strict=True)])

    def __call__(self, name: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
        module = self.modules.pop(name, None)
        if module is None:
            return dense_linear(name, in_features, out_features, bias)
        if (module.in_features, module.out_features) != (in_features, out_features):
            raise ValueError(f"{name}: the checkpoint's {self.method} layer is {module.out_features}x"
                             f"{module.in_features}, the model's {out_features}x{in_features}")
        if bias != (_bias(module) is not None):
            raise ValueError(f"{name}: the model {'has' if bias else 'has no'} bias here, the checkpoint "
                             f"{'does not' if bias else 'does'}")
        return module

    def finish(self) -> None:
        """Log what was built; every built layer must have been taken by the model."""
        if self.modules:
            raise ValueError(f"the model did not take the quantized layers {sorted(self.modules)[:3]}")
        c = self.counts
        log.info("decoder projections from the %s checkpoint: %d quantized (%d of them fused parts run side by "
                 "side), %d dense", self.method, c["concatenated"] + c["side by side"], c["side by side"],
                 c["dense"])


def _bias(module: nn.Module) -> torch.Tensor | None:
    if isinstance(module, ConcatQuantLinear):
        return module.parts[0].bias
    return module.bias


def quantized_module_names(model: nn.Module) -> set[str]:
    return {name for name, m in model.named_modules() if isinstance(m, QUANT_MODULES)}


def quantize_fp8_linears(model: LlamaForCausalLM) -> int:
    """Every dense decoder projection of a loaded model replaced by FP8 weights with per-output-channel
    scales (weight-only, dynamic: `--quantization fp8` on a dense checkpoint). Returns how many."""
    require_kernels("fp8")
    count = 0
    with torch.no_grad():
        for layer in model.layers:
            for parent, child in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                                  (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
                linear = getattr(parent, child)
                if not isinstance(linear, nn.Linear):
                    continue
                weight, scale = quantize_fp8(linear.weight.float(), per_channel=True)
                setattr(parent, child, QuantLinear(Fp8Weights(weight, scale), linear.bias))
                count += 1
    log.info("decoder projections quantized to fp8 at load (per-channel scales): %d", count)
    return count
