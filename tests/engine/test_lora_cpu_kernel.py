"""LoRA's C++ CPU kernel (cpu_kernels/lora.cpp, lora/cpu_ops.py; issue 26) on every kernel level this CPU runs,
against a dense per-token reference: ragged requests mixing the base and several adapters, ranks 8-64 with a
smaller rank zero-padded, a fused layer's projections at their column offsets, rows of x and y at a stride."""

from __future__ import annotations

import pytest
import torch
from cpu_isas import CPU_ISAS, isa_lib

from sluice_engine.lora.cpu_ops import LayerArgs, lora_cpu_, rows_by_slot


def test_rows_sort_by_slot_and_leave_the_base_out():
    assert rows_by_slot([2, 1, 3, 1, 0, 2], [3, 0, 1, 3, 2, 1]) == ([3, 4, 5, 7, 8, 0, 1, 6], [1] * 5 + [3] * 3)
    assert rows_by_slot([4, 4], [0, 0]) == ([], [])


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("rank", [8, 16, 64])
@pytest.mark.parametrize("sizes,slots", [
    ([1] * 32, [(i % 4) for i in range(32)]),  # decode steps round-robin over 3 adapters and the base
    ([1, 37, 1, 1, 20, 1], [2, 1, 0, 3, 2, 3]),  # prompt chunks beside decodes (tiles cut at 8 tokens)
    ([5], [1]),  # one adapter, one token run
])
def test_kernel_matches_the_dense_sums(isa, rank, sizes, slots):
    kernel = isa_lib(isa).sluice_lora_f32
    g = torch.Generator().manual_seed(rank)
    hidden, num_slots = 96, 4
    slices = [("q_proj", 0, 64), ("k_proj", 64, 40), ("v_proj", 104, 21)]  # widths off 16: every column path
    t = sum(sizes)
    x_wide = torch.randn(t, hidden + 7, generator=g)
    x = x_wide[:, 3 : 3 + hidden]  # rows at a stride wider than the row
    a = torch.randn(num_slots, len(slices) * rank, hidden, generator=g)
    bt = [torch.randn(num_slots, rank, w, generator=g) for _, _, w in slices]
    a[0], bt[0][0], bt[1][0], bt[2][0] = 0, 0, 0, 0
    a[2, rank // 2 : rank] = 0  # slot 2's q has half the rank: the rest zero-padded
    bt[0][2, rank // 2 :] = 0
    a[3, 2 * rank : 3 * rank] = 0  # slot 3's adapter leaves v alone
    bt[2][3] = 0
    y_wide = torch.randn(t, 140, generator=g)
    y = y_wide[:, 4:132]
    want = y.clone()
    per_token = [s for n, s in zip(sizes, slots, strict=True) for _ in range(n)]
    for i, s in enumerate(per_token):
        for j, (_, off, w) in enumerate(slices):
            want[i, off : off + w] += bt[j][s].T @ (a[s, j * rank : (j + 1) * rank] @ x[i])
    rows, row_slots = rows_by_slot(sizes, slots)
    before = y_wide.clone()
    lora_cpu_(LayerArgs(a, bt, slices), x, y, torch.tensor(rows), torch.tensor(row_slots), rank, kernel)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(y_wide[:, :4], before[:, :4], rtol=0, atol=0)  # nothing outside the columns
    torch.testing.assert_close(y_wide[:, 132:], before[:, 132:], rtol=0, atol=0)


def test_layer_keeps_b_transposed_for_the_kernel_and_matches_the_torch_path():
    """LoRALinear on CPU in fp32: the kernel's result (by_slot) equals the torch path's (groups) for the same
    slots, so the copy of B it keeps transposed tracks set_slot, clearing included."""
    from sluice_engine.forward_context import ForwardContext, forward_context
    from sluice_engine.lora.layer import LoRALinear
    from sluice_engine.lora.ops import LoRASegments
    from sluice_engine.worker.model_runner import ModelRunner

    g = torch.Generator().manual_seed(7)
    base = torch.nn.Linear(48, 80, bias=False)
    layer = LoRALinear(base, 48, [("gate_proj", 0, 40), ("up_proj", 40, 40)], 4, 16, torch.float32,
                       torch.device("cpu"))
    for slot, r in ((1, 8), (2, 16), (3, 4)):
        for proj in ("gate_proj", "up_proj"):
            layer.set_slot(slot, proj, torch.randn(r, 48, generator=g), torch.randn(40, r, generator=g))
    layer.set_slot(3, "up_proj", None, None)
    sizes, slots = [1, 9, 1, 1, 3], [2, 1, 0, 3, 2]
    x = torch.randn(sum(sizes), 48, generator=g)
    segs_kernel = LoRASegments.from_requests(sizes, slots)
    rows, row_slots = rows_by_slot(sizes, slots)
    segs_kernel.by_slot = (torch.tensor(rows), torch.tensor(row_slots))
    segs_torch = LoRASegments.from_requests(sizes, slots)
    segs_torch.groups = ModelRunner._lora_groups(type("R", (), {"device": torch.device("cpu")})(), sizes, slots)
    outs = []
    for segs in (segs_kernel, segs_torch):
        with torch.no_grad(), forward_context(ForwardContext(None, [], segs)):
            outs.append(layer(x))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert not torch.equal(outs[0], base(x))
