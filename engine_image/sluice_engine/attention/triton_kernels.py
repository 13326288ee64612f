"""Triton kernels over the paged KV cache, and thin wrappers that check shapes and strides, then launch.

- `store_kv`: scatter this step's K/V rows into their cache slots (block id * block size + offset).
- `paged_attention`: one kernel for a ragged batch of query rows (prefill, chunked prefill, prefix hits,
  decode, or any mix): each sequence's new rows attend causally to its whole context, read from the
  cache through its block table. A program owns one KV head and a tile of query rows, and packs every
  query head of that KV head's group into the tile's rows (GQA: K/V is read once per group). The key
  range can be split across programs (flash-decoding); each split then writes an fp32 partial output and
  its log-sum-exp, and `_merge_splits_kernel` combines them.

fp16/bf16 Q, K and V go to the dots as they are (tensor cores) and accumulate in fp32; the softmax and the
running output are fp32. fp32 inputs use IEEE fp32 dots (no TF32). The module imports only torch, triton
and the pure-Python launch set (attention/kernel_buckets.py), so it also runs in Triton's interpreter
(TRITON_INTERPRET=1) on CPU tensors -- where bf16 arithmetic is wrong, so there bf16 inputs are upcast to
fp32 right after loading.

FP8 KV cache (--kv-cache-dtype fp8): the cache holds float8_e4m3fn values with one float32 scale per tensor
(a layer's K and its V): `store_kv` writes round(x / scale) saturated to +-448; `paged_attention` converts the
tile it loads to the query's dtype (e4m3 values are exact in fp16/bf16/fp32) and applies the scales once per row:
k_scale folded into the score scale, v_scale into the normalised output. The scales live on the device and are
loaded by the kernels, so an FP8 step is capturable in a CUDA graph. Where Triton lacks the e4m3 type (GPUs
below compute capability 8.9) the kernels convert the cache's bytes with integer arithmetic instead
(quant/triton_gemm.py's e4m3 helpers; see `e4m3_bits`); either way they see the cache as bytes (uint8).

Compiled variants: `paged_attention` launches only members of kernel_buckets' fixed set (AttentionLaunch:
split count and tile sizes), and the one integer argument that changes from batch to batch (the block
table's row stride: the widest table of the batch) is not specialized, so the variants of a model are
known in advance and warm-up compiles them all (worker/warmup.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ..quant.triton_gemm import _e4m3_bits_to_f32, _e4m3_native, _f32_to_e4m3_bits
from .kernel_buckets import AttentionLaunch, block_m_for

LOG2E = 1.4426950408889634
# Dots need every dimension >= 16 on tensor cores.
MIN_DOT = 16
# Elements per merge program (heads x splits x head_dim): all heads of a row when they fit.
MERGE_TILE = 4096
FP8 = torch.float8_e4m3fn


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, kv_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_co, stride_ch,  # cache: block, offset in block, head (head_dim is contiguous)
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,  # the cache is e4m3, passed as its bytes: quantize with kv_scale_ptr's [k_scale, v_scale]
    E4M3_BITS: tl.constexpr,  # ... encoding with integer arithmetic rather than Triton's e4m3 type
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # a padding row (no slot): nothing to write
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM)
    dst = block * stride_cb + offset * stride_co + h[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    if KV_FP8:
        # x / scale, saturated to e4m3's largest finite magnitude (448: an outlier clips rather than becoming NaN),
        # rounded to nearest even. Division, not a multiply by the reciprocal: the torch reference's bytes.
        k = tl.minimum(tl.maximum(k.to(tl.float32) / tl.load(kv_scale_ptr), -448.0), 448.0)
        v = tl.minimum(tl.maximum(v.to(tl.float32) / tl.load(kv_scale_ptr + 1), -448.0), 448.0)
        if E4M3_BITS:
            k = _f32_to_e4m3_bits(k)
            v = _f32_to_e4m3_bits(v)
        else:
            k = k.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            v = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


# NOTE: stride_bt is the width of the batch's widest block table: specializing on it (== 1, % 16 == 0)
# would add variants as contexts grow, compiled on the serving path. Reading a row offset gains nothing from it.
@triton.jit
def _attend_keys(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, start, kv_hi, row_limit, kv_head, qk_scale,
                 stride_cb, stride_co, stride_ch, n, d, d_ok,
                 BLOCK_SIZE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 KV_FP8: tl.constexpr, E4M3_BITS: tl.constexpr, MASKED: tl.constexpr):
    """One tile of keys (positions start + n) into the running softmax (m_i, l_i, acc). MASKED: the tile may run past
    kv_hi or hold keys some rows may not see (the causal diagonal); unmasked tiles lie wholly before both, so they
    skip the bounds and causal masks: the comparisons and selects over a BLOCK_M x BLOCK_N tile of scores, and the
    masked block-table and K/V loads."""
    pos = start + n
    if MASKED:
        pos_ok = pos < kv_hi
        page = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        kv_mask = pos_ok[:, None] & d_ok[None, :]
    else:
        page = tl.load(table + pos // BLOCK_SIZE).to(tl.int64)
        kv_mask = d_ok[None, :]
    kv_off = page * stride_cb + (pos % BLOCK_SIZE) * stride_co + kv_head * stride_ch
    # Masked lanes read 0 (an FP8 cache's bytes: e4m3 zero); garbage there could be NaN, which a zero
    # weight in the dots would not cancel.
    k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0)
    v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0)
    if KV_FP8:
        if E4M3_BITS:
            k = _e4m3_bits_to_f32(k)
            v = _e4m3_bits_to_f32(v)
        else:
            k = k.to(tl.float8e4nv, bitcast=True)
            v = v.to(tl.float8e4nv, bitcast=True)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    elif UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        visible = pos_ok[None, :] & (pos[None, :] <= row_limit[:, None])
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_bt"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
    query_start_ptr, seq_lens_ptr, block_table_ptr,
    kv_scale_ptr,  # FP8 cache: [k_scale, v_scale] float32 on the device (read here: no host sync)
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    stride_qt, stride_qh,
    stride_cb, stride_co, stride_ch,
    stride_bt,
    stride_ot, stride_oh,
    stride_mt, stride_mh, stride_ms,  # mid_o [T, Hq, S, D]; mid_lse [T, Hq, S] shares the first three
    stride_lt, stride_lh,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    TOKENS_PER_TILE: tl.constexpr,  # query tokens per program: BLOCK_M // GROUP
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,  # dots in fp32 (fp32 inputs, or bf16 in the interpreter)
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,  # the cache holds e4m3 values, passed as its bytes; K = e4m3 * k_scale, V = e4m3 * v_scale
    E4M3_BITS: tl.constexpr,  # ... decoded with integer arithmetic (GPUs below sm89) rather than Triton's e4m3 type
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * TOKENS_PER_TILE >= q_len:  # the grid covers the longest query; this sequence is shorter
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len  # tokens cached before this step

    # Row r of the tile is query token tile*TOKENS_PER_TILE + r // GROUP, head kv_head*GROUP + r % GROUP.
    r = tl.arange(0, BLOCK_M)
    tok = tile * TOKENS_PER_TILE + r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_ok = (r < TOKENS_PER_TILE * GROUP) & (tok < q_len)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    row = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    # Key position row_limit and before are visible to a row (causal over prefix + new tokens).
    row_limit = prefix + tok

    # Keys this tile needs, [0, kv_end), split into NUM_SPLITS chunks aligned to BLOCK_N.
    kv_end = prefix + tl.minimum((tile + 1) * TOKENS_PER_TILE, q_len)
    chunk = ((kv_end + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    kv_lo = split * chunk
    kv_hi = tl.minimum(kv_lo + chunk, kv_end)
    if NUM_SPLITS > 1:
        if kv_lo >= kv_end:
            # No key in this split (a short sequence in a batch split for a long one): only lse = -inf,
            # which gives it zero weight in the merge; its partial output is never read.
            lse_off = row * stride_lt + head * stride_lh + split
            tl.store(mid_lse_ptr + lse_off, tl.full([BLOCK_M], float("-inf"), dtype=tl.float32), mask=row_ok)
            return

    if KV_FP8:
        # Per-tensor scales, folded where they cost one multiply per tile row instead of one per element:
        # k_scale into the score scale (q . (k8 * ks) = (q . k8) * ks), v_scale into the output (it factors out
        # of the softmax-weighted sum). The e4m3 values themselves are exact in fp16/bf16, so the dots see them
        # unrounded.
        qk_scale = qk_scale * tl.load(kv_scale_ptr)
    # A finite floor for the running max keeps fully masked rows free of inf - inf.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    n = tl.arange(0, BLOCK_N)
    table = block_table_ptr + seq.to(tl.int64) * stride_bt
    # Keys before both kv_hi and the tile's first row's own position (prefix + tile * TOKENS_PER_TILE) are visible
    # to every row: whole BLOCK_N tiles of them go unmasked, the rest (the causal diagonal, the ragged end) masked.
    # A prompt's long tile loop is all but its last tile or two unmasked; a decode row's (one token) is all
    # unmasked but the last.
    full_hi = kv_lo + (tl.minimum(kv_hi, prefix + tile * TOKENS_PER_TILE + 1) - kv_lo) // BLOCK_N * BLOCK_N
    full_hi = tl.maximum(full_hi, kv_lo)
    for start in range(kv_lo, full_hi, BLOCK_N):
        m_i, l_i, acc = _attend_keys(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, start, kv_hi, row_limit,
                                     kv_head, qk_scale, stride_cb, stride_co, stride_ch, n, d, d_ok, BLOCK_SIZE,
                                     UPCAST, DOT_PRECISION, KV_FP8, E4M3_BITS, MASKED=False)
    for start in range(full_hi, kv_hi, BLOCK_N):
        m_i, l_i, acc = _attend_keys(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, start, kv_hi, row_limit,
                                     kv_head, qk_scale, stride_cb, stride_co, stride_ch, n, d, d_ok, BLOCK_SIZE,
                                     UPCAST, DOT_PRECISION, KV_FP8, E4M3_BITS, MASKED=True)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    if KV_FP8:
        acc = acc * (tl.load(kv_scale_ptr + 1) / l_safe)[:, None]
    else:
        acc = acc / l_safe[:, None]
    out_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # A split that saw no key (l == 0) gets lse = -inf: zero weight in the merge.
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        mid = row * stride_mt + head * stride_mh + split * stride_ms
        tl.store(mid_o_ptr + mid[:, None] + d[None, :], acc, mask=out_mask)
        tl.store(mid_lse_ptr + row * stride_lt + head * stride_lh + split, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr,
    stride_mt, stride_mh, stride_ms, stride_lt, stride_lh, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program merges BLOCK_H heads of one query row: out = sum_s 2^lse_s o_s / sum_s 2^lse_s."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < NUM_HEADS
    hs_ok = h_ok[:, None] & (s[None, :] < NUM_SPLITS)
    lse = tl.load(mid_lse_ptr + t * stride_lt + h[:, None] * stride_lh + s[None, :], mask=hs_ok,
                  other=float("-inf"))
    # Split 0 always holds key 0, which every query sees: the max of a real head is finite.
    m = tl.where(h_ok, tl.max(lse, 1), 0.0)
    w = tl.exp2(lse - m[:, None])  # [H, S]
    o_off = h[:, None, None] * stride_mh + s[None, :, None] * stride_ms + d[None, None, :]
    # A split without keys wrote no partial output (its lse is -inf): read nothing of it.
    o_mask = (hs_ok & (lse > float("-inf")))[:, :, None] & (d[None, None, :] < HEAD_DIM)
    o = tl.load(mid_o_ptr + t * stride_mt + o_off, mask=o_mask, other=0.0)  # [H, S, D]
    w_sum = tl.where(h_ok, tl.sum(w, 1), 1.0)
    out = tl.sum(w[:, :, None] * o, 1) / w_sum[:, None]
    out_mask = h_ok[:, None] & (d[None, :] < HEAD_DIM)
    tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=out_mask)


# Triton picks interpreter or compiler as each function is decorated. Kernels decorated under
# TRITON_INTERPRET=1 also call triton.language's own library (tl.sum, tl.max, ...), which is interpreted
# only if triton itself was first imported with the variable set.
INTERPRETED = isinstance(_paged_attention_kernel, InterpretedFunction)
INTERPRETER_READY = INTERPRETED and isinstance(tl.sum, InterpretedFunction)


# -- wrappers ----------------------------------------------------------------------------------------
def e4m3_bits(device: torch.device, writing: bool) -> bool:
    """Whether the kernels treat an FP8 cache as bytes, converted with integer arithmetic, rather than as Triton's
    e4m3 type: both ways on GPUs without e4m3 conversions (compute capability below 8.9: A100, A10, ...), and
    for writes in Triton's interpreter (its fp32 -> e4m3 cast rounds ties away from zero and flushes
    subnormals to zero; its e4m3 -> fp32 is exact). Either way the cache holds the same bytes."""
    if not _e4m3_native(device):
        return True
    return writing and INTERPRETED


def _fp8_args(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scale: torch.Tensor | None, bits: bool | None,
              writing: bool, unused: torch.Tensor):
    """(k_cache, v_cache, kv_scale, KV_FP8, E4M3_BITS) as a kernel takes them: an FP8 cache as its bytes (masked
    loads fill bytes with 0; the kernels bitcast them to e4m3 or decode them); `unused` stands in for the scales
    of a cache in the model's dtype."""
    if k_cache.dtype != FP8:
        return k_cache, v_cache, unused, False, False
    assert kv_scale is not None, "an FP8 KV cache needs its [k_scale, v_scale]"
    assert kv_scale.dtype == torch.float32 and kv_scale.shape == (2,) and kv_scale.stride(0) == 1, (
        kv_scale.dtype, kv_scale.shape)
    if bits is None:
        bits = e4m3_bits(k_cache.device, writing)
    return k_cache.view(torch.uint8), v_cache.view(torch.uint8), kv_scale, True, bits


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None, bits: bool | None = None) -> None:
    """k, v: [T, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; slot_mapping: [T] (-1: skip).
    An FP8 (float8_e4m3fn) cache stores round(x / scale) saturated to +-448, with kv_scale = [k_scale, v_scale]
    (float32, on the device). bits: encode e4m3 with integer arithmetic (None: where `e4m3_bits` says)."""
    t, h, d = k.shape
    assert v.shape == k.shape and slot_mapping.shape == (t,), (k.shape, v.shape, slot_mapping.shape)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (h, d), (k_cache.shape, k.shape)
    assert k_cache.dtype == v_cache.dtype and k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert k.stride(2) == 1 and v.stride(2) == 1
    if t == 0:
        return
    k_cache, v_cache, kv_scale, fp8, bits = _fp8_args(k_cache, v_cache, kv_scale, bits, True, k)
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping, kv_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=h, HEAD_DIM=d, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d),
        KV_FP8=fp8, E4M3_BITS=bits,
    )


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
    max_query_len: int, scale: float, launch: AttentionLaunch | None = None,
    out: torch.Tensor | None = None, mid: tuple[torch.Tensor, torch.Tensor] | None = None,
    kv_scale: torch.Tensor | None = None, bits: bool | None = None,
    num_warps: int | None = None, num_stages: int | None = None,
) -> torch.Tensor:
    """Causal attention of a ragged batch of query rows over each sequence's paged context.

    q: [T, Hq, D], sequence i's rows at query_start_loc[i]:query_start_loc[i+1]; seq_lens[i] counts its
    cached tokens plus its new ones, whose K/V must already be in the cache. k_cache, v_cache:
    [num_blocks, block_size, Hkv, D]; block_tables: [B, max_blocks]. launch: split count and tiles, from the
    fixed set (kernel_buckets.choose_attention_launch); None: unsplit. Returns [T, Hq, D] in q's dtype.
    out, mid: preallocated output [T, Hq, D] and split partials ([T, Hq, S, D], [T, Hq, S] float32), so
    that nothing is allocated here (inside a CUDA graph); by default they are allocated.
    An FP8 (float8_e4m3fn) cache holds K / k_scale and V / v_scale: kv_scale = [k_scale, v_scale] (float32, on
    the device, read by the kernel: capturable). bits: decode e4m3 with integer arithmetic (None: where
    `e4m3_bits` says). num_warps, num_stages: Triton's (None: 4 warps for tiles up to 64 x 64, else 8; 2 stages);
    benchmarks/attention_kernels.py --prefill-sweep times the alternatives on a GPU.
    """
    t, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    b = seq_lens.shape[0]
    assert hq % hkv == 0, f"{hq} query heads are not a multiple of {hkv} KV heads"
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == d, (k_cache.shape, q.shape)
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (q.dtype, FP8), (q.dtype, k_cache.dtype, v_cache.dtype)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and q.stride(2) == 1
    assert query_start_loc.shape == (b + 1,) and block_tables.shape[0] == b
    assert block_size & (block_size - 1) == 0, f"block size {block_size} is not a power of two"
    group = hq // hkv
    launch = launch or AttentionLaunch(1, block_m_for(max_query_len, group))
    assert isinstance(launch, AttentionLaunch), launch  # its constructor refuses anything outside the set
    num_splits, block_m, block_n = launch.num_splits, launch.block_m, launch.block_n
    assert block_m >= group and block_m >= MIN_DOT and block_n >= MIN_DOT
    tokens_per_tile = block_m // group
    block_d = max(MIN_DOT, triton.next_power_of_2(d))

    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, (out.shape, out.dtype, q.shape)
    if t == 0:
        return out
    if num_splits > 1 and mid is not None:
        mid_o, mid_lse = mid
        assert mid_o.shape == (t, hq, num_splits, d) and mid_lse.shape == (t, hq, num_splits), (
            mid_o.shape, mid_lse.shape, (t, hq, num_splits, d))
        assert mid_o.dtype == mid_lse.dtype == torch.float32 and mid_o.stride(3) == 1 and mid_lse.stride(2) == 1
    elif num_splits > 1:
        mid_o = torch.empty((t, hq, num_splits, d), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((t, hq, num_splits), dtype=torch.float32, device=q.device)
    else:  # unused: the kernel writes the output directly
        mid_o = mid_lse = out
    upcast = q.dtype == torch.float32 or (INTERPRETED and q.dtype == torch.bfloat16)
    tiles = triton.cdiv(max_query_len, tokens_per_tile)
    k_cache, v_cache, kv_scale, fp8, bits = _fp8_args(k_cache, v_cache, kv_scale, bits, False, q)
    _paged_attention_kernel[(b, hkv, tiles * num_splits)](
        q, k_cache, v_cache, out, mid_o, mid_lse,
        query_start_loc, seq_lens, block_tables, kv_scale,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2) if num_splits > 1 else 0,
        mid_lse.stride(0), mid_lse.stride(1),
        NUM_SPLITS=num_splits, GROUP=group, TOKENS_PER_TILE=tokens_per_tile,
        HEAD_DIM=d, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        UPCAST=upcast, DOT_PRECISION="ieee" if upcast else "tf32", KV_FP8=fp8, E4M3_BITS=bits,
        num_warps=num_warps or (4 if block_m * block_d <= 64 * 64 else 8), num_stages=num_stages or 2,
    )
    if num_splits > 1:
        block_s = triton.next_power_of_2(num_splits)
        block_h = min(triton.next_power_of_2(hq), max(1, MERGE_TILE // (block_s * block_d)))
        _merge_splits_kernel[(t, triton.cdiv(hq, block_h))](
            mid_o, mid_lse, out,
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
            out.stride(0), out.stride(1),
            NUM_HEADS=hq, NUM_SPLITS=num_splits, HEAD_DIM=d, BLOCK_H=block_h, BLOCK_S=block_s, BLOCK_D=block_d,
        )
    return out
