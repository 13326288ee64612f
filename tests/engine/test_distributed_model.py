"""Issue 12, acceptance 2: a tiny random-weight Llama (8 query heads, 4 KV heads, a vocabulary that
needs padding) split over ranks -- TP 2, TP 4 (KV heads split), TP 8 (KV heads replicated), PP 2 x TP 2,
and PP 3 with an uneven layer split -- gives the single-process model's logits within 1e-4, on prompt
chunks, decodes and speculative verification rows alike. Real processes joined over gloo."""

import json

import pytest
import torch
from safetensors.torch import save_file
from servers import free_port

from sluice_engine.config import EngineConfig
from sluice_engine.core.sched_output import ScheduledRequest, SchedulerOutput
from sluice_engine.executor.executor import Executor

pytestmark = pytest.mark.slow

HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB, INTER = 8, 4, 32, 5, 300, 256
HIDDEN = HEADS * HEAD_DIM


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 512, "tie_word_embeddings": False,
    }))
    g = torch.Generator().manual_seed(0)

    def w(*shape, scale=0.08):
        return torch.randn(*shape, generator=g) * scale

    t = {"model.embed_tokens.weight": w(VOCAB, HIDDEN, scale=1.0), "lm_head.weight": w(VOCAB, HIDDEN),
         "model.norm.weight": 1 + w(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": 1 + w(HIDDEN), p + "post_attention_layernorm.weight": 1 + w(HIDDEN),
              p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
              p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
              p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
              p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
              p + "mlp.gate_proj.weight": w(INTER, HIDDEN), p + "mlp.up_proj.weight": w(INTER, HIDDEN),
              p + "mlp.down_proj.weight": w(HIDDEN, INTER)}
    # Two files and an index, as a sharded HF checkpoint is written.
    names = sorted(t)
    half = {n: t[n] for n in names[: len(names) // 2]}
    rest = {n: t[n] for n in names[len(names) // 2 :]}
    save_file(half, str(d / "model-00001-of-00002.safetensors"))
    save_file(rest, str(d / "model-00002-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in half} | {
        n: "model-00002-of-00002.safetensors" for n in rest}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return d


def steps() -> list[SchedulerOutput]:
    """A prefill of two prompts (every row's logits), a block copy and decodes, then a decode with
    three draft tokens to verify. Blocks of 4 tokens."""
    a = [5, 17, 299, 64, 3, 128, 200, 11, 9]
    b = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 250, 251, 252]
    return [
        SchedulerOutput([ScheduledRequest("a", a, 0, [0, 1, 2], prompt_logprobs=True),
                         ScheduledRequest("b", b, 0, [3, 4, 5, 6], prompt_logprobs=True)]),
        # c shares a's first two blocks and gets its own copy of a's partial third block (fork).
        SchedulerOutput([ScheduledRequest("a", [42], 9, [0, 1, 2]),
                         ScheduledRequest("b", [43], 14, [3, 4, 5, 6]),
                         ScheduledRequest("c", [44], 9, [0, 1, 7])], block_copies=[(2, 7)]),
        SchedulerOutput([ScheduledRequest("a", [7, 8, 9, 10], 10, [0, 1, 2, 8], num_drafts=3),
                         ScheduledRequest("b", [12], 15, [3, 4, 5, 6])]),
    ]


def run(model_dir, tp: int, pp: int) -> list[torch.Tensor]:
    cfg = EngineConfig(model=str(model_dir), device="cpu", tensor_parallel_size=tp, pipeline_parallel_size=pp,
                       kv_cache_memory=4 << 20, block_size=4, master_port=free_port(), distributed_timeout=120)
    ex = Executor(cfg, model_dir)
    try:
        return [ex.execute_model(s).clone() for s in steps()]
    finally:
        ex.shutdown()
        from sluice_engine.distributed.parallel_state import destroy_distributed

        destroy_distributed()


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return run(tiny_llama, 1, 1)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (4, 1), (8, 1), (2, 2), (1, 3)],
                         ids=["tp2", "tp4", "tp8-kv-replicated", "pp2xtp2", "pp3-uneven"])
def test_sharded_logits_match_one_process(tiny_llama, reference, tp, pp):
    got = run(tiny_llama, tp, pp)
    assert [g.shape for g in got] == [r.shape for r in reference] == [(23, VOCAB), (3, VOCAB), (5, VOCAB)]
    for g, r in zip(got, reference, strict=True):
        assert (g - r).abs().max().item() < 1e-4


def test_one_node_group_rendezvous_on_a_free_port(tiny_llama, reference):
    # Another group (or a server stopped a moment ago) holds torch.distributed's customary port: a one-node
    # group with no --master-port picks a free one instead of failing with EADDRINUSE.
    import socket

    from sluice_engine.config import DEFAULT_MASTER_PORT

    squatter = socket.socket()
    try:
        squatter.bind(("127.0.0.1", DEFAULT_MASTER_PORT))
        squatter.listen()
    except OSError:
        pass  # something already listens there: the same situation
    try:
        cfg = EngineConfig(model=str(tiny_llama), device="cpu", tensor_parallel_size=2, kv_cache_memory=4 << 20,
                           block_size=4, distributed_timeout=120)
        assert cfg.master_port == 0
        ex = Executor(cfg, tiny_llama)
        try:
            assert ex.cfg.master_port not in (0, DEFAULT_MASTER_PORT)
            got = ex.execute_model(steps()[0]).clone()
        finally:
            ex.shutdown()
            from sluice_engine.distributed.parallel_state import destroy_distributed

            destroy_distributed()
    finally:
        squatter.close()
    assert (got - reference[0]).abs().max().item() < 1e-4


# -- a LoRA adapter, sharded as its base layers are (issue 26) ------------------------------------------------
@pytest.fixture(scope="module")
def tiny_adapter(tmp_path_factory):
    """A PEFT-format adapter on every projection of the tiny model (rank 8), written as PEFT writes one."""
    d = tmp_path_factory.mktemp("tiny-adapter")
    g = torch.Generator().manual_seed(1)
    shapes = {"self_attn.q_proj": (HIDDEN, HEADS * HEAD_DIM), "self_attn.k_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
              "self_attn.v_proj": (HIDDEN, KV_HEADS * HEAD_DIM), "self_attn.o_proj": (HEADS * HEAD_DIM, HIDDEN),
              "mlp.gate_proj": (HIDDEN, INTER), "mlp.up_proj": (HIDDEN, INTER), "mlp.down_proj": (INTER, HIDDEN)}
    t = {}
    for i in range(LAYERS):
        for mod, (fan_in, fan_out) in shapes.items():
            p = f"base_model.model.model.layers.{i}.{mod}"
            t[f"{p}.lora_A.weight"] = torch.randn(8, fan_in, generator=g) * 0.1
            t[f"{p}.lora_B.weight"] = torch.randn(fan_out, 8, generator=g) * 0.1
    save_file(t, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 8, "lora_alpha": 16,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}))
    return d


def lora_steps(adapter) -> list[SchedulerOutput]:
    """steps() with a and its fork c on the adapter (slot 1), b on the base: loaded with the first step."""
    from sluice_engine.core.lora_slots import LoRARef

    out = steps()
    for sched in out:
        for s in sched.scheduled:
            s.lora_slot = 0 if s.request_id == "b" else 1
    out[0].lora_loads = [(1, LoRARef("tiny", 1, str(adapter)))]
    return out


def run_lora(model_dir, adapter, tp: int, pp: int) -> list[torch.Tensor]:
    cfg = EngineConfig(model=str(model_dir), device="cpu", tensor_parallel_size=tp, pipeline_parallel_size=pp,
                       kv_cache_memory=4 << 20, block_size=4, master_port=free_port(), distributed_timeout=120,
                       enable_lora=True, max_loras=2, max_lora_rank=8)
    ex = Executor(cfg, model_dir)
    try:
        return [ex.execute_model(s).clone() for s in lora_steps(adapter)]
    finally:
        ex.shutdown()
        from sluice_engine.distributed.parallel_state import destroy_distributed

        destroy_distributed()


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (8, 1), (2, 2)], ids=["tp2", "tp8-kv-replicated", "pp2xtp2"])
def test_sharded_lora_logits_match_one_rank(tiny_llama, tiny_adapter, reference, tp, pp):
    one = run_lora(tiny_llama, tiny_adapter, 1, 1)
    got = run_lora(tiny_llama, tiny_adapter, tp, pp)
    # The adapter changed a's and c's rows (and only theirs: b's are the base model's).
    assert (one[0][:9] - reference[0][:9]).abs().max() > 1e-2
    assert (one[0][9:] - reference[0][9:]).abs().max() < 1e-4
    for g, r in zip(got, one, strict=True):
        assert (g - r).abs().max().item() < 1e-4
