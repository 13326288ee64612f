"""FP8 weight-only linear weights: e4m3 values in the nn.Linear layout [N, K] and an fp32 scale per tensor
(one element) or per output channel ([N] or [N, 1]), as FP8 checkpoints with quant_method "fp8" store them
(`<layer>.weight` F8_E4M3, `<layer>.weight_scale` F32); w = weight * scale. Block-wise scales
(weight_block_size, `weight_scale_inv`) are a different format and are refused. An activation scale
(`input_scale`, activation_scheme static) is not used: activations stay fp16/bf16 (W8A16).
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

    def to(self, device: torch.device) -> Fp8Weights:
        return Fp8Weights(self.weight.to(device), self.weight_scale.to(device))

    def dequantize(self) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.weight_scale)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from .triton_gemm import fp8_linear

        return fp8_linear(x, self.weight, self.weight_scale, bias)
