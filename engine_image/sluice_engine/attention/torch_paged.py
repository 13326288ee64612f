"""Reference attention over the paged KV cache in plain torch (the CPU path, and the oracle the
Triton kernels are tested against)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..forward_context import AttentionMetadata


class TorchPagedAttention:
    name = "torch"

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        _, num_blocks, block_size, h, d = kv_cache.shape
        kv_cache[0].view(num_blocks * block_size, h, d).index_copy_(0, meta.slot_mapping, k.to(kv_cache.dtype))
        kv_cache[1].view(num_blocks * block_size, h, d).index_copy_(0, meta.slot_mapping, v.to(kv_cache.dtype))

    def attend(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.decode_only:
            return self._decode(q, kv_cache, meta, scale)
        out = torch.empty_like(q)
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            end = start + q_len
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
            start = end
        return out

    def _decode(self, q, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # One query per sequence: gather every sequence's blocks into a padded [B, Hkv, L, D] batch
        # and mask the padding, so the whole batch is one SDPA call.
        b = meta.num_seqs
        block_size = kv_cache.shape[2]
        max_blocks = -(-meta.max_seq_len // block_size)
        # index_select with flat int64 ids is several times faster on CPU than tensor[int32 table].
        ids = meta.block_tables[:, :max_blocks].reshape(-1).long()
        length = max_blocks * block_size
        keys = kv_cache[0].index_select(0, ids).view(b, length, *kv_cache.shape[3:]).transpose(1, 2)
        values = kv_cache[1].index_select(0, ids).view(b, length, *kv_cache.shape[3:]).transpose(1, 2)
        mask = torch.arange(length, device=q.device)[None, :] < meta.seq_lens[:, None]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys.to(q.dtype), values.to(q.dtype), attn_mask=mask[:, None, None, :],
            scale=scale, enable_gqa=True,
        )
        return out.squeeze(2)


def _gather(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence as [Hkv, seq_len, D]."""
    block_size = kv_cache.shape[2]
    n = -(-seq_len // block_size)
    ids = block_table[:n].long()
    k = kv_cache[0].index_select(0, ids).flatten(0, 1)[:seq_len].transpose(0, 1)
    v = kv_cache[1].index_select(0, ids).flatten(0, 1)[:seq_len].transpose(0, 1)
    return k, v
