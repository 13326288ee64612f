"""The seam between a linear layer and its quantized weights: `QuantLinear` is a drop-in for nn.Linear's
forward (x [..., K] -> [..., N]) over any weights class of registry.py; `ConcatQuantLinear` is a fused
projection whose parts cannot share one kernel call (GPTQ parts with different act-order g_idx), run one
after the other with their outputs side by side."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn


class QuantLinear(nn.Module):
    def __init__(self, weights, bias: torch.Tensor | None = None):
        super().__init__()
        self.weights = weights
        self.out_features, self.in_features = weights.shape
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # The packed tensors as (non-persistent) buffers: the model's byte count (memory_profile.model_bytes)
        # sees them, and a device move (`.to`) moves them; `_apply` hands the moved ones back to `weights`.
        self._tensor_fields = [f.name for f in dataclasses.fields(weights)
                               if isinstance(getattr(weights, f.name), torch.Tensor)]
        for name in self._tensor_fields:
            self.register_buffer(name, getattr(weights, name), persistent=False)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self.weights = dataclasses.replace(self.weights, **{n: getattr(self, n) for n in self._tensor_fields})
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weights.apply(x, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"weights={type(self.weights).__name__}"


class ConcatQuantLinear(nn.Module):
    """Several QuantLinear over the same input, their outputs concatenated (in order) along the last dim."""

    def __init__(self, parts: list[QuantLinear]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        assert all(p.in_features == self.in_features for p in parts)
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)
