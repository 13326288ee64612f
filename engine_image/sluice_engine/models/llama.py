"""Llama-family decoder (Llama/SmolLM2, Mistral, Qwen2 with qkv bias, Qwen3 with q/k-norm).

Inputs are flattened ragged batches (`[T]` token ids and positions); attention reads and writes the
paged KV cache through the forward context. Q/K/V and gate/up projections are fused into one matmul
each -- fewer, larger GEMMs are what both a GPU and a small CPU want.

Built for one rank's shard (distributed/layout.py): with tensor parallelism the fused QKV and gate/up
projections hold this rank's heads and columns (column-parallel), o_proj and down_proj its rows of the
input (row-parallel, one all-reduce each), the embedding and the output layer its slice of the
vocabulary; with pipeline parallelism the module holds only its stage's layers, the embedding on the
first stage and the final norm and output layer on the last. Unsharded, every collective is a no-op.
Weights are loaded by models/loader.py, which reads only this rank's slices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.backend import AttentionBackend
from ..distributed.layout import RankShard, single_shard
from ..distributed.parallel_state import tp_all_reduce, tp_gather_last_dim
from ..forward_context import get_forward_context
from .model_config import ModelConfig
from .rotary import RotaryEmbedding, rotate


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:  # one fused op; the same arithmetic as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, cache_idx: int, backend: AttentionBackend, shard: RankShard):
        super().__init__()
        self.cache_idx = cache_idx  # this layer's KV cache among the stage's
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.backend = backend
        self.scale = cfg.head_dim**-0.5

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # Q and K heads sit side by side in the fused output: rotate them in one pass.
            qk = rotate(qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim), cos_sin)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q = self.q_norm(qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim))
            q, k = rotate(q, cos_sin), rotate(k, cos_sin)
        ctx = get_forward_context()
        cache = ctx.kv_caches[self.cache_idx]
        self.backend.write_kv(cache, k, v, ctx.attn)
        out = self.backend.attend(q, k, v, cache, ctx.attn, self.scale)
        return tp_all_reduce(self.o_proj(out.reshape(t, self.q_size)))  # row-parallel: partial sums


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: RankShard):
        super().__init__()
        self.intermediate = shard.intermediate
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = nn.Linear(self.intermediate, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return tp_all_reduce(self.down_proj(F.silu(gate) * up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, cache_idx: int, backend: AttentionBackend, shard: RankShard):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, cache_idx, backend, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, shard)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(cos_sin, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int,
                 shard: RankShard | None = None):
        super().__init__()
        self.cfg = cfg
        self.shard = shard = shard or single_shard(cfg)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        local_vocab = shard.vocab_end - shard.vocab_start
        # The stage's slice of the vocabulary; rows past the real vocabulary (padding) stay zero.
        self.embed_tokens = nn.Embedding(local_vocab, cfg.hidden_size) if shard.is_first_stage else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, backend, shard) for i in range(shard.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if shard.is_last_stage else None
        # Tied embeddings on one stage: the embedding is the output layer. Across stages the last one
        # holds its own copy of the table as the output layer.
        tied_here = cfg.tie_word_embeddings and shard.is_first_stage
        self.lm_head = (nn.Linear(cfg.hidden_size, local_vocab, bias=False)
                        if shard.is_last_stage and not tied_here else None)
        with torch.no_grad():
            for table in (self.embed_tokens, self.lm_head):
                if table is not None:
                    table.weight.zero_()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The first stage embeds `input_ids`; a later stage continues from the previous stage's
        `hidden`. Returns [T, hidden]: after the final norm on the last stage, the residual stream
        to pass on elsewhere."""
        x = self._embed(input_ids) if self.embed_tokens is not None else hidden
        cos_sin = self.rotary(positions)
        for layer in self.layers:
            x = layer(cos_sin, x)
        return self.norm(x) if self.norm is not None else x

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        sh = self.shard
        if sh.tp == 1:
            return self.embed_tokens(ids)
        local = ids - sh.vocab_start
        outside = (local < 0) | (local >= sh.vocab_end - sh.vocab_start)
        x = self.embed_tokens(local.masked_fill(outside, 0))
        return tp_all_reduce(x.masked_fill_(outside[:, None], 0.0))  # each id's row comes from one rank

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float logits [rows, vocab] on the last stage's first TP rank; None on the other TP ranks."""
        if self.lm_head is None:  # tied: the embedding is the head
            local = F.linear(hidden, self.embed_tokens.weight)
        else:
            local = self.lm_head(hidden)
        logits = tp_gather_last_dim(local)
        if logits is None:
            return None
        return logits[:, : self.cfg.vocab_size].float()


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"weight {name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)
