"""Llama-family decoder (Llama/SmolLM2, Mistral, Qwen2 with qkv bias, Qwen3 with q/k-norm).

Inputs are flattened ragged batches (`[T]` token ids and positions); attention reads and writes the
paged KV cache through the forward context. Q/K/V and gate/up projections are fused into one matmul
each -- fewer, larger GEMMs are what both a GPU and a small CPU want.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.backend import AttentionBackend
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
    def __init__(self, cfg: ModelConfig, layer_idx: int, backend: AttentionBackend):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
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
        cache = ctx.kv_caches[self.layer_idx]
        self.backend.write_kv(cache, k, v, ctx.attn)
        out = self.backend.attend(q, k, v, cache, ctx.attn, self.scale)
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, backend: AttentionBackend):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, idx, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(cos_sin, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, backend) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary(positions)
        for layer in self.layers:
            x = layer(cos_sin, x)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied: the embedding is the output layer
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    # -- weights -------------------------------------------------------------------------------
    def load_hf_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load HF checkpoint tensors (names as in transformers' Llama/Qwen), fusing q/k/v and gate/up."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        fused: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors.items():
            if "rotary_emb" in name:
                continue
            name = name.removeprefix("model.")
            for part, target in (("q_proj", "qkv_proj"), ("k_proj", "qkv_proj"), ("v_proj", "qkv_proj"),
                                 ("gate_proj", "gate_up_proj"), ("up_proj", "gate_up_proj")):
                if f".{part}." in name:
                    fused.setdefault(name.replace(part, target), {})[part] = tensor
                    break
            else:
                if name == "lm_head.weight" and self.lm_head is None:
                    continue  # tied: the embedding is the head
                if name not in params:
                    raise ValueError(f"unexpected weight {name!r} in checkpoint")
                _copy(params[name], tensor, name)
                loaded.add(name)
        for name, parts in fused.items():
            order = ("q_proj", "k_proj", "v_proj") if "qkv_proj" in name else ("gate_proj", "up_proj")
            missing = [p for p in order if p not in parts]
            if missing:
                raise ValueError(f"checkpoint lacks {missing} for {name}")
            _copy(params[name], torch.cat([parts[p] for p in order], dim=0), name)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"weight {name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)
