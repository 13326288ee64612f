"""Issue 15, acceptance 1: the model with the Triton layer ops (fused residual-add + RMSNorm, rotary, SiLU-and-mul)
gives what it gives with the torch ops: tiny random Llama and Qwen3 models, whole and split into pipeline stages
(the residual stream crosses the stage boundary), and the bundled SmolLM2-135M through the whole engine with the
Triton attention backend against the torch backend (identical greedy tokens).

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is first imported, as
in test_triton_attention.py), in fp32.
"""

from __future__ import annotations

import importlib
import importlib.util
import json

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from triton_interpreter import import_kernels  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")

import_kernels("sluice_engine.layer_ops.triton_kernels")
from sluice_engine.attention.torch_paged import TorchPagedAttention  # noqa: E402
from sluice_engine.distributed.layout import rank_shard  # noqa: E402
from sluice_engine.forward_context import AttentionMetadata, ForwardContext, forward_context  # noqa: E402
from sluice_engine.layer_ops.torch_ops import TorchLayerOps  # noqa: E402
from sluice_engine.layer_ops.triton_ops import TritonLayerOps  # noqa: E402
from sluice_engine.model_config import ModelConfig  # noqa: E402
from sluice_engine.models.llama import LlamaForCausalLM  # noqa: E402
from sluice_engine.models.loader import checkpoint_tensors, load_weights  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


# -- tiny models, whole and in pipeline stages ---------------------------------------------------------------
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB, BLOCK = 96, 160, 6, 2, 16, 3, 80, 4


def _write_checkpoint(root, arch: str) -> None:
    from safetensors.torch import save_file

    config = dict(architectures=[arch], vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                  num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                  head_dim=HEAD_DIM, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
                  tie_word_embeddings=False)
    if arch == "LlamaForCausalLM":  # Llama-3's scaled rotary
        config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    (root / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)

    def w(*shape, std=0.2):
        return torch.randn(*shape, generator=g) * std

    t = {"model.embed_tokens.weight": w(VOCAB, HIDDEN, std=1.0), "lm_head.weight": w(VOCAB, HIDDEN),
         "model.norm.weight": 1 + w(HIDDEN, std=0.1)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t |= {p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
              p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
              p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
              p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
              p + "mlp.gate_proj.weight": w(INTER, HIDDEN), p + "mlp.up_proj.weight": w(INTER, HIDDEN),
              p + "mlp.down_proj.weight": w(HIDDEN, INTER),
              p + "input_layernorm.weight": 1 + w(HIDDEN, std=0.1),
              p + "post_attention_layernorm.weight": 1 + w(HIDDEN, std=0.1)}
        if arch == "Qwen3ForCausalLM":
            t |= {p + "self_attn.q_norm.weight": 1 + w(HEAD_DIM, std=0.1),
                  p + "self_attn.k_norm.weight": 1 + w(HEAD_DIM, std=0.1)}
    save_file(t, str(root / "model.safetensors"))


def _stages(model_dir, ops, pp: int) -> list[LlamaForCausalLM]:
    mc = ModelConfig.from_dir(model_dir)
    stages = []
    for rank in range(pp):
        with torch.device(DEVICE):
            m = LlamaForCausalLM(mc, TorchPagedAttention(), max_positions=128, shard=rank_shard(mc, 1, pp, rank),
                                 ops=ops)
        load_weights(m, checkpoint_tensors(model_dir))
        stages.append(m.eval())
    return stages


def _steps() -> list[tuple[list[list[int]], list[int], list[list[int]]]]:
    """(new tokens per sequence, cached tokens per sequence, block tables): two prompts, then a decode each."""
    a, b = [3, 17, 60, 5, 9, 41, 2], [11, 70, 8]
    return [([a, b], [0, 0], [[0, 1], [2]]), ([[33], [44]], [7, 3], [[0, 1], [2]])]


def _logits(stages: list[LlamaForCausalLM]) -> list[torch.Tensor]:
    """Every row's logits for each of `_steps`, each stage over its own KV caches, hidden states handed on."""
    caches = [[torch.zeros(2, 4, BLOCK, KV_HEADS, HEAD_DIM, device=DEVICE) for _ in s.layers] for s in stages]
    out = []
    for new, cached, tables in _steps():
        slots, positions = [], []
        for toks, c, table in zip(new, cached, tables, strict=True):
            for p in range(c, c + len(toks)):
                slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
                positions.append(p)
        meta = AttentionMetadata.build([len(x) for x in new], [c + len(x) for x, c in zip(new, cached, strict=True)],
                                       tables, slots, BLOCK, DEVICE)
        ids = torch.tensor([t for x in new for t in x], device=DEVICE)
        pos = torch.tensor(positions, device=DEVICE)
        hidden = None
        with torch.inference_mode():
            for stage, kv in zip(stages, caches, strict=True):
                with forward_context(ForwardContext(meta, kv)):
                    hidden = stage(ids, pos, hidden)
            out.append(stages[-1].compute_logits(hidden))
    return out


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_triton_ops_match_torch_ops_whole_and_across_pipeline_stages(tmp_path, arch):
    _write_checkpoint(tmp_path, arch)
    want = _logits(_stages(tmp_path, TorchLayerOps(), 1))
    for pp in (1, 2, 3):  # 3 stages: a stage in the middle both receives and hands on the stream
        got = _logits(_stages(tmp_path, TritonLayerOps(), pp))
        torch_pp = _logits(_stages(tmp_path, TorchLayerOps(), pp))
        for g, tp_, w in zip(got, torch_pp, want, strict=True):
            assert g.shape == w.shape == (w.shape[0], VOCAB)
            # fp32 rounding through the layers (observed 8e-7 of the largest |logit|, logits of 5-7)
            assert (g - w).abs().max().item() <= 2e-5 * w.abs().max().item(), f"pp={pp}"
            assert torch.equal(tp_, w)  # the torch path's stages add the stream exactly as the whole model


# -- the bundled model through the engine --------------------------------------------------------------------
@pytest.mark.slow
def test_engine_greedy_tokens_with_fused_ops_match_the_torch_path(model_dir):
    """SmolLM2-135M, fp32: attention backend triton (Triton attention and the fused layer ops) against torch
    (torch attention, torch ops). Chunked prefill mixes prompt chunks with decode rows: the 18 prompt tokens
    take two steps of 16, the second with the first two prompts' decode rows; then decode steps only. Each step
    is ~10 s of Triton's interpreter on CPU (30 layers): 4 tokens a prompt cover prefill, the mixed step and
    decode steps reading KV that decode steps wrote."""
    from sluice_engine.entrypoints.llm import LLM
    from sluice_engine.sampling_params import SamplingParams

    prompts = ["The capital of France is", "def add(a, b):", "One, two, three,"]
    max_tokens = 4
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    runs = {}
    for backend in ("triton", "torch"):
        llm = LLM(str(model_dir), device=DEVICE.type, dtype="float32", max_model_len=64, block_size=16,
                  max_num_batched_tokens=16, kv_cache_memory=8 << 20, attention_backend=backend)
        assert llm.engine.runner.model.ops.name == backend
        runs[backend] = llm.generate(prompts, params)
    for fused, ref in zip(runs["triton"], runs["torch"], strict=True):
        assert len(fused.token_ids) == max_tokens
        assert fused.token_ids == ref.token_ids
        for a, b in zip(fused.logprobs, ref.logprobs, strict=True):
            assert abs(a[0] - b[0]) < 1e-4  # the sampled token's logprob
