"""Triton kernels for LoRA's low-rank half over a batch that mixes adapters (SGMV-style), the GPU twin of the
torch path in ops.py (the reference they are tested against):

- `lora_shrink`: h[t] = A[slot(t)] @ x[t] (in -> rank), fp32 accumulation, h in x's dtype.
- `lora_expand_`: y[t, offset:offset + out] += B[slot(t)] @ h[t] (rank -> out), in place at a column offset.

Both read the step's tokens by slot from one device tensor, every token's slot ([T], int32 or int64; slot 0 = no
adapter, all zeros: its tokens are skipped and get h = 0), and launch a grid that depends only on T and the
weights' static sizes, with no host sync: they can be captured in a CUDA graph with the slot tensor as an input.

Each program takes a block of consecutive tokens x a block of output columns, and walks the block's runs of
tokens on one slot (NOTE: per-token slots rather than segment metadata padded to a static maximum: the batch is
request-contiguous, so a block of a long prompt is one run and takes one tensor-core dot per K tile with one
weight tile, as a per-segment launch would, while a decode block mixing adapters takes one dot per run with the
other rows masked, reading each run's weights once; the grid needs no segment count and the runner uploads one
tensor). Runs are found in the kernel (a token starts one where its slot differs from the previous token's), so
any order of slots is correct, and request-contiguous order is what makes blocks cheap.

Decode-sized steps (T <= SPLIT_K_MAX_T) split the shrink's input dimension (`_shrink_plan`): the rank is small
(8..64 per projection), so T x rank tiles alone are a handful of programs each reading all of `in`; the splits
write fp32 partials [split, T, rank] that torch sums in split order, so results are the same every run.

The module imports only torch and triton, so it also runs in Triton's interpreter (TRITON_INTERPRET=1) on CPU
tensors, where bf16 arithmetic is wrong: test there in fp32 and fp16 (bf16 is upcast to fp32 after loading).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

MIN_DOT = 16  # tensor-core dots need every dimension >= 16
SPLIT_K_MAX_T = 64  # more tokens than this: enough token tiles to fill the GPU, `in` is not split
SPLIT_K_MAX = 16
PROGRAMS_PER_SM = 4  # split-K aims at this many programs per SM
INTERPRETER_SPLIT_K = 2  # the interpreter has no SMs to fill: a fixed split, so the tests run the split path
SHRINK_BLOCK_K = 64  # input columns per shrink step
MAX_BLOCK = 64  # rank and output columns per program


@triton.jit
def _runs(slot_ptr, T, BLOCK_T: tl.constexpr):
    """The program's block of tokens: (their rows, in range, slots, run index of each, number of runs). A run is
    a stretch of consecutive tokens on one slot; rows past T join the last run and are masked by `ok`."""
    start = tl.program_id(0) * BLOCK_T
    t = start + tl.arange(0, BLOCK_T)
    ok = t < T
    slot = tl.load(slot_ptr + t, mask=ok, other=0)
    prev = tl.load(slot_ptr + t - 1, mask=ok & (t > start), other=-1)
    starts = (ok & (slot != prev)).to(tl.int32)
    run = tl.cumsum(starts, axis=0) - 1
    return t.to(tl.int64), ok, slot, run, tl.sum(starts, axis=0)


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, slot_ptr, h_ptr,
    T, stride_xt, stride_as, stride_ar, stride_hs, stride_ht,
    IN: tl.constexpr, R: tl.constexpr, K_PER_SPLIT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """h (or split pid_k's fp32 partial) for a [BLOCK_T, BLOCK_R] tile over input columns
    [pid_k * K_PER_SPLIT, + K_PER_SPLIT)."""
    t, ok, slot, run, num_runs = _runs(slot_ptr, T, BLOCK_T)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < R
    k_start = tl.program_id(2) * K_PER_SPLIT
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for i in range(0, num_runs):
        rows = ok & (run == i)
        s = tl.max(tl.where(rows, slot, 0), axis=0).to(tl.int64)
        if s != 0:  # the base's tokens keep h = 0
            for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                k_ok = k < IN
                # The other runs' rows load as zeros: they add nothing to this run's dot.
                x = tl.load(x_ptr + t[:, None] * stride_xt + k[None, :], mask=rows[:, None] & k_ok[None, :],
                            other=0.0)
                a = tl.load(a_ptr + s * stride_as + r[None, :] * stride_ar + k[:, None],
                            mask=r_ok[None, :] & k_ok[:, None], other=0.0)  # A[s]^T: [BLOCK_K, BLOCK_R]
                if UPCAST:
                    x, a = x.to(tl.float32), a.to(tl.float32)
                acc += tl.dot(x, a, input_precision=DOT_PRECISION)
    h = h_ptr + tl.program_id(2) * stride_hs + t[:, None] * stride_ht + r[None, :]
    tl.store(h, acc.to(h_ptr.dtype.element_ty), mask=ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(
    h_ptr, b_ptr, slot_ptr, y_ptr,
    T, offset, stride_ht, stride_bs, stride_bo, stride_yt,
    OUT: tl.constexpr, R: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """y[t, offset + n] += (B[slot(t)] @ h[t])[n] for a [BLOCK_T, BLOCK_N] tile; the base's rows are left alone."""
    t, ok, slot, run, num_runs = _runs(slot_ptr, T, BLOCK_T)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < OUT
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for i in range(0, num_runs):
        rows = ok & (run == i)
        s = tl.max(tl.where(rows, slot, 0), axis=0).to(tl.int64)
        if s != 0:
            for r0 in range(0, R, BLOCK_R):
                r = r0 + tl.arange(0, BLOCK_R)
                r_ok = r < R
                h = tl.load(h_ptr + t[:, None] * stride_ht + r[None, :], mask=rows[:, None] & r_ok[None, :],
                            other=0.0)
                b = tl.load(b_ptr + s * stride_bs + n[None, :] * stride_bo + r[:, None],
                            mask=n_ok[None, :] & r_ok[:, None], other=0.0)  # B[s]^T: [BLOCK_R, BLOCK_N]
                if UPCAST:
                    h, b = h.to(tl.float32), b.to(tl.float32)
                acc += tl.dot(h, b, input_precision=DOT_PRECISION)
    live = ok & (slot != 0)  # the base's rows are neither read nor written
    y = y_ptr + t[:, None] * stride_yt + offset + n[None, :]
    mask = live[:, None] & n_ok[None, :]
    old = tl.load(y, mask=mask, other=0.0)
    # The delta is rounded to y's dtype before the add, as the torch path's `y += delta.to(y.dtype)` rounds it.
    delta = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y, (old.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


# Triton picks interpreter or compiler as each function is decorated (see attention/triton_kernels.py).
INTERPRETED = isinstance(_shrink_kernel, InterpretedFunction)
INTERPRETER_READY = INTERPRETED and isinstance(tl.sum, InterpretedFunction)


# -- wrappers ----------------------------------------------------------------------------------------
@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _block_t(num_tokens: int) -> int:
    """Decode-sized steps: the dot's minimum; prompts: 64 rows per weight tile read."""
    return MIN_DOT if num_tokens <= SPLIT_K_MAX_T else 64


def _block(n: int) -> int:
    return min(MAX_BLOCK, max(MIN_DOT, triton.next_power_of_2(n)))


def _shrink_plan(num_tokens: int, rank: int, fan_in: int, device: torch.device) -> tuple[int, int]:
    """(split, input columns per split: a whole number of SHRINK_BLOCK_K tiles). Decode-sized steps split `in`
    until there are PROGRAMS_PER_SM programs per SM, each split keeping >= 2 tiles; larger steps do not."""
    k_tiles = triton.cdiv(fan_in, SHRINK_BLOCK_K)
    if num_tokens > SPLIT_K_MAX_T:
        split = 1
    elif INTERPRETED:
        split = min(INTERPRETER_SPLIT_K, k_tiles)
    else:
        tiles = triton.cdiv(num_tokens, _block_t(num_tokens)) * triton.cdiv(rank, _block(rank))
        split = max(1, min(SPLIT_K_MAX, triton.cdiv(PROGRAMS_PER_SM * _sm_count(device), tiles), k_tiles // 2))
    per_split = triton.cdiv(k_tiles, split)
    return triton.cdiv(k_tiles, per_split), per_split * SHRINK_BLOCK_K  # no empty split


def _check(act: torch.Tensor, weights: torch.Tensor, token_slots: torch.Tensor) -> tuple[bool, str]:
    """The shapes, dtypes and devices both kernels assume; returns (upcast, dot precision)."""
    assert act.dim() == 2 and act.stride(1) == 1, (act.shape, act.stride())
    assert weights.dim() == 3 and weights.stride(2) == 1, (weights.shape, weights.stride())
    assert act.dtype == weights.dtype and act.dtype in (torch.float16, torch.bfloat16, torch.float32), \
        (act.dtype, weights.dtype)
    assert token_slots.shape == (act.shape[0],) and token_slots.dtype in (torch.int32, torch.int64), \
        f"token_slots {tuple(token_slots.shape)} {token_slots.dtype}, want ({act.shape[0]},) int32/int64"
    assert token_slots.is_contiguous()
    devices = {act.device, weights.device, token_slots.device}
    assert len(devices) == 1, f"LoRA tensors on different devices: {sorted(map(str, devices))}"
    assert INTERPRETED or act.device.type == "cuda", \
        f"the compiled LoRA kernels run on CUDA tensors, not {act.device} (CPU only in Triton's interpreter)"
    upcast = act.dtype == torch.float32 or (INTERPRETED and act.dtype == torch.bfloat16)
    return upcast, "ieee" if upcast else "tf32"


def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """x [T, in], a [slots, rank, in], token_slots [T] -> h [T, rank] in x's dtype (zero on slot 0's tokens)."""
    upcast, precision = _check(x, a, token_slots)
    t, fan_in = x.shape
    rank = a.shape[1]
    assert a.shape[2] == fan_in, (a.shape, x.shape)
    h = torch.empty((t, rank), dtype=x.dtype, device=x.device)
    if t == 0:
        return h
    split, per_split = _shrink_plan(t, rank, fan_in, x.device)
    out = h if split == 1 else torch.empty((split, t, rank), dtype=torch.float32, device=x.device)
    block_t, block_r = _block_t(t), _block(rank)
    _shrink_kernel[(triton.cdiv(t, block_t), triton.cdiv(rank, block_r), split)](
        x, a, token_slots, out,
        t, x.stride(0), a.stride(0), a.stride(1), out.stride(0) if split > 1 else 0, out.stride(-2),
        IN=fan_in, R=rank, K_PER_SPLIT=per_split, BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_K=SHRINK_BLOCK_K,
        UPCAST=upcast, DOT_PRECISION=precision,
    )
    if split > 1:
        h.copy_(out.sum(dim=0))  # in split order: the same h every run (no atomics)
    return h


def lora_expand_(h: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, y: torch.Tensor,
                 offset: int = 0) -> None:
    """y[:, offset:offset + out] += B[slot(t)] @ h[t] in place. h [T, rank] (may be a column slice of the shrink's
    output), b [slots, out, rank], y [T, >= offset + out] of h's dtype."""
    upcast, precision = _check(h, b, token_slots)
    t, rank = h.shape
    out = b.shape[1]
    assert b.shape[2] == rank, (b.shape, h.shape)
    assert y.dim() == 2 and y.shape[0] == t and y.stride(1) == 1 and y.dtype == h.dtype, (y.shape, y.dtype)
    assert 0 <= offset and offset + out <= y.shape[1], (offset, out, y.shape)
    if t == 0:
        return
    block_t, block_n = _block_t(t), _block(out)
    _expand_kernel[(triton.cdiv(t, block_t), triton.cdiv(out, block_n))](
        h, b, token_slots, y,
        t, offset, h.stride(0), b.stride(0), b.stride(1), y.stride(0),
        OUT=out, R=rank, BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_R=_block(rank),
        UPCAST=upcast, DOT_PRECISION=precision,
    )
