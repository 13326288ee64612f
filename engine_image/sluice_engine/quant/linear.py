"""The seam between a linear layer and its quantized weights: `QuantLinear` is a drop-in for nn.Linear's
forward (x [..., K] -> [..., N]) over any weights class of registry.py."""

from __future__ import annotations

import torch
from torch import nn


class QuantLinear(nn.Module):
    def __init__(self, weights, bias: torch.Tensor | None = None):
        super().__init__()
        self.weights = weights
        self.out_features, self.in_features = weights.shape
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weights.apply(x, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"weights={type(self.weights).__name__}"
