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


def test_tokens_group_by_slot_in_buckets_of_little_padding():
    from sluice_engine.lora.ops import group_tokens

    # Round-robin decodes over two adapters (one bucket, no padding), the base left out.
    assert group_tokens([1, 1, 1, 1, 1], [1, 2, 0, 1, 2]) == [([1, 2], [[0, 3], [1, 4]])]
    # A prompt chunk beside decodes: a group joins its bucket only while padding stays at most half of it.
    buckets = group_tokens([1, 40, 1, 1, 2], [2, 1, 3, 2, 3])
    assert buckets == [([1, 3], [list(range(1, 41)), [41, 43, 44]]), ([2], [[0, 42]])]
    for _, rows in buckets:  # at most half of a bucket is padding
        assert len(rows[0]) * len(rows) <= 2 * sum(map(len, rows))


def test_grouped_shrink_and_expand_match_the_dense_sums():
    from sluice_engine.lora.ops import LoRAGroup, group_tokens, grouped_expand, grouped_shrink

    g = torch.Generator().manual_seed(2)
    sizes, slots = [1, 6, 1, 1, 3, 1, 2], [1, 2, 0, 3, 1, 3, 2]
    t = sum(sizes)
    x = torch.randn(t, 32, generator=g)
    a, b = torch.randn(4, 16, 32, generator=g), torch.randn(4, 24, 16, generator=g)
    a[0], b[0] = 0, 0
    y = torch.randn(t, 40, generator=g)
    want = y.clone()
    per_token = [s for n, s in zip(sizes, slots, strict=True) for _ in range(n)]
    for i, s in enumerate(per_token):
        want[i, 8:32] += b[s] @ (a[s] @ x[i])
    for b_slots, b_rows in group_tokens(sizes, slots):
        n = len(b_rows[0])
        rows = torch.tensor([r for toks in b_rows for r in (*toks, *[0] * (n - len(toks)))])
        pad = torch.tensor([[i >= len(toks) for i in range(n)] for toks in b_rows]).view(len(b_slots), n, 1)
        grp = LoRAGroup(rows, torch.tensor(b_slots), pad if pad.any() else None, len(b_slots), n)
        grouped_expand(grouped_shrink(x, a, grp), b, grp, y, offset=8)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-4)
