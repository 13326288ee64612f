"""A linear layer with LoRA slots: the base layer's GEMM once for the whole batch, then, for the tokens on an
adapter, the low-rank delta of each projection it holds (a fused QKV layer holds q, k and v, each with its own
A and B, at its column offset).

Any base layer works (dense, GGUF blocks on CPU, the GPU formats): the delta is added to its output. The slots'
weights are buffers in the model's dtype on its device: the projections' A side by side along the rank
([slots, projections x rank, in]: one shrink serves q, k and v), and a B per projection ([slots, out, rank]),
zero where a slot's adapter leaves a projection alone or has a smaller rank; B holds the adapter's scaling.
Which tokens are on which slot comes from the forward context (`ForwardContext.lora`, set by the model runner).

An fp32 layer on CPU also keeps each B transposed (`bt_<projection>`, [slots, rank, out]) for the C++ kernel
(lora/cpu_ops.py), which the runner picks when the kernels are built: one call per layer for the whole step.
"""

from __future__ import annotations

import torch
from torch import nn

from ..forward_context import get_forward_context
from .cpu_ops import LayerArgs, lora_cpu_
from .ops import grouped_expand, grouped_shrink, lora_expand, lora_shrink


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, in_features: int, slices: list[tuple[str, int, int]], num_slots: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device):
        """slices: (projection, column offset, width) of each projection the layer's output holds."""
        super().__init__()
        self.base = base
        self.slices = slices
        self.in_features = in_features
        self.max_rank = max_rank
        self.register_buffer("a", torch.zeros(num_slots, len(slices) * max_rank, in_features, dtype=dtype,
                                              device=device), persistent=False)
        for proj, _, width in slices:
            self.register_buffer(f"b_{proj}", torch.zeros(num_slots, width, max_rank, dtype=dtype, device=device),
                                 persistent=False)
        self.cpu_args: LayerArgs | None = None
        if device.type == "cpu" and dtype == torch.float32:
            for proj, _, width in slices:
                self.register_buffer(f"bt_{proj}", torch.zeros(num_slots, max_rank, width, dtype=dtype),
                                     persistent=False)
            self.cpu_args = LayerArgs(self.a, [getattr(self, f"bt_{p}") for p, _, _ in slices], slices)

    def set_slot(self, slot: int, proj: str, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Load one projection of an adapter into a slot (a [rank, in], b [out, rank] with the scaling in it);
        None clears it (the adapter leaves this projection alone)."""
        j = next(i for i, (p, _, _) in enumerate(self.slices) if p == proj)
        rows = self.a[slot, j * self.max_rank : (j + 1) * self.max_rank]
        b_buf = getattr(self, f"b_{proj}")
        bt_buf = getattr(self, f"bt_{proj}", None)
        rows.zero_()
        b_buf[slot].zero_()
        if bt_buf is not None:
            bt_buf[slot].zero_()
        if a is not None and b is not None:
            r = a.shape[0]
            rows[:r].copy_(a)
            b_buf[slot, :, :r].copy_(b)
            if bt_buf is not None:
                bt_buf[slot, :r].copy_(b.T)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        segs = get_forward_context().lora
        if not segs:
            return y
        r = self.max_rank
        if segs.by_slot is not None and self.cpu_args is not None and x.dim() == 2 and x.stride(1) == 1:
            lora_cpu_(self.cpu_args, x, y, *segs.by_slot, r)
            return y
        if segs.groups is not None:
            for g in segs.groups:
                h = grouped_shrink(x, self.a, g)
                for j, (proj, offset, _) in enumerate(self.slices):
                    grouped_expand(h[..., j * r : (j + 1) * r], getattr(self, f"b_{proj}"), g, y, offset)
            return y
        h = lora_shrink(x, self.a, segs)
        for j, (proj, offset, _) in enumerate(self.slices):
            lora_expand(h[:, j * r : (j + 1) * r], getattr(self, f"b_{proj}"), segs, y, offset)
        return y
