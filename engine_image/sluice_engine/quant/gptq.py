"""GPTQ 4-bit linear weights, the v1 format of GPTQ-for-LLaMa and AutoGPTQ (quant_method "gptq", bits 4,
checkpoint_format "gptq"; the v2 format, which stores zeros without the offset, is refused):

- `qweight` [K/8, N] int32 packed along K in order: nibble i (bits 4i..4i+3) of row r is input row k = 8r + i.
- `scales` [K/G, N] fp16; `qzeros` [K/G, N/8] int32 packed along N in order, each stored as zero - 1
  (so a symmetric 4-bit layer stores 7 for its zero 8).
- `g_idx` [K] int32, optional: the group of each input row (act-order / desc_act checkpoints); k // G if absent.
- w[k, n] = (q[k, n] - (z[g, n] + 1)) * s[g, n] with g = g_idx[k]; the layer computes x @ w (w is W^T, [K, N]).

Fused projections (q/k/v, gate/up) concatenate their parts along N exactly when the parts share one g_idx
(qweight and scales are whole columns, qzeros whole int32s of 8 columns). Act-order parts quantized from the
same input share it (the order comes from the input's Hessian); parts whose g_idx differ cannot share one
kernel call (`cat_out` says None) and run side by side (quant/linear.py ConcatQuantLinear). Tensor parallelism
slices N at multiples of 8 and K at multiples of 8; where a K slice does not fall on group boundaries (or the
layer has act-order) the slice keeps every group's scales and zeros and an explicit g_idx picks them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def _to_int32(u: torch.Tensor) -> torch.Tensor:
    return torch.where(u >= 2**31, u - 2**32, u).to(torch.int32)


def _own(t: torch.Tensor) -> torch.Tensor:
    """A slice in its own contiguous storage (a view would keep the whole tensor alive)."""
    return t.clone(memory_format=torch.contiguous_format)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R/8, C] packed along rows -> int32 [R, C] values 0..15."""
    nib = (packed[:, None, :] >> _SHIFTS.to(packed.device)[None, :, None]) & 0xF  # [R/8, 8, C]
    return nib.reshape(-1, packed.shape[1])


def unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C/8] packed along columns in order -> int32 [R, C] values 0..15."""
    return ((packed[:, :, None] >> _SHIFTS.to(packed.device)) & 0xF).reshape(packed.shape[0], -1)


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    r, c = values.shape
    v = values.to(torch.int64).reshape(r // 8, 8, c)
    return _to_int32((v << _SHIFTS.to(torch.int64).to(values.device)[None, :, None]).sum(dim=1))


def pack_cols(values: torch.Tensor) -> torch.Tensor:
    r, c = values.shape
    v = values.to(torch.int64).reshape(r, c // 8, 8)
    return _to_int32((v << _SHIFTS.to(torch.int64).to(values.device)).sum(dim=2))


def dequantize_gptq(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
                    g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: the fp32 weight [K, N] (W^T)."""
    k = qweight.shape[0] * 8
    if g_idx is None:
        g_idx = torch.arange(k, device=qweight.device) // (k // scales.shape[0])
    g = g_idx.long()
    q = unpack_rows(qweight).to(torch.float32)
    z = (unpack_cols(qzeros) + 1).to(torch.float32)  # v1: stored zero - 1
    return (q - z[g]) * scales.to(torch.float32)[g]


@dataclass(frozen=True, slots=True)
class GptqWeights:
    qweight: torch.Tensor  # [K/8, N] int32
    scales: torch.Tensor  # [K/G, N]
    qzeros: torch.Tensor  # [K/G, N/8] int32
    g_idx: torch.Tensor | None = None  # [K] int32

    def __post_init__(self):
        k8, n = self.qweight.shape
        groups = self.scales.shape[0]
        assert self.scales.shape[1] == n and tuple(self.qzeros.shape) == (groups, n // 8), (
            self.qweight.shape, self.scales.shape, self.qzeros.shape)
        # With g_idx the groups need not tile K (a row-parallel slice keeps every group's scales).
        assert (8 * k8) % groups == 0 if self.g_idx is None else self.g_idx.shape == (8 * k8,)

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features N, in_features K)"""
        return self.qweight.shape[1], self.qweight.shape[0] * 8

    @classmethod
    def from_checkpoint(cls, get: Callable[[str], torch.Tensor | None], prefix: str, qcfg: dict) -> GptqWeights:
        t = {name: get(prefix + name) for name in ("qweight", "scales", "qzeros")}
        if any(v is None for v in t.values()):
            raise ValueError(f"{prefix}: a gptq layer needs {prefix}qweight, {prefix}scales and {prefix}qzeros")
        g_idx = get(prefix + "g_idx")
        k = t["qweight"].shape[0] * 8
        group = qcfg.get("group_size", 128)
        group = k if group in (-1, None) else group  # -1: one group over all of K
        if k != group * t["scales"].shape[0]:
            raise ValueError(f"{prefix}: {t['scales'].shape[0]} scale groups do not cover K={k} at group_size {group}")
        if g_idx is not None:
            g_idx = g_idx.to(torch.int32)
            # Checkpoints without act-order still store g_idx = k // G: drop it, the kernel computes that.
            if torch.equal(g_idx, torch.arange(k, dtype=torch.int32) // group):
                g_idx = None
        return cls(t["qweight"].to(torch.int32), t["scales"], t["qzeros"].to(torch.int32), g_idx)

    @property
    def group_of_row(self) -> torch.Tensor:
        """g_idx, or the k // G it stands for when absent: [K] int32."""
        if self.g_idx is not None:
            return self.g_idx
        k = self.qweight.shape[0] * 8
        return (torch.arange(k, device=self.qweight.device) // (k // self.scales.shape[0])).to(torch.int32)

    def narrow_out(self, start: int, end: int) -> GptqWeights:
        """Output columns [start, end) (column-parallel sharding); both multiples of 8 (qzeros' packing)."""
        if start % 8 or end % 8:
            raise ValueError(f"gptq: output columns {start}..{end} do not fall on the 8-column packing of qzeros")
        return GptqWeights(_own(self.qweight[:, start:end]), _own(self.scales[:, start:end]),
                           _own(self.qzeros[:, start // 8 : end // 8]), self.g_idx)

    def narrow_in(self, start: int, end: int) -> GptqWeights:
        """Input rows [start, end) (row-parallel sharding); both multiples of 8 (qweight's packing)."""
        if start % 8 or end % 8:
            raise ValueError(f"gptq: input rows {start}..{end} do not fall on the 8-row packing of qweight")
        qweight = _own(self.qweight[start // 8 : end // 8])
        group = self.qweight.shape[0] * 8 // self.scales.shape[0]
        if self.g_idx is None and start % group == 0 and end % group == 0:
            return GptqWeights(qweight, _own(self.scales[start // group : end // group]),
                               _own(self.qzeros[start // group : end // group]))
        return GptqWeights(qweight, self.scales, self.qzeros, _own(self.group_of_row[start:end]))

    @classmethod
    def cat_out(cls, parts: list[GptqWeights]) -> GptqWeights | None:
        """The parts' output columns side by side (a fused projection), or None where their g_idx differ."""
        first = parts[0].group_of_row
        if any(not torch.equal(p.group_of_row, first) for p in parts[1:]):
            return None
        g_idx = None if all(p.g_idx is None for p in parts) else first
        return cls(*(torch.cat([getattr(p, f) for p in parts], dim=1) for f in ("qweight", "scales", "qzeros")),
                   g_idx)

    def to(self, device: torch.device) -> GptqWeights:
        return GptqWeights(self.qweight.to(device), self.scales.to(device), self.qzeros.to(device),
                           None if self.g_idx is None else self.g_idx.to(device))

    def dequantize(self) -> torch.Tensor:
        return dequantize_gptq(self.qweight, self.scales, self.qzeros, self.g_idx)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from . import gemm_paths
        from .triton_gemm import gptq_linear

        n, k = self.shape
        if gemm_paths.TABLE.pick("gptq", x, n, k) == "dequant":  # measured per shape at start-up on CUDA
            return gemm_paths.dequant_linear(self, x, bias)
        return gptq_linear(x, self.qweight, self.scales, self.qzeros, self.g_idx, bias)
