"""LoRA's low-rank half over a batch that mixes adapters (issue 26): the step's segments, and a rank padded with
zeros. Shrink and expand against a dense per-token reference, torch path (both forms) and Triton kernels on the
same cases: test_lora_kernels.py."""

from __future__ import annotations

import torch

from sluice_engine.lora.ops import LoRASegments, lora_expand, lora_shrink


def test_segments_merge_neighbours_on_one_slot_and_skip_the_base():
    segs = LoRASegments.from_requests([3, 2, 4, 1, 5, 0, 2], [1, 1, 0, 2, 2, 3, 1])
    assert (segs.starts, segs.ends, segs.slots) == ([0, 9, 15], [5, 15, 17], [1, 2, 1])
    assert not LoRASegments.from_requests([4, 4], [0, 0])


def test_a_smaller_rank_padded_with_zeros_changes_nothing():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 32, generator=g)
    a8, b8 = torch.randn(8, 32, generator=g), torch.randn(24, 8, generator=g)
    a = torch.zeros(2, 16, 32)
    b = torch.zeros(2, 24, 16)
    a[1, :8], b[1, :, :8] = a8, b8
    segs = LoRASegments.from_requests([5], [1])
    y = torch.zeros(5, 24)
    lora_expand(lora_shrink(x, a, segs), b, segs, y)
    torch.testing.assert_close(y, (x @ a8.T) @ b8.T)
