"""The reference `LayerOps` in plain torch: the CPU path, and what the Triton kernels are held to.

16-bit activations: RMSNorm runs in fp32 and rounds to the activation dtype before the weight multiply;
the residual stream and SiLU-and-multiply stay in the activation dtype (as HF's Llama does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .rotary import RotaryEmbedding, rotate


class TorchLayerOps:
    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:  # one fused op; the same arithmetic as below
            return F.rms_norm(x, weight.shape, weight, eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x.to(dtype)

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def rotary(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return rotate(x, cos_sin)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary_embedding(self, head_dim: int, max_positions: int, theta: float, scaling: dict) -> torch.nn.Module:
        return RotaryEmbedding(head_dim, max_positions, theta, scaling)
