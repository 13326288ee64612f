"""Linear layers held in GGUF block formats (--quantization, CPU): each layer's LinearMethod chosen, and
its blocks read from the GGUF file the model came from, byte for byte, never dequantized.

Runs after models/loader.py has loaded the fp32 weights (the norms, and any layer the GGUF does not hold
in the wanted format, come from there); each quantized layer's fp32 weight is dropped as its
GgufBlockLinear replaces it, so the steady state holds the blocks only.

GGUF names and layout (llama.cpp's converter): `blk.{i}.attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|
ffn_down.weight`, `token_embd.weight`, `output.weight`; rows are outputs, as in nn.Linear. The converter
permutes the rows of attn_q and attn_k (rotary pairs interleaved, llama.cpp's rope order); whole rows move,
so the permutation is undone on the block rows as they are.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..cpu_kernels.quant import GgufBlockLinear, LinearMethod, QuantEmbedding
from ..quant.formats import CPU_FORMATS
from .gguf_checkpoint import unpermute_rows
from .gguf_file import open_gguf
from .llama import LlamaForCausalLM, dense_linear

log = logging.getLogger("sluice.engine")

# module (under layers.{i}.) -> its GGUF tensors, in the order their rows are stacked
_LAYER_PARTS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


class GGUFBlocks:
    """The block-format tensors of a GGUF file, as uint8 [rows, row bytes] (memory-mapped: models/gguf_file.py;
    copied out per layer)."""

    def __init__(self, path: Path):
        self.path = path
        self._tensors = open_gguf(path).tensors

    def format(self, name: str) -> str | None:
        """The tensor's format name if it is one the CPU kernels run (q8_0, q4_0, q4_1), else None."""
        t = self._tensors.get(name)
        fmt = t.type_name.lower() if t is not None else None
        return fmt if fmt in CPU_FORMATS else None

    def rows(self, name: str, n_head: int | None = None) -> np.ndarray:
        data = self._tensors[name].data
        assert data.dtype == np.uint8 and data.ndim == 2
        return unpermute_rows(data, n_head) if n_head else data


def _own_format(gguf: GGUFBlocks, names: list[str]) -> str | None:
    """The CPU format every one of the tensors is in, or None (mixed, absent, or another type)."""
    fmts = {gguf.format(n) for n in names}
    return fmts.pop() if len(fmts) == 1 else None


def _stacked_blocks(gguf: GGUFBlocks, mc, i: int, parts: tuple[str, ...]) -> torch.Tensor:
    """Layer i's tensors `parts`, their block rows stacked as the fused projection's output rows."""
    heads = {"attn_q": mc.num_heads, "attn_k": mc.num_kv_heads}
    return torch.from_numpy(np.concatenate([gguf.rows(f"blk.{i}.{p}.weight", heads.get(p)) for p in parts]))


class GGUFLinears:
    """A LinearFactory (models/llama.py) for an unsharded model: each decoder projection whose GGUF tensors
    are all in the CPU format `quantization` keeps (auto: whichever of them the file uses) is built
    straight from the file's blocks as the model is built, so its fp32 weight is never allocated (the
    loading peak stays near the steady state); any other (another format, or a bias) is a dense
    nn.Linear, loaded and then left to quantize_linears."""

    def __init__(self, quantization: str, gguf: GGUFBlocks, mc, lib):
        self.quantization, self.gguf, self.mc, self.lib = quantization, gguf, mc, lib

    def __call__(self, name: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
        layer, _, module_name = name.partition(".")[2].partition(".")
        parts = _LAYER_PARTS.get(module_name)
        if parts is None or bias or not layer.isdigit():
            return dense_linear(name, in_features, out_features, bias)
        i = int(layer)
        own = _own_format(self.gguf, [f"blk.{i}.{p}.weight" for p in parts])
        if own is None or self.quantization not in ("auto", own):
            return dense_linear(name, in_features, out_features, bias)
        new = GgufBlockLinear(_stacked_blocks(self.gguf, self.mc, i, parts), own, in_features, None, self.lib)
        if new.out_features != out_features:
            raise ValueError(f"{self.gguf.path}: layer {i} {module_name}: {new.out_features} rows, the model "
                             f"has {out_features}")
        return new


def quantize_linears(model: LlamaForCausalLM, quantization: str, gguf: GGUFBlocks | None, lib) -> dict[str, int]:
    """Replace the model's linear layers as `quantization` says: `auto` keeps every layer the GGUF holds
    in a CPU format in that format (others stay fp32); q8_0/q4_0/q4_1 holds every decoder linear in that
    format (from the GGUF's blocks where it has them in it, else quantized from the fp32 weight). The
    output layer, the most sensitive to rounding, is quantized only where the GGUF ships it so (then in
    its own format), with a tied input embedding reading the same blocks. Returns {format: layers}."""
    sh, mc = model.shard, model.cfg
    if sh.tp * sh.pp != 1:
        raise ValueError("--quantization q8_0/q4_0/q4_1 runs unsharded only (--tensor-parallel-size and "
                         "--pipeline-parallel-size 1)")
    counts: dict[str, int] = {}
    for i, layer in enumerate(model.layers):
        for module_name, parts in _LAYER_PARTS.items():
            parent_name, _, child = module_name.rpartition(".")
            parent = layer.get_submodule(parent_name)
            linear = getattr(parent, child)
            if isinstance(linear, GgufBlockLinear):  # built from the GGUF's blocks with the model (GGUFLinears)
                counts[linear.fmt] = counts.get(linear.fmt, 0) + 1
                continue
            own = _own_format(gguf, [f"blk.{i}.{p}.weight" for p in parts]) if gguf is not None else None
            fmt = own if quantization == "auto" else quantization
            if fmt is None:
                continue
            # The file's own blocks where it holds the layer in the format, else quantized from the fp32 weight.
            blocks = _stacked_blocks(gguf, mc, i, parts) if own == fmt else None
            new = LinearMethod(fmt).create(linear.weight, linear.bias, lib, blocks)
            if blocks is not None and new.out_features != linear.out_features:
                raise ValueError(f"{gguf.path}: layer {i} {module_name}: {new.out_features} rows, the model "
                                 f"has {linear.out_features}")
            setattr(parent, child, new)
            counts[fmt] = counts.get(fmt, 0) + 1
    _quantize_head(model, gguf, lib, counts)
    log.info("linear layers in GGUF blocks: %s", ", ".join(f"{n} {f}" for f, n in sorted(counts.items())) or "none")
    return counts


def _quantize_head(model: LlamaForCausalLM, gguf: GGUFBlocks | None, lib, counts: dict[str, int]) -> None:
    if gguf is None:
        return
    tied = model.lm_head is None
    name = "token_embd.weight" if tied else "output.weight"
    fmt = gguf.format(name)
    if fmt is None:
        return
    table = model.embed_tokens if tied else model.lm_head
    blocks = torch.from_numpy(np.array(gguf.rows(name)))
    head = GgufBlockLinear(blocks, fmt, table.weight.shape[1], None, lib)
    if head.out_features != table.weight.shape[0]:
        raise ValueError(f"{gguf.path}: {name} has {head.out_features} rows, the model {table.weight.shape[0]}")
    model.lm_head = head
    if tied:
        model.embed_tokens = QuantEmbedding(head)
    counts[fmt] = counts.get(fmt, 0) + 1
