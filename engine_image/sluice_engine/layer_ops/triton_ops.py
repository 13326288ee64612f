"""`LayerOps` as one Triton kernel each (`triton_kernels.py`): the model's ops beside the Triton attention
backend."""

from __future__ import annotations

import torch

from . import triton_kernels as tk
from .rotary import RotaryEmbedding


class TritonLayerOps:
    name = "triton"

    def __init__(self):
        if not torch.cuda.is_available() and not tk.INTERPRETER_READY:
            raise ValueError("the Triton layer kernels run off CUDA only in Triton's interpreter: set "
                             "TRITON_INTERPRET=1 in the environment before triton is first imported")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return tk.rms_norm(x, weight, eps)

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return tk.fused_add_rms_norm(x, residual, weight, eps)

    def rotary(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return tk.rotary_(x, *cos_sin)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return tk.silu_and_mul(gate_up)

    def rotary_embedding(self, head_dim: int, max_positions: int, theta: float, scaling: dict) -> torch.nn.Module:
        return RotaryEmbedding(head_dim, max_positions, theta, scaling)
