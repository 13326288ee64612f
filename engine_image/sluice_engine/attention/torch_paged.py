"""Reference attention over the paged KV cache in plain torch (the CPU path, and the oracle the
Triton kernels are tested against)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..forward_context import AttentionMetadata

# Batches whose longest query is at most this many tokens take the padded single-call path; longer
# (prefill chunks) loop over sequences, where padding would waste more than the loop costs.
SHORT_QUERY_LEN = 8


class TorchPagedAttention:
    name = "torch"

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        _, num_blocks, block_size, h, d = kv_cache.shape
        kv_cache[0].view(num_blocks * block_size, h, d).index_copy_(0, meta.slot_mapping, k.to(kv_cache.dtype))
        kv_cache[1].view(num_blocks * block_size, h, d).index_copy_(0, meta.slot_mapping, v.to(kv_cache.dtype))

    def attend(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        q_lens, seq_lens = meta.query_lens_cpu, meta.seq_lens_cpu
        if meta.max_query_len <= SHORT_QUERY_LEN:
            return _short_queries(q, kv_cache, meta.block_tables, meta.seq_lens, q_lens, meta.max_seq_len, scale)
        out = torch.empty_like(q)
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        # A mixed step (a prompt chunk beside many decodes): the short queries still go in one padded
        # call; only the long ones loop.
        short = [i for i, n in enumerate(q_lens) if n <= SHORT_QUERY_LEN]
        if len(short) > 1:
            rows = torch.cat([torch.arange(starts[i], starts[i + 1], device=q.device) for i in short])
            sel = torch.tensor(short, device=q.device)
            out[rows] = _short_queries(q[rows], kv_cache, meta.block_tables[sel], meta.seq_lens[sel],
                                       [q_lens[i] for i in short], max(seq_lens[i] for i in short), scale)
            short_set = set(short)
        else:
            short_set = set()
        for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
            if i in short_set:
                continue
            start, end = starts[i], starts[i + 1]
            qi = q[start:end].transpose(0, 1)  # [Hq, q_len, D]
            if q_len == seq_len:
                # No cached prefix: this step's K/V are the whole context; no gather needed.
                ki, vi = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
                oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
            else:
                ki, vi = _gather(kv_cache, meta.block_tables[i], seq_len)
                # Query j sits at absolute position seq_len - q_len + j and sees keys up to there.
                pos_q = torch.arange(seq_len - q_len, seq_len, device=q.device)
                mask = torch.arange(seq_len, device=q.device)[None, :] <= pos_q[:, None]
                oi = F.scaled_dot_product_attention(
                    qi, ki.to(q.dtype), vi.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True
                )
            out[start:end] = oi.transpose(0, 1)
        return out


def _short_queries(q, kv_cache, block_tables: torch.Tensor, seq_lens: torch.Tensor, q_lens_cpu: list[int],
                   max_seq_len: int, scale: float) -> torch.Tensor:
    """Sequences with a few queries each (decode, speculative verification; q holds their rows in
    order): gather every sequence's blocks into a padded [B, Hkv, L, D] batch, pad the queries to
    [B, Hq, max_q, D], and mask both, so the whole batch is one SDPA call instead of a loop."""
    b, max_q = len(q_lens_cpu), max(q_lens_cpu)
    block_size = kv_cache.shape[2]
    max_blocks = -(-max_seq_len // block_size)
    # index_select with flat int64 ids is several times faster on CPU than tensor[int32 table].
    ids = block_tables[:, :max_blocks].reshape(-1).long()
    length = max_blocks * block_size
    keys = kv_cache[0].index_select(0, ids).view(b, length, *kv_cache.shape[3:]).transpose(1, 2)
    values = kv_cache[1].index_select(0, ids).view(b, length, *kv_cache.shape[3:]).transpose(1, 2)
    key_pos = torch.arange(length, device=q.device)
    if max_q == 1:
        mask = (key_pos[None, :] < seq_lens[:, None])[:, None, None, :]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True,
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
        q_pad.view(b, max_q, *q.shape[1:]).transpose(1, 2), keys.to(q.dtype), values.to(q.dtype),
        attn_mask=mask[:, None], scale=scale, enable_gqa=True,
    )
    return out.transpose(1, 2).reshape(b * max_q, *q.shape[1:])[flat]


def _gather(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence as [Hkv, seq_len, D]."""
    block_size = kv_cache.shape[2]
    n = -(-seq_len // block_size)
    ids = block_table[:n].long()
    k = kv_cache[0].index_select(0, ids).flatten(0, 1)[:seq_len].transpose(0, 1)
    v = kv_cache[1].index_select(0, ids).flatten(0, 1)[:seq_len].transpose(0, 1)
    return k, v
