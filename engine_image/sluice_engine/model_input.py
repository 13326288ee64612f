"""The batch builder: a step's plain requests -> the forward's tensors (token ids, positions and the
attention metadata). Shared by the model runner and the draft model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .forward_context import AttentionMetadata
from .sched_output import ScheduledRequest


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    logits_rows: torch.Tensor  # hidden-state rows to project to logits, in order

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def build_model_input(scheduled: list[ScheduledRequest], logits_rows: list[int], block_size: int,
                      device: torch.device) -> ModelInput:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for s in scheduled:
        table = s.block_ids
        input_ids.extend(s.token_ids)
        positions.extend(range(s.start, s.end))
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(s.start, s.end))
    meta = AttentionMetadata.build([s.num_tokens for s in scheduled], [s.end for s in scheduled],
                                   [s.block_ids for s in scheduled], slots, block_size, device)
    return ModelInput(
        torch.tensor(input_ids, dtype=torch.long, device=device),
        torch.tensor(positions, dtype=torch.long, device=device),
        meta,
        torch.tensor(logits_rows, dtype=torch.long, device=device),
    )
