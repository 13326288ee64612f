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

Decode-sized M (<= SPLIT_K_MAX_M rows) splits K (`_plan`): a grid of (row tiles, column tiles, K splits) with
about PROGRAMS_PER_SM programs per SM, each writing fp32 partials [split, M, N] that `_split_k_sum_kernel` sums
in split order (+ bias), so outputs are the same every run (no atomics). The split depends only on the shape
and the GPU. Larger M keep one program per output tile. The 4-bit kernel loads each packed tile once (AWQ
[BLOCK_K, BLOCK_N / 8], GPTQ [BLOCK_K / 8, BLOCK_N] int32) and widens it by broadcasting shifts; without g_idx,
where a K tile lies in one group, it loads one row of zeros and scales per tile, forms q - z in the dot's dtype
from bits (no int -> float conversion per weight) and scales the tile's dot by the group's scales.

NOTE: the H200 figures that motivated this (benchmarks/quant_gpu.py, Llama-8B shapes, M = 1 and 16, eager):
AWQ 0.61-2.14 ms (14-24 GB/s of weights, 0.02-0.04x bf16 cuBLAS), FP8 0.036-0.115 ms (0.26-0.84x bf16), with
grids of cdiv(M, 16) x cdiv(N, 64) programs (64 for N = 4096) each reading all of K, and the 4-bit kernel
gathering every packed int32, zero and scale per weight. Figures after split-K and the packed-tile loads: to
be re-measured on the H200.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

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
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ys, stride_ym, stride_yn,
    PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    E4M3_BITS: tl.constexpr,  # w_ptr is the e4m3 bytes as uint8: decode the bits (GPUs without e4m3 types)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of y over input rows [pid_k * K_PER_SPLIT, + K_PER_SPLIT) (split-K: y_ptr is
    then the fp32 partials [SPLIT_K, M, N], summed by _split_k_sum_kernel; unsplit, K_PER_SPLIT >= K)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * K_PER_SPLIT
    for k0 in range(k_begin, tl.minimum(k_begin + K_PER_SPLIT, K), BLOCK_K):
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
    tl.store(y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _unpack_cols(packed, shifts, ROWS: tl.constexpr, COLS: tl.constexpr):
    """[ROWS, COLS // 8] int32, 8 nibbles each -> [ROWS, COLS]: column 8c + j is nibble shifts[j] // 4 of c.
    The packed tile is loaded once and widened here (shift a broadcast [ROWS, COLS // 8, 8], then reshape)."""
    return tl.reshape((packed[:, :, None] >> shifts[None, None, :]) & 0xF, (ROWS, COLS))


@triton.jit
def _w4_gemm_kernel(
    x_ptr, qw_ptr, scales_ptr, qzeros_ptr, g_idx_ptr, bias_ptr, y_ptr,
    M, N, K, GROUP, K_PER_SPLIT,
    stride_xm, stride_xk, stride_qwr, stride_qwc, stride_sg, stride_sn, stride_zg, stride_zc,
    stride_ys, stride_ym, stride_yn,
    AWQ: tl.constexpr,  # True: AWQ layout; False: GPTQ v1 layout (see the module docstring)
    HAS_G_IDX: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    GROUP_TILES: tl.constexpr,  # no g_idx and BLOCK_K divides GROUP: each K tile lies in one group
    MAGIC_BITS: tl.constexpr, MAGIC: tl.constexpr, MAGIC_INT16: tl.constexpr,  # see _w4_plan's magic
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of y over input rows [pid_k * K_PER_SPLIT, + K_PER_SPLIT), as the FP8 kernel.
    Per K tile: the packed weights once (AWQ [BLOCK_K, BLOCK_N / 8], GPTQ [BLOCK_K / 8, BLOCK_N] int32), and
    with GROUP_TILES one row of zeros and scales (the tile's group); otherwise (act-order g_idx, or groups
    smaller than a tile) a row of them per input row."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)  # packed columns (AWQ qweight, qzeros)
    m_ok = offs_m < M
    n_ok = offs_n < N
    c_ok = offs_c < N // 8
    nibble = tl.arange(0, 8)
    if AWQ:
        # AWQ packs columns 8c..8c+7 into int32 c with logical column j at nibble [0, 4, 1, 5, 2, 6, 3, 7][j]
        # (the inverse of its pack order [0, 2, 4, 6, 1, 3, 5, 7]): nibble = j // 2 + 4 * (j % 2).
        col_shift = ((nibble // 2) + 4 * (nibble % 2)) * 4
    else:
        col_shift = nibble * 4  # GPTQ qzeros: in order
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * K_PER_SPLIT
    for k0 in range(k_begin, tl.minimum(k_begin + K_PER_SPLIT, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
        if AWQ:
            packed = tl.load(qw_ptr + offs_k[:, None] * stride_qwr + offs_c[None, :] * stride_qwc,
                             mask=k_ok[:, None] & c_ok[None, :], other=0)
            q = _unpack_cols(packed, col_shift, BLOCK_K, BLOCK_N)
        else:
            offs_r = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # k0 is a multiple of BLOCK_K, itself of 8
            packed = tl.load(qw_ptr + offs_r[:, None] * stride_qwr + offs_n[None, :] * stride_qwc,
                             mask=(offs_r < K // 8)[:, None] & n_ok[None, :], other=0)
            q = tl.reshape((packed[:, None, :] >> (nibble * 4)[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        if GROUP_TILES:
            g = k0 // GROUP
            zp = tl.load(qzeros_ptr + g * stride_zg + offs_c[None, :] * stride_zc, mask=c_ok[None, :], other=0)
            z = _unpack_cols(zp, col_shift, 1, BLOCK_N)
            if not AWQ:
                z = z + 1  # GPTQ v1 stores zero - 1
            # q - z exactly in x's dtype without an int -> float conversion per weight (a quarter-rate
            # instruction, slower than reading 4 bits): q under the mantissa of MAGIC is the float MAGIC + q.
            bits = q | MAGIC_BITS
            if MAGIC_INT16:
                bits = bits.to(tl.int16)
            w = bits.to(x.dtype, bitcast=True) - (z.to(tl.float32) + MAGIC).to(x.dtype)
            s = tl.load(scales_ptr + g * stride_sg + offs_n * stride_sn, mask=n_ok, other=0.0)
            # NOTE: the group's scale multiplies the tile's dot (constant along the tile's K), not each weight.
            acc += tl.dot(x, w, input_precision=DOT_PRECISION) * s.to(tl.float32)[None, :]
        else:
            if HAS_G_IDX:
                g = tl.load(g_idx_ptr + offs_k, mask=k_ok, other=0)
            else:
                g = offs_k // GROUP
            zp = tl.load(qzeros_ptr + g[:, None] * stride_zg + offs_c[None, :] * stride_zc,
                         mask=k_ok[:, None] & c_ok[None, :], other=0)
            z = _unpack_cols(zp, col_shift, BLOCK_K, BLOCK_N)
            if not AWQ:
                z = z + 1
            s = tl.load(scales_ptr + g[:, None] * stride_sg + offs_n[None, :] * stride_sn,
                        mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            w = (q - z).to(tl.float32) * s.to(tl.float32)
            acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _split_k_sum_kernel(p_ptr, bias_ptr, y_ptr, MN, N, SPLIT_K, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """y [M, N] (contiguous) = the sum of the fp32 partials [SPLIT_K, M, N] in split order (+ bias): the same
    sums every run, unlike atomics."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.load(p_ptr + offs, mask=ok, other=0.0)
    for s in range(1, SPLIT_K):
        acc += tl.load(p_ptr + s * MN + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


INTERPRETED = isinstance(_w4_gemm_kernel, InterpretedFunction)
INTERPRETER_READY = INTERPRETED and isinstance(tl.sum, InterpretedFunction)

SPLIT_K_MAX_M = 64  # M above this: enough row tiles to fill the GPU, K is not split
SPLIT_K_MAX = 16
PROGRAMS_PER_SM = 4  # split-K aims at this many programs per SM (latency hidden by programs in flight)
INTERPRETER_SPLIT_K = 3  # the interpreter has no SMs to fill: a fixed split, so the tests run the split-K path
SUM_BLOCK = 1024


@dataclass(frozen=True, slots=True)
class _Plan:
    """One launch's tiles, its K split and its compile options. split_k > 1: each of split_k programs per output
    tile reads k_per_split input rows (a whole number of block_k tiles) into fp32 partials, summed afterwards."""
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    k_per_split: int
    num_warps: int
    num_stages: int

    def grid(self, m: int, n: int) -> tuple[int, int, int]:
        return triton.cdiv(m, self.block_m), triton.cdiv(n, self.block_n), self.split_k


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _block_k(k: int) -> int:
    """The decode K tile: 128 where it tiles K (larger M take 64 of it), else the largest of 64 and 32 that does."""
    return 128 if k % 128 == 0 else (64 if k % 64 == 0 else 32)


def _plan(m: int, n: int, k: int, device: torch.device, weight_bytes: int, *, block_n: int, block_k: int) -> _Plan:
    """Decode-sized M (<= SPLIT_K_MAX_M): a 16-row tile (the dot's minimum) and the caller's decode tiles, with K
    split until there are PROGRAMS_PER_SM programs per SM (unsplit, M = 1 and N = 4096 in 64-column tiles are
    64 programs for an H200's 132 SMs, each reading all of K alone); each split keeps >= 2 K tiles, and the fp32
    partials (split_k * M * N * 4 bytes, written and read back, mostly in L2) stay within half the weight bytes.
    Larger M: 64 x 64 x min(block_k, 64) tiles with Triton's default 4 warps and 3 stages, unsplit."""
    if m > SPLIT_K_MAX_M:
        bk = min(block_k, 64)
        return _Plan(64, 64, bk, 1, triton.cdiv(k, bk) * bk, num_warps=4, num_stages=3)
    bm = MIN_DOT if m <= 16 else (32 if m <= 32 else 64)
    bn = block_n if n >= block_n else max(MIN_DOT, triton.next_power_of_2(n))
    k_tiles = triton.cdiv(k, block_k)
    if INTERPRETED:  # the interpreter pays per program, not per element
        bm = min(triton.next_power_of_2(max(m, MIN_DOT)), 64)
        split = min(INTERPRETER_SPLIT_K, k_tiles)
    else:
        tiles_mn = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        split = min(SPLIT_K_MAX, triton.cdiv(PROGRAMS_PER_SM * _sm_count(device), tiles_mn), k_tiles // 2,
                    weight_bytes // (2 * 4 * max(1, m * n)))
        split = max(1, split)
    tiles_per_split = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, tiles_per_split)  # no empty split
    return _Plan(bm, bn, block_k, split, tiles_per_split * block_k, num_warps=4, num_stages=4)


def _output(plan: _Plan, m: int, n: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """(y [M, N], what the GEMM kernel writes: y itself or fp32 partials [split_k, M, N], that one's strides)."""
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if plan.split_k == 1:
        return y, y, (0, y.stride(0), y.stride(1))
    partials = torch.empty((plan.split_k, m, n), dtype=torch.float32, device=x.device)
    return y, partials, partials.stride()


def _sum_partials(partials: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> None:
    split, m, n = partials.shape
    _split_k_sum_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](
        partials, bias if bias is not None else partials, y, m * n, n, split, HAS_BIAS=bias is not None,
        BLOCK=SUM_BLOCK, num_warps=4)


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
    # Decode: 64 output columns x 128 input rows of e4m3 (8 KiB, 128 contiguous bytes per weight row) a tile.
    plan = _plan(m, n, k, x.device, n * k, block_n=64, block_k=_block_k(k))
    y, out, out_strides = _output(plan, m, n, x)
    upcast, precision = _dot_mode(x)
    if decode_bits is None:
        decode_bits = not _e4m3_native(weight.device)
    bias_in_kernel = bias is not None and plan.split_k == 1
    _fp8_gemm_kernel[plan.grid(m, n)](
        x2, weight.view(torch.uint8) if decode_bits else weight, scale, bias if bias_in_kernel else scale, out,
        m, n, k, plan.k_per_split, x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), *out_strides,
        PER_CHANNEL=scale.numel() == n and n > 1, HAS_BIAS=bias_in_kernel, UPCAST=upcast,
        DOT_PRECISION=precision, E4M3_BITS=decode_bits, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
        BLOCK_K=plan.block_k, num_warps=plan.num_warps, num_stages=plan.num_stages)
    if plan.split_k > 1:
        _sum_partials(out, bias, y)
    return y.reshape(*lead, n)


# (q - z) as floats of the dot's dtype from bits: q OR MAGIC_BITS is the float MAGIC + q (q below the lowest
# mantissa bit's weight, 1), from which MAGIC + z is subtracted exactly; 16-bit types go through int16.
_MAGIC = {torch.float16: (0x6400, 1024.0, True), torch.bfloat16: (0x4300, 128.0, True),
          torch.float32: (0x4B000000, 8388608.0, False)}


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
    group = max(1, k // groups)
    # Without g_idx, a K tile that divides the group size lies in one group: one row of scales and zeros a tile.
    group_tiles = g_idx is None and group % MIN_DOT == 0
    bk = _block_k(k)
    if group_tiles:
        bk = min(128, group & -group)  # the largest power of two dividing the group (>= 16)
    weight_bytes = qweight.numel() * 4 + scales.numel() * scales.element_size() + qzeros.numel() * 4
    # Decode: 128 output columns x 128 input rows a tile (8 KiB packed; AWQ rows of 64 contiguous bytes).
    plan = _plan(m, n, k, x.device, weight_bytes, block_n=128, block_k=bk)
    y, out, out_strides = _output(plan, m, n, x)
    upcast, precision = _dot_mode(x)
    magic_bits, magic, magic_int16 = _MAGIC[torch.float32 if upcast else x.dtype]
    g = g_idx.to(torch.int32) if g_idx is not None else qzeros  # a placeholder pointer when absent
    bias_in_kernel = bias is not None and plan.split_k == 1
    _w4_gemm_kernel[plan.grid(m, n)](
        x2, qweight, scales, qzeros, g, bias if bias_in_kernel else scales, out, m, n, k, group, plan.k_per_split,
        x2.stride(0), x2.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
        qzeros.stride(0), qzeros.stride(1), *out_strides,
        AWQ=awq, HAS_G_IDX=g_idx is not None, HAS_BIAS=bias_in_kernel, UPCAST=upcast, DOT_PRECISION=precision,
        GROUP_TILES=group_tiles, MAGIC_BITS=magic_bits, MAGIC=magic, MAGIC_INT16=magic_int16,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, num_warps=plan.num_warps,
        num_stages=plan.num_stages)
    if plan.split_k > 1:
        _sum_partials(out, bias, y)
    return y.reshape(*lead, n)


def awq_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequant_awq(qweight [K, N/8], scales [K/G, N], qzeros [K/G, N/8])."""
    return _w4_linear(x, qweight, scales, qzeros, None, bias, awq=True)


def gptq_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
                g_idx: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequant_gptq(qweight [K/8, N], scales [K/G, N], qzeros [K/G, N/8], g_idx [K])."""
    return _w4_linear(x, qweight, scales, qzeros, g_idx, bias, awq=False)
