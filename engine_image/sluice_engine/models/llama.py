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

The norms, residual adds, rotary embedding and SiLU-and-multiply go through one `LayerOps` chosen per model
(layer_ops/): single Triton kernels beside the Triton attention backend, the torch reference otherwise. The
residual stream travels beside each layer's output and is added inside the next norm (`add_norm`); a
stage adds it once at its end, so stages still pass one hidden tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.backend import AttentionBackend
from ..distributed.layout import RankShard, single_shard
from ..distributed.parallel_state import tp_all_reduce, tp_gather_last_dim
from ..forward_context import get_forward_context
from ..layer_ops import LayerOps, select_layer_ops
from ..model_config import ModelConfig

# (module name as in the model, e.g. "layers.3.self_attn.qkv_proj", in_features, out_features, bias) -> the
# layer. Dense: nn.Linear, loaded afterwards by models/loader.py; a quantized checkpoint's loader builds its
# decoder projections from the packed tensors instead (models/gpu_quant_loader.py), and on CPU a GGUF's
# loader from the file's blocks (models/quant_loader.py GGUFLinears).
LinearFactory = Callable[[str, int, int, bool], nn.Module]


def dense_linear(name: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
    return nn.Linear(in_features, out_features, bias=bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: LayerOps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual add done in the norm's kernel."""
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, cache_idx: int, backend: AttentionBackend, shard: RankShard,
                 ops: LayerOps, linear: LinearFactory = dense_linear, prefix: str = ""):
        super().__init__()
        self.ops = ops
        self.cache_idx = cache_idx  # this layer's KV cache among the stage's
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = linear(prefix + "qkv_proj", cfg.hidden_size, self.q_size + 2 * self.kv_size,
                               cfg.attention_bias)
        self.o_proj = linear(prefix + "o_proj", self.q_size, cfg.hidden_size, False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops) if cfg.qk_norm else None
        self.backend = backend
        self.scale = cfg.head_dim**-0.5
        # [k_scale, v_scale] of an FP8 KV cache (--kv-cache-dtype fp8): the cache holds K / k_scale and
        # V / v_scale in e4m3. The checkpoint's k_scale/v_scale tensors when it has them (models/loader.py),
        # else 1.0. float32 on the device, read by the kernels (no host sync: capturable). Unused by a cache in
        # the model's dtype.
        self.register_buffer("kv_scale", torch.ones(2, dtype=torch.float32), persistent=False)
        self.kv_scale_source = "default"  # "checkpoint" once the loader sets them

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # Q and K heads sit side by side in the fused output: rotate them in one pass (in place with
            # the Triton ops; qkv is this layer's own).
            qk = self.ops.rotary(qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim), cos_sin)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q = self.q_norm(qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim))
            q, k = self.ops.rotary(q, cos_sin), self.ops.rotary(k, cos_sin)
        ctx = get_forward_context()
        cache = ctx.kv_caches[self.cache_idx]
        self.backend.write_kv(cache, k, v, ctx.attn, self.kv_scale)
        out = self.backend.attend(q, k, v, cache, ctx.attn, self.scale, self.kv_scale)
        return tp_all_reduce(self.o_proj(out.reshape(t, self.q_size)))  # row-parallel: partial sums


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: RankShard, ops: LayerOps, linear: LinearFactory = dense_linear,
                 prefix: str = ""):
        super().__init__()
        self.ops = ops
        self.intermediate = shard.intermediate
        # This rank's gate columns, then its up columns (models/loader.py): silu_and_mul splits in halves.
        self.gate_up_proj = linear(prefix + "gate_up_proj", cfg.hidden_size, 2 * self.intermediate, False)
        self.down_proj = linear(prefix + "down_proj", self.intermediate, cfg.hidden_size, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tp_all_reduce(self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, cache_idx: int, backend: AttentionBackend, shard: RankShard,
                 ops: LayerOps, linear: LinearFactory = dense_linear):
        super().__init__()
        prefix = f"layers.{cache_idx}."  # the stage's own numbering, as the model's module names
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = Attention(cfg, cache_idx, backend, shard, ops, linear, prefix + "self_attn.")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = MLP(cfg, shard, ops, linear, prefix + "mlp.")

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output, not yet added to `residual`; for a stage's first layer, the
        stream itself (residual None). Returns (this layer's MLP output, the stream before it)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_norm(x, residual)
        h, residual = self.post_attention_layernorm.add_norm(self.self_attn(cos_sin, h), residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int,
                 shard: RankShard | None = None, ops: LayerOps | None = None, linear: LinearFactory = dense_linear):
        """ops: the layers' norm/rotary/activation ops; None picks them from the attention backend.
        linear: builds the decoder layers' projections (the output layer is always dense)."""
        super().__init__()
        self.cfg = cfg
        self.shard = shard = shard or single_shard(cfg)
        self.ops = ops = ops or select_layer_ops(backend.name)
        self.rotary = ops.rotary_embedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        local_vocab = shard.vocab_end - shard.vocab_start
        # The stage's slice of the vocabulary; rows past the real vocabulary (padding) stay zero.
        self.embed_tokens = nn.Embedding(local_vocab, cfg.hidden_size) if shard.is_first_stage else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, backend, shard, ops, linear)
                                    for i in range(shard.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops) if shard.is_last_stage else None
        # Tied embeddings on one stage: the embedding is the output layer. Across stages the last one
        # holds its own copy of the table as the output layer.
        tied_here = cfg.tie_word_embeddings and shard.is_first_stage
        self.lm_head = (nn.Linear(cfg.hidden_size, local_vocab, bias=False)
                        if shard.is_last_stage and not tied_here else None)
        # The layer loop as one native call (models/ggml_decoder.py), set by the model runner where it covers the
        # model (a GGUF served in its blocks on CPU); None runs the layers one op at a time.
        self.fused_layers: Callable | None = None
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
        residual = None
        if self.fused_layers is not None:
            x, residual = self.fused_layers(x, cos_sin)
        else:
            for layer in self.layers:  # every stage holds at least one layer (distributed/layout.py)
                x, residual = layer(cos_sin, x, residual)
        if self.norm is not None:
            return self.norm.add_norm(x, residual)[0]
        return x + residual  # the stream, whole, for the next stage

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
