"""A tiny Llama checkpoint with random weights, written as an HF directory (config.json, model.safetensors, a
word-level tokenizer.json): for engine tests that need a whole model but not a real one."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 96


def write_tiny_llama(root: Path, extra_tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """A 2-layer Llama (6 query heads over 2 KV heads, head_dim 16, vocabulary VOCAB: tokens "t0".."t95") into
    `root`; extra_tensors are added to the checkpoint as they are (e.g. KV-cache scales)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    root.mkdir(parents=True, exist_ok=True)
    hidden, inter, heads, kv_heads, head_dim, layers = 96, 128, 6, 2, 16, 2
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB, hidden_size=hidden,
                  intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=256,
                  rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
    (root / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)

    def w(*shape, std=0.2):  # wide enough that a random model does not repeat one token
        return torch.randn(*shape, generator=g) * std

    tensors = {"model.embed_tokens.weight": w(VOCAB, hidden), "lm_head.weight": w(VOCAB, hidden),
               "model.norm.weight": 1 + w(hidden, std=0.1)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
            p + "input_layernorm.weight": 1 + w(hidden, std=0.1),
            p + "post_attention_layernorm.weight": 1 + w(hidden, std=0.1),
        }
    tensors |= extra_tensors or {}
    save_file(tensors, str(root / "model.safetensors"))
    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(root / "tokenizer.json"))
    return root
