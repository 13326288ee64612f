"""Linear layers on the C++ fp32 GEMM (gemm.cpp): weights packed once into column panels (32 wide
with AVX-512, 16 with AVX2 or AArch64: the library says).

Used with the `cpu` attention backend (the engine's C++ CPU path) for fp32 models. A decode step is
mostly these matmuls at a handful of rows, where F.linear (MKL) is far from this machine's limits; see
gemm.cpp for why the packed layout and docs/BENCHMARKS.md for the figures."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from . import load

log = logging.getLogger("sluice.engine")


def pack_weight(weight: torch.Tensor, panel: int) -> torch.Tensor:
    """[N, K] (nn.Linear layout) -> [ceil(N / panel), K, panel], zero-padded columns. The panel width
    is the library's (`sluice_gemm_panel_width`: 32 with AVX-512, 16 with AVX2 or NEON)."""
    n, k = weight.shape
    panels = -(-n // panel)
    if n % panel:  # pad the last panel with zero columns (a copy: only for ragged widths)
        padded = weight.new_zeros(panels * panel, k)
        padded[:n] = weight
        weight = padded
    return weight.reshape(panels, panel, k).transpose(1, 2).contiguous()


class PackedLinear(nn.Module):
    """y = x W^T (+ b), W held only in the packed layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lib):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # A parameter (frozen), so the model's parameter count and byte size stay what they are.
        self.packed = nn.Parameter(pack_weight(weight.detach(), lib.sluice_gemm_panel_width()), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self._gemm = lib.sluice_gemm_f32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        m = rows.shape[0]
        y = torch.empty(m, self.out_features, dtype=x.dtype, device=x.device)
        if m:
            self._gemm(rows.data_ptr(), rows.stride(0), self.packed.data_ptr(), m, self.in_features,
                       self.out_features, y.data_ptr(), self.out_features, torch.get_num_threads())
        if self.bias is not None:
            y += self.bias
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


class PackedEmbedding(nn.Module):
    """The input embedding of a model with tied embeddings, read from the output layer's packed
    weight (row v lives in panel v // width, column v % width), so the table is held once."""

    def __init__(self, head: PackedLinear):
        super().__init__()
        self.head = head
        self.width = head.packed.shape[2]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.packed[ids // self.width, :, ids % self.width]


def pack_linears(model: nn.Module) -> int:
    """Every fp32 CPU nn.Linear of `model` replaced by a PackedLinear; with tied embeddings
    (`model.lm_head is None`) the table moves into a packed output layer that the input embedding
    reads too. Returns how many layers were packed (0 where the kernels are unavailable or the CPU
    has none of AVX-512, AVX2, AArch64)."""
    lib = load()
    if lib is None or not lib.sluice_gemm_available():
        log.info("linear layers: F.linear (the C++ GEMM needs a C++ compiler and AVX-512, AVX2 or AArch64)")
        return 0
    targets = [name for name, mod in model.named_modules()
               if type(mod) is nn.Linear and mod.weight.dtype == torch.float32 and mod.weight.device.type == "cpu"]
    # One layer at a time, its plain weight dropped as soon as the packed one replaces it: the peak is
    # the model plus one layer, not two models.
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        mod = getattr(parent, child)
        setattr(parent, child, PackedLinear(mod.weight, mod.bias, lib))
        del mod
    count = len(targets)
    embed = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", False) is None and type(embed) is nn.Embedding and embed.weight.dtype == torch.float32:
        model.lm_head = PackedLinear(embed.weight, None, lib)
        model.embed_tokens = PackedEmbedding(model.lm_head)
        count += 1
    log.info("linear layers: %d packed for the C++ GEMM", count)
    return count


def reference_linear(x: torch.Tensor, layer: PackedLinear) -> torch.Tensor:
    """F.linear on the unpacked weight (tests)."""
    n, k = layer.out_features, layer.in_features
    weight = layer.packed.transpose(1, 2).reshape(-1, k)[:n]  # [panels, panel, K] -> rows
    return F.linear(x, weight, layer.bias)
