"""FP8 weight-only linear weights: e4m3 values in the nn.Linear layout [N, K] and an fp32 scale per tensor
(one element) or per output channel ([N] or [N, 1]), as FP8 checkpoints with quant_method "fp8" store them
(`<layer>.weight` F8_E4M3, `<layer>.weight_scale` F32); w = weight * scale. Block-wise scales
(weight_block_size, `weight_scale_inv`) are a different format and are refused. An activation scale
(`input_scale`, activation_scheme static) is not used: activations stay fp16/bf16 (W8A16).

Fused projections (q/k/v, gate/up) concatenate their parts' weights along N exactly. Per-channel scales
concatenate; per-tensor scales that differ between the parts become per-channel ones (each part's scale
repeated over its rows: the e4m3 values are kept as they are, nothing is requantized); per-tensor scales that
agree stay one scale. Tensor parallelism slices rows (with their scales) or columns of the [N, K] weight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

E4M3_MAX = 448.0


def dequantize_fp8(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """The reference: the fp32 weight [N, K]."""
    scale = weight_scale.to(torch.float32).reshape(-1)
    w = weight.to(torch.float32)
    return w * (scale[:, None] if scale.numel() > 1 else scale)


def quantize_fp8(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Round an fp32 weight [N, K] to e4m3 with absmax scales: (weight, weight_scale [N] or [1])."""
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax().reshape(1)
    scale = (amax / E4M3_MAX).clamp(min=1e-12).to(torch.float32)
    q = (w / (scale[:, None] if per_channel else scale)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


@dataclass(frozen=True, slots=True)
class Fp8Weights:
    weight: torch.Tensor  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor  # [1] or [N] float32

    def __post_init__(self):
        assert self.weight.dtype == torch.float8_e4m3fn and self.weight.dim() == 2, self.weight.dtype
        assert self.weight_scale.numel() in (1, self.weight.shape[0]), self.weight_scale.shape

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features N, in_features K)"""
        return tuple(self.weight.shape)

    @classmethod
    def from_checkpoint(cls, get: Callable[[str], torch.Tensor | None], prefix: str, qcfg: dict) -> Fp8Weights:
        if qcfg.get("weight_block_size") or get(prefix + "weight_scale_inv") is not None:
            raise ValueError(f"{prefix}: block-wise FP8 scales (weight_block_size) are not supported; "
                             "per-tensor and per-channel scales are")
        weight, scale = get(prefix + "weight"), get(prefix + "weight_scale")
        if weight is None or scale is None:
            raise ValueError(f"{prefix}: an fp8 layer needs {prefix}weight and {prefix}weight_scale")
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{prefix}weight is {weight.dtype}, not float8_e4m3fn (e4m3)")
        return cls(weight, scale.to(torch.float32).reshape(-1))

    @property
    def per_channel(self) -> bool:
        return self.weight_scale.numel() > 1

    def narrow_out(self, start: int, end: int) -> Fp8Weights:
        """Output rows [start, end) (column-parallel sharding)."""
        scale = self.weight_scale[start:end].clone() if self.per_channel else self.weight_scale
        return Fp8Weights(self.weight[start:end].clone(), scale)

    def narrow_in(self, start: int, end: int) -> Fp8Weights:
        """Input columns [start, end) (row-parallel sharding); the scales are per output row, kept whole."""
        return Fp8Weights(self.weight[:, start:end].contiguous(), self.weight_scale)

    @classmethod
    def cat_out(cls, parts: list[Fp8Weights]) -> Fp8Weights:
        """The parts' output rows stacked (a fused projection): exact, see the module docstring."""
        weight = torch.cat([p.weight for p in parts])
        scales = [p.weight_scale for p in parts]
        if not any(p.per_channel for p in parts) and all(torch.equal(s, scales[0]) for s in scales):
            return cls(weight, scales[0])
        return cls(weight, torch.cat([s.expand(p.weight.shape[0]) for s, p in zip(scales, parts, strict=True)]))

    def to(self, device: torch.device) -> Fp8Weights:
        return Fp8Weights(self.weight.to(device), self.weight_scale.to(device))

    def dequantize(self) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.weight_scale)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from . import gemm_paths
        from .triton_gemm import fp8_linear

        n, k = self.shape
        path = gemm_paths.TABLE.pick("fp8", x, n, k)  # measured per shape at start-up on CUDA (gemm_paths.py)
        if path == "scaled_mm":
            return gemm_paths.fp8_scaled_mm(x, self.weight, self.weight_scale, bias)
        if path == "dequant":
            return gemm_paths.dequant_linear(self, x, bias)
        return fp8_linear(x, self.weight, self.weight_scale, bias)
