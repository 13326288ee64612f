"""LoRA's low-rank half over a batch that mixes adapters (issue 26, the CPU/torch path): shrink and expand
against a dense per-token reference, over ragged segments, ranks 8-64, fp32 and fp16."""

from __future__ import annotations

import pytest
import torch

from sluice_engine.lora.ops import LoRASegments, lora_expand, lora_shrink


def test_segments_merge_neighbours_on_one_slot_and_skip_the_base():
    segs = LoRASegments.from_requests([3, 2, 4, 1, 5, 0, 2], [1, 1, 0, 2, 2, 3, 1])
    assert (segs.starts, segs.ends, segs.slots) == ([0, 9, 15], [5, 15, 17], [1, 2, 1])
    assert not LoRASegments.from_requests([4, 4], [0, 0])


def _reference(x, a, b, slots_per_token, y, offset):
    """y[t, offset:offset+out] += B[s] @ (A[s] @ x[t]) for each token with s > 0, in float64."""
    y = y.double().clone()
    for t, s in enumerate(slots_per_token):
        if s:
            y[t, offset : offset + b.shape[1]] += b[s].double() @ (a[s].double() @ x[t].double())
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rank", [8, 16, 64])
def test_shrink_expand_match_a_dense_reference_over_ragged_segments(dtype, rank):
    g = torch.Generator().manual_seed(rank)
    num_slots, fan_in, out, total_out = 4, 96, 48, 160  # slot 0 unused: the base
    lens = [1, 7, 1, 1, 13, 3, 1, 9]
    slots = [2, 0, 1, 1, 3, 0, 2, 1]
    per_token = [s for n, s in zip(lens, slots, strict=True) for _ in range(n)]
    x = torch.randn(sum(lens), fan_in, generator=g).to(dtype)
    a = (torch.randn(num_slots, rank, fan_in, generator=g) * 0.1).to(dtype)
    b = (torch.randn(num_slots, out, rank, generator=g) * 0.1).to(dtype)
    a[0].zero_()
    b[0].zero_()
    y = torch.randn(sum(lens), total_out, generator=g).to(dtype)
    want = _reference(x, a, b, per_token, y, offset=64)
    segs = LoRASegments.from_requests(lens, slots)
    h = lora_shrink(x, a, segs)
    assert h.dtype == dtype and h.shape == (sum(lens), rank)
    base_rows = [t for t, s in enumerate(per_token) if s == 0]
    assert not h[base_rows].any()  # tokens on the base get nothing
    lora_expand(h, b, segs, y, offset=64)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.double(), want, atol=tol, rtol=tol)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_per_token_gather_gives_the_per_segment_sums(dtype):
    g = torch.Generator().manual_seed(3)
    lens, slots = [1, 1, 1, 4, 1, 1], [1, 0, 2, 2, 3, 1]
    x = torch.randn(sum(lens), 64, generator=g).to(dtype)
    a = (torch.randn(4, 16, 64, generator=g) * 0.1).to(dtype)
    b = (torch.randn(4, 40, 16, generator=g) * 0.1).to(dtype)
    a[0].zero_()
    b[0].zero_()
    segs = LoRASegments.from_requests(lens, slots)
    y1 = torch.zeros(sum(lens), 40, dtype=dtype)
    lora_expand(lora_shrink(x, a, segs), b, segs, y1)
    segs.token_slots = torch.tensor([s for n, s in zip(lens, slots, strict=True) for _ in range(n)])
    y2 = torch.zeros(sum(lens), 40, dtype=dtype)
    lora_expand(lora_shrink(x, a, segs), b, segs, y2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y1, y2, atol=tol, rtol=tol)
