"""What a forward reads: the step's token ids, positions and attention metadata, and which hidden rows
become logits. Built by worker/input_buffers.py (views of persistent buffers), for the model runner and the
draft model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..forward_context import AttentionMetadata


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    logits_rows: torch.Tensor  # hidden-state rows to project to logits, in order

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]
