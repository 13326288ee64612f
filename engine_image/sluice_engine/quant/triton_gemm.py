"""Triton GEMM kernels for weight-only quantized linear layers: y = x @ dequant(W)^T, dequantized in the kernel.

- `fp8_linear`: FP8 e4m3 weights [N, K] (the checkpoint's nn.Linear layout) with one fp32 scale per tensor or
  per output channel. GPUs with e4m3 conversions (sm89+: L4, H100, H200; and the interpreter) load them as
  e4m3; older ones (Triton refuses the e4m3 type there) read the bytes and decode the bits with integer
  arithmetic (E4M3_BITS): the same values, a few more instructions on a memory-bound load.
- `awq_linear`: AWQ 4-bit, qweight [K, N/8] int32 packed along N in AWQ's interleaved nibble order,
  scales [K/G, N], qzeros [K/G, N/8] packed the same way as qweight; w = (q - z) * s.
- `gptq_linear`: GPTQ 4-bit (v1 / GPTQ-for-LLaMa / AutoGPTQ format), qweight [K/8, N] int32 packed along K in
  order (nibble i of row r is k = 8r + i), scales [K/G, N], qzeros [K/G, N/8] packed along N in order and
  stored minus one; w = (q - (z + 1)) * s, with the group of input row k given by g_idx[k] (act-order) or k // G.

The plain-torch twins (dequantize_* in fp8.py, awq.py, gptq.py) are the references the tests hold these to.

Activations are fp16/bf16 (or fp32); the dequantized tile is cast to the activation dtype and fed to the dot
with an fp32 accumulator, so fp16/bf16 use tensor cores. fp32 activations use IEEE fp32 dots (no TF32). The
module imports only torch and triton, so it runs in Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors,
where bf16 arithmetic is wrong: there bf16 is upcast to fp32 right after loading.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

PACK = 8  # 4-bit values per int32
MIN_DOT = 16  # tensor-core dots need every dimension >= 16


@triton.jit
def _e4m3_bits_to_f32(b):
    """e4m3fn bytes (sign, 4 exponent bits biased by 7, 3 mantissa bits; no infinities) -> their fp32 values.
    Normal: the fp32 with exponent e - 7 + 127 and the mantissa bits on top; subnormal (e = 0): m * 2^-9."""
    b = b.to(tl.int32)
    e = (b >> 3) & 0xF
    m = b & 0x7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def _f32_to_e4m3_bits(x):
    """fp32 values already within +-448 -> their e4m3fn bytes (uint8), rounded to nearest, ties to even: the
    bytes torch's `.to(torch.float8_e4m3fn)` gives. The inverse of `_e4m3_bits_to_f32`, for writers (the FP8
    KV cache) on GPUs without e4m3 conversions, and in Triton's interpreter, whose own fp32 -> e4m3 cast rounds
    ties away from zero and flushes subnormals. NaN is not preserved (callers saturate first).
    Normal (|x| >= 2^-6): the fp32 bits rounded at mantissa bit 20 (adding 0x7FFFF plus the kept lowest bit
    rounds ties to even; a carry moves into the exponent, as it should), then the exponent rebiased from 127 to
    7. Subnormal: m * 2^-9 with m = round(|x| * 512) in 0..8 (8 is the byte of 2^-6, the smallest normal)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    y = (a.to(tl.float32, bitcast=True)) * 512.0  # exact: a power of two
    m = y.to(tl.int32)  # y >= 0: truncation is floor
    frac = y - m.to(tl.float32)
    m = m + ((frac > 0.5) | ((frac == 0.5) & ((m & 1) == 1))).to(tl.int32)
    mag = tl.where(a >= (121 << 23), normal, m)
    return (mag | sign).to(tl.uint8)


@triton.jit
def _fp8_gemm_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    E4M3_BITS: tl.constexpr,  # w_ptr is the e4m3 bytes as uint8: decode the bits (GPUs without e4m3 types)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        # The [BLOCK_K, BLOCK_N] tile of W^T, read from W [N, K].
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
        if E4M3_BITS:
            w = _e4m3_bits_to_f32(w)
        # NOTE: the scale is applied to the accumulator after the loop (it is constant along K), so the
        # dot sees e4m3 values exactly representable in fp16/bf16.
        acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
    if PER_CHANNEL:
        s = tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)
        acc = acc * s[None, :]
    else:
        acc = acc * tl.load(scale_ptr)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _w4_gemm_kernel(
    x_ptr, qw_ptr, scales_ptr, qzeros_ptr, g_idx_ptr, bias_ptr, y_ptr,
    M, N, K, GROUP,
    stride_xm, stride_xk, stride_qwr, stride_qwc, stride_sg, stride_sn, stride_zg, stride_zc,
    stride_ym, stride_yn,
    AWQ: tl.constexpr,  # True: AWQ layout; False: GPTQ v1 layout (see the module docstring)
    HAS_G_IDX: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    if AWQ:
        # AWQ packs columns 8c..8c+7 into int32 c with logical column j at nibble [0, 4, 1, 5, 2, 6, 3, 7][j]
        # (the inverse of its pack order [0, 2, 4, 6, 1, 3, 5, 7]): nibble = j // 2 + 4 * (j % 2).
        j = offs_n % 8
        n_shift = ((j // 2) + 4 * (j % 2)) * 4
    else:
        n_shift = (offs_n % 8) * 4  # GPTQ qzeros: in order
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        kn_ok = k_ok[:, None] & n_ok[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
        if HAS_G_IDX:
            g = tl.load(g_idx_ptr + offs_k, mask=k_ok, other=0)
        else:
            g = offs_k // GROUP
        # Each packed int32 is read by the 8 lanes that share it (the cache serves the repeats).
        if AWQ:
            packed = tl.load(qw_ptr + offs_k[:, None] * stride_qwr + (offs_n // 8)[None, :] * stride_qwc,
                             mask=kn_ok, other=0)
            q = (packed >> n_shift[None, :]) & 0xF
        else:
            packed = tl.load(qw_ptr + (offs_k // 8)[:, None] * stride_qwr + offs_n[None, :] * stride_qwc,
                             mask=kn_ok, other=0)
            q = (packed >> ((offs_k % 8) * 4)[:, None]) & 0xF
        zp = tl.load(qzeros_ptr + g[:, None] * stride_zg + (offs_n // 8)[None, :] * stride_zc, mask=kn_ok, other=0)
        z = (zp >> n_shift[None, :]) & 0xF
        if not AWQ:
            z = z + 1  # GPTQ v1 stores zero - 1
        s = tl.load(scales_ptr + g[:, None] * stride_sg + offs_n[None, :] * stride_sn, mask=kn_ok, other=0.0)
        w = (q - z).to(tl.float32) * s.to(tl.float32)
        acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


INTERPRETED = isinstance(_w4_gemm_kernel, InterpretedFunction)
INTERPRETER_READY = INTERPRETED and isinstance(tl.sum, InterpretedFunction)


def _tiles(M: int, N: int, K: int) -> tuple[int, int, int]:
    """Tile sizes: a 16-row tile for decode-sized M (the dot's minimum), larger ones as M grows."""
    bm = MIN_DOT if M <= 16 else (32 if M <= 32 else 64)
    bn = 64 if N >= 64 else max(MIN_DOT, triton.next_power_of_2(N))
    bk = 32 if K % 64 else 64
    if INTERPRETED:  # the interpreter pays per program, not per element
        bm = min(triton.next_power_of_2(max(M, MIN_DOT)), 64)
    return bm, bn, bk


def _check_x(x: torch.Tensor, k: int, *weights: torch.Tensor | None) -> tuple[torch.Tensor, tuple[int, ...]]:
    assert x.shape[-1] == k, f"activations have {x.shape[-1]} features, the weight takes {k}"
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), x.dtype
    # A compiled kernel reads GPU memory only (Triton's own error for a CPU tensor names neither tensor nor
    # layer); the interpreter reads CPU tensors. The engine moves a layer's weights with the model
    # (QuantLinear._apply); this names the mix-up if anything ever hands the kernel tensors that were not moved.
    devices = {t.device for t in (x, *weights) if t is not None}
    assert len(devices) == 1, f"activations and weights on different devices: {sorted(map(str, devices))}"
    assert INTERPRETED or x.device.type == "cuda", \
        f"the compiled Triton GEMM runs on CUDA tensors, not {x.device} (CPU only in Triton's interpreter)"
    lead = x.shape[:-1]
    return x.reshape(-1, k), lead


def _dot_mode(x: torch.Tensor) -> tuple[bool, str]:
    upcast = x.dtype == torch.float32 or (INTERPRETED and x.dtype == torch.bfloat16)
    return upcast, "ieee" if upcast else "tf32"


@functools.cache
def _e4m3_native(device: torch.device) -> bool:
    """Whether Triton has the e4m3 type on `device`: CUDA compute capability 8.9+, other backends (ROCm) and
    the interpreter."""
    if device.type != "cuda" or torch.version.hip is not None:
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, decode_bits: bool | None = None) -> torch.Tensor:
    """x [..., K] @ (weight [N, K] e4m3 * weight_scale)^T; weight_scale: one element or [N] (fp32).
    decode_bits: decode the e4m3 bytes with integer arithmetic; None: where the GPU lacks the e4m3 type."""
    assert weight.dtype == torch.float8_e4m3fn and weight.dim() == 2, (weight.dtype, weight.shape)
    n, k = weight.shape
    x2, lead = _check_x(x, k, weight, weight_scale, bias)
    scale = weight_scale.reshape(-1).to(torch.float32)
    assert scale.numel() in (1, n), f"weight_scale has {scale.numel()} elements; want 1 or {n}"
    assert bias is None or bias.shape == (n,)
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bm, bn, bk = _tiles(m, n, k)
    upcast, precision = _dot_mode(x)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    if decode_bits is None:
        decode_bits = not _e4m3_native(weight.device)
    _fp8_gemm_kernel[grid](
        x2, weight.view(torch.uint8) if decode_bits else weight, scale, bias if bias is not None else scale, y,
        m, n, k, x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1),
        PER_CHANNEL=scale.numel() == n and n > 1, HAS_BIAS=bias is not None, UPCAST=upcast,
        DOT_PRECISION=precision, E4M3_BITS=decode_bits, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return y.reshape(*lead, n)


def _w4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
               g_idx: torch.Tensor | None, bias: torch.Tensor | None, *, awq: bool) -> torch.Tensor:
    assert qweight.dtype == qzeros.dtype == torch.int32, (qweight.dtype, qzeros.dtype)
    groups, n = scales.shape
    k = qweight.shape[0] if awq else qweight.shape[0] * PACK
    want_qw = (k, n // PACK) if awq else (k // PACK, n)
    assert n % PACK == 0 and tuple(qweight.shape) == want_qw, (qweight.shape, want_qw)
    assert tuple(qzeros.shape) == (groups, n // PACK), (qzeros.shape, groups, n)
    # With g_idx the groups need not tile K: a row-parallel slice keeps every group's scales (gptq.py).
    assert g_idx is not None or k % groups == 0, f"K={k} is not a whole number of {groups} groups"
    assert g_idx is None or (not awq and g_idx.shape == (k,)), "g_idx: GPTQ only, one group per input row"
    assert bias is None or bias.shape == (n,)
    x2, lead = _check_x(x, k, qweight, scales, qzeros, g_idx, bias)
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bm, bn, bk = _tiles(m, n, k)
    upcast, precision = _dot_mode(x)
    g = g_idx.to(torch.int32) if g_idx is not None else qzeros  # a placeholder pointer when absent
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _w4_gemm_kernel[grid](
        x2, qweight, scales, qzeros, g, bias if bias is not None else scales, y, m, n, k, max(1, k // groups),
        x2.stride(0), x2.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
        qzeros.stride(0), qzeros.stride(1), y.stride(0), y.stride(1),
        AWQ=awq, HAS_G_IDX=g_idx is not None, HAS_BIAS=bias is not None, UPCAST=upcast,
        DOT_PRECISION=precision, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return y.reshape(*lead, n)


def awq_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequant_awq(qweight [K, N/8], scales [K/G, N], qzeros [K/G, N/8])."""
    return _w4_linear(x, qweight, scales, qzeros, None, bias, awq=True)


def gptq_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
                g_idx: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequant_gptq(qweight [K/8, N], scales [K/G, N], qzeros [K/G, N/8], g_idx [K])."""
    return _w4_linear(x, qweight, scales, qzeros, g_idx, bias, awq=False)
