"""Reference attention over the paged KV cache in plain torch (the CPU path, and the oracle the
Triton kernels are tested against).

An FP8 cache (float8_e4m3fn, --kv-cache-dtype fp8) is handled as the Triton kernels handle it, so that it is
their reference: writes store round(x / scale) saturated to +-448 (`quantize_kv`); reads dequantize in fp32
(e4m3 * scale) and every key and value comes from the cache, this step's included. Indexing goes through the
cache's bytes (uint8 views): torch's index ops do not all take float8 tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..forward_context import AttentionMetadata

# Batches whose longest query is at most this many tokens take the padded single-call path; longer
# (prefill chunks) loop over sequences, where padding would waste more than the loop costs.
SHORT_QUERY_LEN = 8
# The fixed cost of one padded call, in gathered key rows (one sequence x one position; measured on
# CPU: ~45 us a call, ~0.5 us a row, so ~100 rows, doubled for the grouping's own indexing): short queries
# are grouped by context length so that padding each group to its longest costs little, and a group is
# split off only when it saves more padding than this.
GROUP_COST_ROWS = 256
FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3fn magnitude


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in e4m3, saturated to +-448 (the bytes the Triton write kernel stores)."""
    return (x.to(torch.float32) / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype == FP8 else x


def _dequant(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache rows in `dtype`: an FP8 cache's e4m3 values times their scale, in fp32."""
    if x.dtype != FP8:
        return x.to(dtype)
    return (x.to(torch.float32) * scale).to(dtype)


def _select(half: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """half.index_select(0, ids), for an FP8 cache too."""
    return _as_bytes(half).index_select(0, ids).view(half.dtype)


class TorchPagedAttention:
    name = "torch"

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                 kv_scale: torch.Tensor | None = None) -> None:
        _, num_blocks, block_size, h, d = kv_cache.shape
        if kv_cache.dtype == FP8:
            assert kv_scale is not None, "an FP8 KV cache needs its [k_scale, v_scale]"
            k, v = quantize_kv(k, kv_scale[0]), quantize_kv(v, kv_scale[1])
        else:
            k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
        rows = num_blocks * block_size
        _as_bytes(kv_cache[0]).view(rows, h, d).index_copy_(0, meta.slot_mapping, _as_bytes(k))
        _as_bytes(kv_cache[1]).view(rows, h, d).index_copy_(0, meta.slot_mapping, _as_bytes(v))

    def attend(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float,
               kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        plan = meta.per_step.get("torch_paged")
        if plan is None:  # once per step, shared by every layer
            plan = meta.per_step["torch_paged"] = _plan(meta, q.device)
        starts, groups, long = plan
        if len(groups) == 1 and not long and groups[0][0] is None:
            _, tables, lens, qls, max_len = groups[0]
            return _short_queries(q, kv_cache, tables, lens, qls, max_len, scale, kv_scale)
        out = torch.empty_like(q)
        for rows, tables, lens, qls, max_len in groups:
            out[rows] = _short_queries(q[rows], kv_cache, tables, lens, qls, max_len, scale, kv_scale)
        for i in long:
            out[starts[i] : starts[i + 1]] = long_query(q, k, v, kv_cache, meta, i, starts[i], starts[i + 1], scale,
                                                        kv_scale)
        return out


def long_query(q, k, v, kv_cache, meta: AttentionMetadata, i: int, start: int, end: int,
               scale: float, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of sequence i's query rows start:end (a prompt chunk) over its context, [q_len, Hq, D]."""
    q_len, seq_len = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
    qi = q[start:end].transpose(0, 1)  # [Hq, q_len, D]
    if q_len == seq_len and kv_cache.dtype != FP8:
        # No cached prefix: this step's K/V are the whole context; no gather needed (an FP8 cache's rounded
        # K/V are read back instead, as the Triton kernel reads them).
        ki, vi = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
        oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
    else:
        ki, vi = _gather(kv_cache, meta.block_tables[i], seq_len)
        # Query j sits at absolute position seq_len - q_len + j and sees keys up to there.
        pos_q = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= pos_q[:, None]
        k_scale, v_scale = (None, None) if kv_scale is None else kv_scale
        oi = F.scaled_dot_product_attention(
            qi, _dequant(ki, q.dtype, k_scale), _dequant(vi, q.dtype, v_scale), attn_mask=mask, scale=scale,
            enable_gqa=True,
        )
    return oi.transpose(0, 1)


def _plan(meta: AttentionMetadata, device: torch.device):
    """How a step's attention runs: the sequences with short queries (decode, verification) in padded
    groups of similar context length, each (query rows or None for all, block tables, lengths, query
    lengths, longest length); the rest (prompt chunks) one by one."""
    q_lens, seq_lens = meta.query_lens_cpu, meta.seq_lens_cpu
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    short = [i for i, n in enumerate(q_lens) if n <= SHORT_QUERY_LEN]
    long = [i for i, n in enumerate(q_lens) if n > SHORT_QUERY_LEN]
    if len(short) == 1 and long:  # one short query beside prompt chunks: the loop takes it
        long, short = sorted(long + short), []
    groups = []
    for members in _length_groups(short, seq_lens, meta.block_size):
        if len(members) == len(q_lens):
            groups.append((None, meta.block_tables, meta.seq_lens, q_lens, meta.max_seq_len))
            continue
        sel = torch.tensor(members, device=device)
        rows = torch.cat([torch.arange(starts[i], starts[i + 1], device=device) for i in members])
        groups.append((rows, meta.block_tables[sel], meta.seq_lens[sel], [q_lens[i] for i in members],
                       max(seq_lens[i] for i in members)))
    return starts, groups, long


def _length_groups(members: list[int], seq_lens: list[int], block_size: int) -> list[list[int]]:
    """`members` split into groups of similar context length, minimising the padded key rows gathered
    (each member padded to its group's longest, in whole blocks) plus GROUP_COST_ROWS per group."""
    if len(members) <= 1:
        return [members] if members else []
    order = sorted(members, key=lambda i: seq_lens[i])
    padded = [-(-seq_lens[i] // block_size) * block_size for i in order]
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[i]: cost of grouping order[:i]
    cut = [0] * (n + 1)
    for i in range(1, n + 1):
        longest = padded[i - 1]
        for j in range(i):  # the last group is order[j:i]
            cost = best[j] + (i - j) * longest + GROUP_COST_ROWS
            if cost < best[i]:
                best[i], cut[i] = cost, j
    groups = []
    i = n
    while i > 0:
        groups.append(sorted(order[cut[i] : i]))
        i = cut[i]
    return groups[::-1]


def _short_queries(q, kv_cache, block_tables: torch.Tensor, seq_lens: torch.Tensor, q_lens_cpu: list[int],
                   max_seq_len: int, scale: float, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Sequences with a few queries each (decode, speculative verification; q holds their rows in
    order): gather every sequence's blocks into a padded [B, Hkv, L, D] batch, pad the queries to
    [B, Hq, max_q, D], and mask both, so the whole batch is one SDPA call instead of a loop."""
    b, max_q = len(q_lens_cpu), max(q_lens_cpu)
    block_size = kv_cache.shape[2]
    max_blocks = -(-max_seq_len // block_size)
    # index_select with flat int64 ids is several times faster on CPU than tensor[int32 table].
    ids = block_tables[:, :max_blocks].reshape(-1).long()
    length = max_blocks * block_size
    k_scale, v_scale = (None, None) if kv_scale is None else kv_scale
    keys = _dequant(_select(kv_cache[0], ids), q.dtype, k_scale).view(b, length, *kv_cache.shape[3:]).transpose(1, 2)
    values = _dequant(_select(kv_cache[1], ids), q.dtype, v_scale).view(b, length, *kv_cache.shape[3:]).transpose(1, 2)
    key_pos = torch.arange(length, device=q.device)
    if max_q == 1:
        mask = (key_pos[None, :] < seq_lens[:, None])[:, None, None, :]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True,
        )
        return out.squeeze(2)
    q_lens = torch.tensor(q_lens_cpu, device=q.device)
    query_start = torch.cumsum(q_lens, 0) - q_lens
    seq_of_row = torch.repeat_interleave(torch.arange(b, device=q.device), q_lens, output_size=q.shape[0])
    row_in_seq = torch.arange(q.shape[0], device=q.device) - query_start[seq_of_row]
    flat = seq_of_row * max_q + row_in_seq
    q_pad = q.new_zeros(b * max_q, *q.shape[1:])
    q_pad[flat] = q
    # Query j of sequence i sits at absolute position seq_len - q_len + j and sees keys up to it
    # (padding rows see the whole sequence: harmless, and no row is fully masked).
    q_pos = (seq_lens - q_lens)[:, None] + torch.arange(max_q, device=q.device)[None, :]
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < seq_lens[:, None, None])
    out = F.scaled_dot_product_attention(
        q_pad.view(b, max_q, *q.shape[1:]).transpose(1, 2), keys, values,
        attn_mask=mask[:, None], scale=scale, enable_gqa=True,
    )
    return out.transpose(1, 2).reshape(b * max_q, *q.shape[1:])[flat]


def _gather(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence as [Hkv, seq_len, D]."""
    block_size = kv_cache.shape[2]
    n = -(-seq_len // block_size)
    ids = block_table[:n].long()
    k = _select(kv_cache[0], ids).flatten(0, 1)[:seq_len].transpose(0, 1)
    v = _select(kv_cache[1], ids).flatten(0, 1)[:seq_len].transpose(0, 1)
    return k, v
