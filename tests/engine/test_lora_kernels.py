"""Issue 26, acceptance 3: LoRA's shrink and expand over a batch that mixes adapters, held to a dense per-token
reference (h[t] = A[slot(t)] @ x[t]; y[t, offset:offset + out] += B[slot(t)] @ h[t]) by three implementations on
the same cases: the Triton kernels (sluice_engine.lora.triton_ops) and the torch path of lora/ops.py in both its
forms (a product per segment, and gathered per token through `token_slots`).

Without a GPU the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 is set before triton is
first imported, tests/support/triton_interpreter.py); bf16 arithmetic is wrong there, so fp32 and fp16 (bf16
joins on CUDA). The layer's shape, small: two projections fused in one shrink (A [slots, 2 x rank, in]), each
expanded from its column slice of h into the output at its offset, widths that are not a multiple of a tile.
Tolerances, as a fraction of the largest |reference|: fp32 1e-5 (the same fp32 products summed in another
order); 16 bits: 2^-10, two roundings of at most 2^-11 of a value each (h: its output rounding; y: the
delta rounded, then the sum, as the torch path's `y += delta.to(y.dtype)`). Each implementation's expand is
checked against the reference applied to its own h, so a shrink error is not counted twice.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from sluice_engine.forward_context import ForwardContext, forward_context
from sluice_engine.lora import ops
from sluice_engine.lora.layer import LoRALinear
from sluice_engine.lora.ops import LoRASegments

HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON:
    from triton_interpreter import import_kernels

    tk = import_kernels("sluice_engine.lora.triton_ops")

CUDA = torch.cuda.is_available()
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}
RANKS = [8, 16, 32, 64]
NUM_SLOTS, FAN_IN = 4, 200  # `in`: four 64-column tiles, the last part-filled (and split in two at decode size)
PROJECTIONS = [(0, 96), (112, 40)]  # (offset, width) in a 160-column output: a part-filled column tile each
WIDTH = 160

# (lens, slots) per request in batch order. Blocks are 16 tokens at most 64 tokens, then 64 (triton_ops).
CASES = {
    # single tokens, runs on the base, neighbours on one slot merged, a 20-token run across a block boundary
    "ragged": ([1, 7, 1, 1, 20, 3, 1, 9], [2, 0, 1, 1, 3, 0, 2, 1]),
    "one token": ([1], [3]),
    # slots interleaved (not request-contiguous): every token its own run, still the same sums
    "interleaved": ([1, 1, 1, 1, 1, 1], [1, 2, 1, 0, 2, 1]),
    # a first block all on the base (skipped), a prompt chunk past 64 tokens (64-token blocks, `in` unsplit)
    "prompt": ([18, 70, 3], [0, 1, 2]),
}

pytestmark = pytest.mark.usefixtures("one_thread")


def _impl_params():
    triton = pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed"))
    return ["torch segments", "torch gathered", triton]


def _per_token(lens: list[int], slots: list[int]) -> list[int]:
    return [s for n, s in zip(lens, slots, strict=True) for _ in range(n)]


def _weights(rank: int, dtype: torch.dtype, seed: int):
    """x, A (the projections side by side along the rank), each projection's B, and y; slot 0 all zeros."""
    g = torch.Generator().manual_seed(seed)
    device = torch.device("cuda" if CUDA else "cpu")

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    a = randn(NUM_SLOTS, len(PROJECTIONS) * rank, FAN_IN, scale=0.1)
    bs = [randn(NUM_SLOTS, width, rank, scale=0.1) for _, width in PROJECTIONS]
    a[0].zero_()
    for b in bs:
        b[0].zero_()
    return randn, a, bs


def _segments(impl: str, lens: list[int], slots: list[int], device: torch.device) -> LoRASegments:
    segs = LoRASegments.from_requests(lens, slots)
    if impl != "torch segments":
        segs.token_slots = torch.tensor(_per_token(lens, slots), device=device)
    return segs


def _shrink(impl, x, a, segs):
    if impl == "triton":
        return tk.lora_shrink(x, a, segs.token_slots.to(torch.int32))  # int32 here; the runner's are int64
    return ops.lora_shrink(x, a, segs)


def _expand(impl, h, b, segs, y, offset):
    if impl == "triton":
        tk.lora_expand_(h, b, segs.token_slots, y, offset)
    else:
        ops.lora_expand(h, b, segs, y, offset)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape and got.dtype == dtype, (got.shape, want.shape, got.dtype)
    err = (got.double() - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= TOL[dtype] * scale, f"max abs error {err:.3g} > {TOL[dtype]:.3g} x {scale:.3g} ({dtype})"


@pytest.mark.parametrize("impl", _impl_params())
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shrink_and_expand_match_a_dense_reference(impl, case, rank, dtype):
    if dtype == torch.bfloat16 and impl != "triton":
        pytest.skip("the torch path is checked in fp32 and fp16")
    lens, slots = CASES[case]
    per_token = _per_token(lens, slots)
    num_tokens = len(per_token)
    randn, a, bs = _weights(rank, dtype, seed=rank)
    x = randn(num_tokens, FAN_IN)
    y = randn(num_tokens, WIDTH)
    segs = _segments(impl, lens, slots, x.device)
    base = [t for t, s in enumerate(per_token) if s == 0]

    h = _shrink(impl, x, a, segs)
    want_h = torch.stack([a[s].double() @ x[t].double() for t, s in enumerate(per_token)])
    _close(h, want_h, dtype)
    assert not h[base].any()  # tokens on the base get nothing

    want_y = y.double().clone()
    y_base = y[base].clone()
    for j, ((offset, width), b) in enumerate(zip(PROJECTIONS, bs, strict=True)):
        h_j = h[:, j * rank : (j + 1) * rank]  # a column slice, as LoRALinear hands it over
        _expand(impl, h_j, b, segs, y, offset)
        for t, s in enumerate(per_token):
            want_y[t, offset : offset + width] += b[s].double() @ h_j[t].double()
    _close(y, want_y, dtype)
    assert torch.equal(y[base], y_base)  # and their outputs are left alone


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_the_layer_runs_the_kernels_when_they_run_on_its_device(monkeypatch, dtype):
    """LoRALinear over a fused q/k/v output, through ops' dispatch to the kernels (here: the interpreted ones,
    as if the CPU were a GPU) and through the torch path: the same output."""
    g = torch.Generator().manual_seed(7)
    fan_in, rank, slices = 64, 16, [("q", 0, 64), ("k", 64, 32), ("v", 96, 32)]
    base = torch.nn.Linear(fan_in, 128, bias=False).to(dtype)
    layer = LoRALinear(base, fan_in, slices, NUM_SLOTS, rank, dtype, torch.device("cpu"))
    for slot in (1, 2, 3):
        for proj, _, width in slices:
            if (slot, proj) != (2, "k"):  # an adapter that leaves a projection alone
                r = 8 if slot == 3 else rank  # a smaller rank, padded with zeros
                layer.set_slot(slot, proj, torch.randn(r, fan_in, generator=g).to(dtype) * 0.1,
                               torch.randn(width, r, generator=g).to(dtype) * 0.1)
    lens, slots = CASES["ragged"]
    x = torch.randn(sum(lens), fan_in, generator=g).to(dtype)
    segs = _segments("triton", lens, slots, x.device)
    with forward_context(ForwardContext(None, [], segs)):
        want = layer(x)
        calls = []
        monkeypatch.setattr(ops, "_kernels", lambda device_type: calls.append(device_type) or tk)
        got = layer(x)
    assert calls  # the kernels ran
    _close(got, want.double(), dtype)


def test_the_kernels_never_run_on_the_cpu():
    """On the CPU the torch path runs, whatever token_slots says (the runner sets it for small mixed steps)."""
    assert not ops.kernels_run_on(torch.device("cpu"))
