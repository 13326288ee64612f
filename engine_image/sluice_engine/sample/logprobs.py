"""Logprobs gathered on the device: per row, the log-probability of one token under the row's raw
distribution and the row's top-k, read back with the rest of the step (device_io.fetch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .token_logprobs import TokenLogprobs


@dataclass(slots=True)
class DeviceLogprobs:
    chosen: torch.Tensor  # [rows]
    top_ids: torch.Tensor | None  # [rows, max k]; None when every k is 0
    top_values: torch.Tensor | None
    ks: list[int]  # per row, how many of the top entries it reports

    def tensors(self) -> list[torch.Tensor]:
        top = [self.top_ids, self.top_values] if self.top_ids is not None else []
        return [self.chosen, *top]

    def read(self, values: list[list[float]]) -> list[TokenLogprobs]:
        chosen = values[0]
        if self.top_ids is None:
            return [(c, []) for c in chosen]
        width = self.top_ids.shape[1]
        ids, vals = values[1], values[2]
        out = []
        for r, (c, k) in enumerate(zip(chosen, self.ks, strict=True)):
            at = r * width
            out.append((c, [(int(ids[at + j]), vals[at + j]) for j in range(k)]))
        return out


def gather_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, ks: list[int]) -> DeviceLogprobs:
    """raw: [rows, vocab] logits; token_ids: [rows] the token each row reports; ks: per row, its top-k."""
    lp = torch.log_softmax(raw, dim=-1)
    chosen = lp.gather(1, token_ids[:, None])[:, 0]
    width = max(ks, default=0)
    if width == 0:
        return DeviceLogprobs(chosen, None, None, ks)
    values, ids = lp.topk(width, dim=-1)
    return DeviceLogprobs(chosen, ids, values, ks)
