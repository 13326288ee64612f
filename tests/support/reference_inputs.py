"""The step-input builder the engine used before persistent buffers (input_buffers.py): fresh tensors from
Python lists every step. Kept here as the reference the persistent path is tested against; it has the
same `prepare` as InputBuffers, so a runner (or the draft model) can be given it instead."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from sluice_engine.core.sched_output import ScheduledRequest
from sluice_engine.forward_context import AttentionMetadata
from sluice_engine.worker.model_input import ModelInput


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


class ReferenceInputs:
    """Drop-in for InputBuffers: rebuilds every tensor from the step's lists (no rows, no padding)."""

    def __init__(self, block_size: int, device: torch.device):
        self.block_size = block_size
        self.device = device
        self.steps = 0

    def prepare(self, scheduled: list[ScheduledRequest], logits_rows: list[int], freed: Iterable[str] = (),
                pad_to: int | None = None, evict_idle: bool = False) -> ModelInput:
        assert pad_to is None, "the reference path never pads"
        self.steps += 1
        return build_model_input(scheduled, logits_rows, self.block_size, self.device)
