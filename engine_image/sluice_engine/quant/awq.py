"""AWQ 4-bit linear weights (AutoAWQ's GEMM format, quant_method "awq", version "gemm", zero_point true):

- `qweight` [K, N/8] int32: row k holds the 4-bit values of W^T[k, :], eight columns per int32, in AWQ's
  interleaved order: columns 8c..8c+7 go to int32 c with logical column j at nibble (bits 4p..4p+3)
  p = [0, 4, 1, 5, 2, 6, 3, 7][j] (AWQ packs in the order [0, 2, 4, 6, 1, 3, 5, 7]).
- `scales` [K/G, N] fp16, `qzeros` [K/G, N/8] int32 packed like qweight; the zero is stored as is.
- w[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]; the layer computes x @ w (w is W^T, [K, N]).

Fused projections (q/k/v, gate/up) concatenate their parts along N exactly: every tensor's N axis is whole
int32s of 8 columns (each part's N is a multiple of 8, as its packing requires) and the groups run along K,
which the parts share. Tensor parallelism slices N at multiples of 8 (column-parallel) and K at multiples of
the group size (row-parallel).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Nibble p of a packed int32 holds logical column AWQ_PACK_ORDER[p]; logical column j sits at nibble
# AWQ_NIBBLE_OF_COLUMN[j].
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_NIBBLE_OF_COLUMN = tuple(AWQ_PACK_ORDER.index(j) for j in range(8))
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C/8] in AWQ order -> int32 [R, C] values 0..15 in column order."""
    nib = (packed[:, :, None] >> _SHIFTS.to(packed.device)) & 0xF  # [R, C/8, nibble]
    return nib[:, :, list(AWQ_NIBBLE_OF_COLUMN)].reshape(packed.shape[0], -1)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """int [R, C] values 0..15 -> int32 [R, C/8] in AWQ order."""
    r, c = values.shape
    v = values.to(torch.int64).reshape(r, c // 8, 8)[:, :, list(AWQ_PACK_ORDER)]  # nibble p <- column order[p]
    return _to_int32((v << _SHIFTS.to(torch.int64).to(values.device)).sum(dim=2))


def _to_int32(u: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the int32 with the same bits."""
    return torch.where(u >= 2**31, u - 2**32, u).to(torch.int32)


def _own(t: torch.Tensor) -> torch.Tensor:
    """A slice in its own contiguous storage (a view would keep the whole tensor alive)."""
    return t.clone(memory_format=torch.contiguous_format)


def dequantize_awq(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor) -> torch.Tensor:
    """The reference: the fp32 weight [K, N] (W^T)."""
    k = qweight.shape[0]
    group = k // scales.shape[0]
    q = unpack_awq(qweight).to(torch.float32)
    z = unpack_awq(qzeros).to(torch.float32).repeat_interleave(group, dim=0)
    return (q - z) * scales.to(torch.float32).repeat_interleave(group, dim=0)


@dataclass(frozen=True, slots=True)
class AwqWeights:
    qweight: torch.Tensor  # [K, N/8] int32
    scales: torch.Tensor  # [K/G, N]
    qzeros: torch.Tensor  # [K/G, N/8] int32

    def __post_init__(self):
        k, n8 = self.qweight.shape
        groups, n = self.scales.shape
        assert n == 8 * n8 and k % groups == 0 and tuple(self.qzeros.shape) == (groups, n8), (
            self.qweight.shape, self.scales.shape, self.qzeros.shape)

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features N, in_features K)"""
        return self.scales.shape[1], self.qweight.shape[0]

    @classmethod
    def from_checkpoint(cls, get: Callable[[str], torch.Tensor | None], prefix: str, qcfg: dict) -> AwqWeights:
        t = {name: get(prefix + name) for name in ("qweight", "scales", "qzeros")}
        if any(v is None for v in t.values()):
            raise ValueError(f"{prefix}: an awq layer needs {prefix}qweight, {prefix}scales and {prefix}qzeros")
        w = cls(t["qweight"].to(torch.int32), t["scales"], t["qzeros"].to(torch.int32))
        group = qcfg.get("group_size", 128)
        if w.qweight.shape[0] != group * w.scales.shape[0]:
            raise ValueError(f"{prefix}: {w.scales.shape[0]} scale groups do not cover K={w.qweight.shape[0]} "
                             f"at group_size {group}")
        return w

    def narrow_out(self, start: int, end: int) -> AwqWeights:
        """Output columns [start, end) (column-parallel sharding); both multiples of 8."""
        if start % 8 or end % 8:
            raise ValueError(f"awq: output columns {start}..{end} do not fall on the 8-column packing")
        return AwqWeights(_own(self.qweight[:, start // 8 : end // 8]), _own(self.scales[:, start:end]),
                          _own(self.qzeros[:, start // 8 : end // 8]))

    def narrow_in(self, start: int, end: int) -> AwqWeights:
        """Input rows [start, end) (row-parallel sharding); both multiples of the group size."""
        group = self.qweight.shape[0] // self.scales.shape[0]
        if start % group or end % group:
            raise ValueError(f"awq: input rows {start}..{end} do not fall on group boundaries (group size {group})")
        return AwqWeights(_own(self.qweight[start:end]), _own(self.scales[start // group : end // group]),
                          _own(self.qzeros[start // group : end // group]))

    @classmethod
    def cat_out(cls, parts: list[AwqWeights]) -> AwqWeights:
        """The parts' output columns side by side (a fused projection): exact, see the module docstring."""
        return cls(*(torch.cat([getattr(p, f) for p in parts], dim=1) for f in ("qweight", "scales", "qzeros")))

    def to(self, device: torch.device) -> AwqWeights:
        return AwqWeights(self.qweight.to(device), self.scales.to(device), self.qzeros.to(device))

    def dequantize(self) -> torch.Tensor:
        return dequantize_awq(self.qweight, self.scales, self.qzeros)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from . import gemm_paths
        from .triton_gemm import awq_linear

        n, k = self.shape
        if gemm_paths.TABLE.pick("awq", x, n, k) == "dequant":  # measured per shape at start-up on CUDA
            return gemm_paths.dequant_linear(self, x, bias)
        return awq_linear(x, self.qweight, self.scales, self.qzeros, bias)
