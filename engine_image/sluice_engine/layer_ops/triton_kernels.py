"""Triton kernels for a decoder layer's small ops, one launch each, and thin wrappers that check shapes and
strides, then launch. `torch_ops.TorchLayerOps` is the reference each is held to.

- `rms_norm`: one program per row (or per (token, head) of a [T, H, D] view, for Qwen3's q/k norm).
- `fused_add_rms_norm`: residual + x and the RMSNorm of the sum in one pass; writes both.
- `rotary_`: rotates a token's query and key heads (side by side in the fused QKV output) in place.
- `silu_and_mul`: silu(gate) * up from a merged [T, 2I] gate/up projection.

Each program holds whole rows in registers, so a row is read once. Arithmetic is fp32; where the reference
rounds an intermediate to the activation dtype (the residual sum, the normed row before its weight, silu
before the multiply), so do these kernels, so that fp16/bf16 results differ from it only by the order of the
norm's sum. The module imports only torch and triton, so it also runs in Triton's interpreter
(TRITON_INTERPRET=1) on CPU tensors, where bf16 arithmetic is unreliable: test there in fp32 and fp16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# Columns per SiLU-and-multiply program.
SILU_BLOCK = 1024


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_xt, stride_xh, stride_rt, stride_ot, stride_oh, stride_st,
    eps,
    N: tl.constexpr, BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)  # head of a [T, H, N] input; 0 for [T, N]
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + t * stride_rt + cols, mask=mask, other=0.0).to(tl.float32)
        # The stream is held in the activation dtype: round the sum, store it, normalize the rounded value.
        s = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + t * stride_st + cols, s, mask=mask)
        x = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    # Round the normed row to the weight's dtype before the multiply, as the reference does (a no-op in fp32).
    y = (x * rstd).to(w.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr,
    stride_xt, stride_xh, stride_ct, stride_st,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """One program per token, every head: dims d and d + HALF form a pair ("rotate half", HF's layout)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    mask = (h[:, None] < NUM_HEADS) & d_ok[None, :]
    cos = tl.load(cos_ptr + t * stride_ct + d, mask=d_ok, other=0.0)[None, :]
    sin = tl.load(sin_ptr + t * stride_st + d, mask=d_ok, other=0.0)[None, :]
    first = x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :]
    second = first + HALF
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(second, mask=mask, other=0.0).to(tl.float32)
    # Each element is read and written by this program only: rotating in place is safe.
    tl.store(first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(second, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_xt, stride_ot,
    INTER: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(x_ptr + t * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_xt + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    # silu is rounded to the activation dtype before the multiply, as F.silu(gate) * up rounds it.
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


# Triton picks interpreter or compiler as each function is decorated (see attention/triton_kernels.py).
INTERPRETED = isinstance(_rms_norm_kernel, InterpretedFunction)
INTERPRETER_READY = INTERPRETED and isinstance(tl.sum, InterpretedFunction)


# -- wrappers ----------------------------------------------------------------------------------------
def _row_warps(block: int) -> int:
    """Warps for one program holding `block` elements of a row: ~8-16 elements per thread."""
    return max(1, min(16, block // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, N], or [T, H, N] (e.g. a strided view of query heads); weight: [N] of x's dtype. Returns a
    new contiguous tensor of x's shape."""
    assert x.dim() in (2, 3) and x.stride(-1) == 1, (x.shape, x.stride())
    n = x.shape[-1]
    assert weight.shape == (n,) and weight.dtype == x.dtype, (weight.shape, weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    heads = x.shape[1] if x.dim() == 3 else 1
    if x.numel() == 0:
        return out
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x.shape[0], heads)](
        x, x, weight, out, out,  # no residual: its pointers are placeholders
        x.stride(0), x.stride(1) if x.dim() == 3 else 0, 0,
        out.stride(0), out.stride(1) if x.dim() == 3 else 0, 0,
        eps, N=n, BLOCK_N=block, HAS_RESIDUAL=False, num_warps=_row_warps(block),
    )
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, N]; weight: [N]. Returns (RMSNorm(residual + x) * weight, residual + x), both new."""
    assert x.dim() == 2 and residual.shape == x.shape and residual.dtype == x.dtype, (x.shape, residual.shape)
    assert x.stride(1) == 1 and residual.stride(1) == 1, (x.stride(), residual.stride())
    t, n = x.shape
    assert weight.shape == (n,) and weight.dtype == x.dtype, (weight.shape, weight.dtype, x.dtype)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    new_residual = torch.empty_like(out)
    if t == 0:
        return out, new_residual
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(t, 1)](
        x, residual, weight, out, new_residual,
        x.stride(0), 0, residual.stride(0), out.stride(0), 0, new_residual.stride(0),
        eps, N=n, BLOCK_N=block, HAS_RESIDUAL=True, num_warps=_row_warps(block),
    )
    return out, new_residual


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] in place by cos/sin ([T, 1, D/2] or [T, D/2], fp32); returns x. Heads may be a
    strided view (the Q and K columns of the fused QKV output)."""
    t, h, d = x.shape
    half = d // 2
    assert d % 2 == 0 and x.stride(2) == 1, (x.shape, x.stride())
    assert cos.shape == sin.shape and cos.shape in ((t, 1, half), (t, half)), (cos.shape, sin.shape, x.shape)
    cos, sin = cos.reshape(t, half), sin.reshape(t, half)
    assert cos.dtype == sin.dtype == torch.float32 and cos.stride(1) == 1 and sin.stride(1) == 1
    if t == 0:
        return x
    block_h, block_half = triton.next_power_of_2(h), triton.next_power_of_2(half)
    _rotary_kernel[(t,)](
        x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
        NUM_HEADS=h, HALF=half, BLOCK_H=block_h, BLOCK_HALF=block_half,
        num_warps=_row_warps(block_h * block_half),
    )
    return x


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I], gate columns first. Returns silu(gate) * up, [T, I]."""
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and gate_up.stride(1) == 1, (gate_up.shape,)
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = min(SILU_BLOCK, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(t, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), INTER=inter, BLOCK=block, num_warps=_row_warps(block),
    )
    return out
