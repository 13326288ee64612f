"""Every supported model family against HF transformers, on tiny random fp32 checkpoints.

For Llama (untied, tied, llama3 and linear rope scaling), Mistral, Qwen2 (q/k/v bias) and Qwen3
(q/k-norm, head_dim != hidden / heads): the engine loads what `save_pretrained` wrote and must agree
with HF on prompt log-probs, greedy continuations, chunked prefill, prefix-cache hits, continuous
batching and preemption.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from sluice_engine.engine.llm_engine import LLMEngine
from sluice_engine.engine.model_info import RequestRejected
from sluice_engine.entrypoints.llm import LLM
from sluice_engine.model_config import ModelConfig
from sluice_engine.sampling_params import SamplingParams

VOCAB = 128
LOGPROB_TOL = 1e-4
GEN = 16
BLOCK = 4

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    # Wider than the default 0.02 so random models do not collapse onto one repeated token.
    initializer_range=0.2,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Wavelengths of a 16-dim head span ~6..20000: with 64 here all three llama3 bands are exercised.
    "original_max_position_embeddings": 64,
}

FAMILIES = {
    "llama": (LlamaConfig, {}),
    "llama-tied": (LlamaConfig, {"tie_word_embeddings": True}),
    "llama-llama3-rope": (LlamaConfig, {"rope_parameters": LLAMA3_ROPE}),
    "llama-linear-rope": (LlamaConfig, {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                             "rope_theta": 10000.0}}),
    "mistral": (MistralConfig, {}),
    "qwen2": (Qwen2Config, {}),
    "qwen3": (Qwen3Config, {"head_dim": 32}),
}
EXPECTED_ARCH = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


@dataclass
class Family:
    name: str
    dir: Path
    hf: torch.nn.Module
    _greedy: dict = field(default_factory=dict)

    def llm(self, **kw) -> LLM:
        kw.setdefault("kv_cache_memory", 1 << 20)
        return LLM(str(self.dir), device="cpu", dtype="float32", block_size=BLOCK, attention_backend="torch", **kw)

    @torch.no_grad()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """HF's log-softmax at every position of `ids`: [len(ids), VOCAB]."""
        return torch.log_softmax(self.hf(torch.tensor([ids])).logits[0].float(), dim=-1)

    @torch.no_grad()
    def greedy(self, ids: list[int], n: int = GEN) -> list[int]:
        key = (tuple(ids), n)
        if key in self._greedy:
            return self._greedy[key]
        out = self.hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=n, do_sample=False)
        gen = out[0, len(ids):].tolist()
        assert len(gen) == n  # no EOS configured: HF must not stop early
        self._greedy[key] = gen
        return gen


def write_tokenizer(path: Path) -> None:
    """A word-level tokenizer over the whole vocabulary ("t0" .. "t127"): enough for the engine to start."""
    tok = HFTokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


def build_family(name: str, root: Path, **overrides) -> Family:
    cls, extra = FAMILIES[name]
    cfg = cls(**{**COMMON, **extra, **overrides})
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Norm weights start at exactly 1 (and biases at 0): perturb them so that loading them matters.
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if pname.endswith("norm.weight") or pname.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    hf.eval()
    hf.save_pretrained(root, safe_serialization=True)
    write_tokenizer(root)
    return Family(name, root, hf)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> Family:
    return build_family(request.param, tmp_path_factory.mktemp(request.param))


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


GREEDY = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True)


def run_engine(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]], add_after: dict | None = None):
    """Drives the engine to completion; `add_after` maps a step number to requests added before it.
    Returns per request id: generated tokens, their logprobs, prompt logprobs and cached tokens."""
    results = {rid: {"tokens": [], "logprobs": [], "prompt_logprobs": None, "cached": 0} for rid in requests}
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    pending = dict(add_after or {})
    step = 0
    while engine.has_unfinished() or pending:
        for rid, (ids, params) in pending.pop(step, {}).items():
            results[rid] = {"tokens": [], "logprobs": [], "prompt_logprobs": None, "cached": 0}
            engine.add_request(rid, ids, params)
        for out in engine.step():
            r = results[out.request_id]
            r["tokens"].extend(out.new_token_ids)
            r["logprobs"].extend(out.logprobs)
            r["cached"] = out.num_cached_tokens
            if out.prompt_logprobs is not None:
                r["prompt_logprobs"] = out.prompt_logprobs
        step += 1
    return results


# -- config and weights -----------------------------------------------------------------------------------
def test_config_is_read_for_the_family(family):
    mc = ModelConfig.from_dir(family.dir)
    cfg = family.hf.config
    base = family.name.split("-")[0]
    assert mc.architecture == EXPECTED_ARCH[base]
    assert (mc.num_layers, mc.num_heads, mc.num_kv_heads) == (2, 4, 2)
    assert mc.head_dim == cfg.head_dim
    assert mc.vocab_size == VOCAB and mc.hidden_size == 64 and mc.intermediate_size == 128
    assert mc.tie_word_embeddings is (family.name == "llama-tied")
    assert mc.attention_bias is (base == "qwen2")
    assert mc.qk_norm is (base == "qwen3")
    assert mc.rms_norm_eps == cfg.rms_norm_eps
    assert mc.rope_theta == 10000.0
    rope_type = (cfg.rope_parameters or {}).get("rope_type", "default")
    assert (mc.rope_scaling or {}).get("rope_type", "default") == rope_type


def test_legacy_config_layout_reads_the_same(family, tmp_path):
    """transformers 4.x checkpoints (most of the Hub) keep rope_theta / rope_scaling at the top level and
    Qwen2 configs have no attention_bias key: they must parse like what transformers 5 writes."""
    raw = json.loads((family.dir / "config.json").read_text())
    rope = dict(raw.pop("rope_parameters", None) or {})
    raw["rope_theta"] = rope.pop("rope_theta", 10000.0)
    raw["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    if raw.get("attention_bias") is None:
        raw.pop("attention_bias", None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert ModelConfig.from_dir(tmp_path) == ModelConfig.from_dir(family.dir)


# -- numerics ------------------------------------------------------------------------------------------
def test_prefill_logprobs_match_hf(family, monkeypatch):
    ids = prompt(21, seed=1)
    llm = family.llm()
    model = llm.engine.runner.model
    captured = []
    orig = model.compute_logits

    def spy(hidden):
        logits = orig(hidden)
        captured.append(logits.clone())
        return logits

    monkeypatch.setattr(model, "compute_logits", spy)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5, logprobs=5)
    res = run_engine(llm.engine, {"p": (ids, params)})["p"]
    ref = family.logprobs(ids)

    # The prefill step projected every prompt position: the full distribution matches HF's.
    ours = torch.log_softmax(captured[0], dim=-1)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < LOGPROB_TOL

    # Prompt logprobs as reported: token t's logprob given tokens < t, plus the top 5.
    plp = res["prompt_logprobs"]
    assert len(plp) == len(ids) - 1
    for t, (chosen, top) in enumerate(plp, start=1):
        assert chosen == pytest.approx(ref[t - 1, ids[t]].item(), abs=LOGPROB_TOL)
        vals, top_ids = ref[t - 1].topk(5)
        assert [i for i, _ in top] == top_ids.tolist()
        assert [v for _, v in top] == pytest.approx(vals.tolist(), abs=LOGPROB_TOL)

    # The sampled token: HF's argmax at the last position, with HF's logprob.
    assert res["tokens"] == [int(ref[-1].argmax())]
    chosen, top = res["logprobs"][0]
    assert chosen == pytest.approx(ref[-1].max().item(), abs=LOGPROB_TOL)
    assert [i for i, _ in top] == ref[-1].topk(5).indices.tolist()


@pytest.mark.parametrize("length", [1, 7, 33])
def test_greedy_continuation_matches_hf_generate(family, length):
    ids = prompt(length, seed=length)
    expected = family.greedy(ids)
    params = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True, logprobs=1)
    (c,) = family.llm().generate([ids], params)
    assert c.token_ids == expected
    assert c.finish_reason == "length"
    # Logprobs of the decoded tokens, teacher-forced through HF.
    ref = family.logprobs(ids + expected)
    for j, (chosen, _) in enumerate(c.logprobs):
        assert chosen == pytest.approx(ref[length - 1 + j, expected[j]].item(), abs=LOGPROB_TOL)


def test_random_models_are_not_degenerate(family):
    # Guards the other tests: continuations that repeat one token would hide position bugs.
    assert len(set(family.greedy(prompt(7, seed=7)))) >= 3


def test_chunked_prefill_and_prefix_cache_hit(family):
    ids = prompt(45, seed=45)
    expected = family.greedy(ids)
    llm = family.llm(max_num_batched_tokens=8)
    engine = llm.engine

    steps_before = engine.stats.steps
    (first,) = llm.generate([ids], GREEDY)
    assert first.token_ids == expected
    assert first.num_cached_tokens == 0
    # 45 prompt tokens at 8 per step take 6 steps (the last also samples), then 15 decode steps.
    assert engine.stats.steps - steps_before == 6 + GEN - 1

    (second,) = llm.generate([ids], GREEDY)
    assert second.token_ids == expected
    assert 0 < second.num_cached_tokens < len(ids)
    assert second.num_cached_tokens % BLOCK == 0
    assert second.num_cached_tokens >= len(ids) - BLOCK

    # A prompt sharing only the first 24 tokens reuses exactly those blocks and still matches HF.
    fork = ids[:24] + prompt(13, seed=99)
    (third,) = llm.generate([fork], GREEDY)
    assert third.num_cached_tokens == 24
    assert third.token_ids == family.greedy(fork)


def test_same_tokens_at_another_position_are_not_a_cache_hit(family):
    # K is rotated by position: a block's KV is reusable only after the very same prefix.
    block = prompt(BLOCK, seed=5)
    first = prompt(2 * BLOCK, seed=6) + block + prompt(9, seed=8)
    second = block + prompt(9, seed=9)
    llm = family.llm()
    llm.generate([first], GREEDY)
    (c,) = llm.generate([second], GREEDY)
    assert c.num_cached_tokens == 0
    assert c.token_ids == family.greedy(second)


def test_chunked_prefill_prompt_logprobs_match_hf(family):
    ids = prompt(30, seed=30)
    llm = family.llm(max_num_batched_tokens=7)
    res = run_engine(llm.engine, {"p": (ids, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0))})
    ref = family.logprobs(ids)
    got = [chosen for chosen, _ in res["p"]["prompt_logprobs"]]
    want = [ref[t - 1, ids[t]].item() for t in range(1, len(ids))]
    assert got == pytest.approx(want, abs=LOGPROB_TOL)


def test_continuous_batching_matches_each_prompt_alone(family):
    lengths = [3, 17, 30, 9, 50, 1]
    prompts = [prompt(n, seed=100 + n) for n in lengths]
    prompts.append(prompts[4][:20] + prompt(6, seed=7))  # shares blocks with a prompt in the same batch
    expected = [family.greedy(p) for p in prompts]

    alone = family.llm(enable_prefix_caching=False)
    assert [alone.generate([p], GREEDY)[0].token_ids for p in prompts] == expected

    together = family.llm(max_num_batched_tokens=32)
    got = together.generate(prompts, GREEDY)
    assert [c.token_ids for c in got] == expected


def test_requests_joining_mid_flight_match_hf(family):
    """Requests arriving while others decode, with different lengths and budgets (so finishing at
    different steps), with a small token budget and max_num_seqs forcing queueing."""
    llm = family.llm(max_num_batched_tokens=16, max_num_seqs=3)
    specs = {
        "a": (prompt(12, seed=1), 10),
        "b": (prompt(40, seed=2), 16),
        "c": (prompt(5, seed=3), 4),
        "d": (prompt(27, seed=4), 12),
        "e": (prompt(12, seed=1) + prompt(9, seed=5), 8),  # extends a's prompt: a prefix hit
    }

    def req(rid):
        ids, n = specs[rid]
        return ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    res = run_engine(llm.engine, {r: req(r) for r in "ab"}, add_after={3: {r: req(r) for r in "cd"},
                                                                        9: {"e": req("e")}})
    for rid, (ids, n) in specs.items():
        assert res[rid]["tokens"] == family.greedy(ids, n), rid
    assert res["e"]["cached"] >= 8


def test_preemption_under_a_small_kv_cache_matches_hf(family):
    mc = ModelConfig.from_dir(family.dir)
    per_token = mc.kv_bytes_per_token(4)
    # 24 blocks of 4 tokens: any one request fits, all of them together do not.
    llm = family.llm(kv_cache_memory=24 * BLOCK * per_token, max_num_batched_tokens=64)
    assert llm.engine.runner.num_blocks == 24
    prompts = [prompt(n, seed=200 + n) for n in (30, 22, 41, 15)]
    got = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [c.token_ids for c in got] == [family.greedy(p) for p in prompts]


def test_seeded_sampling_does_not_depend_on_the_batch(family):
    ids = prompt(10, seed=10)
    params = SamplingParams(temperature=1.0, max_tokens=GEN, ignore_eos=True, seed=42)
    alone = family.llm().generate([ids], params)[0].token_ids
    llm = family.llm(max_num_batched_tokens=16)
    others = SamplingParams(temperature=1.0, top_p=0.8, max_tokens=GEN, ignore_eos=True)
    together = run_engine(llm.engine, {"x": (prompt(20, seed=11), others), "seeded": (ids, params),
                                       "y": (prompt(3, seed=12), others)})
    assert together["seeded"]["tokens"] == alone
    assert len(set(alone)) > 3


# -- sliding window (Mistral) -----------------------------------------------------------------------------
def test_mistral_sliding_window_is_honoured_or_the_context_capped(tmp_path):
    """Mistral checkpoints can set sliding_window (v0.1: 4096 of a 32k context). HF then lets each
    token see only the last `sliding_window` positions. The engine must either do the same or refuse
    to run past the window; silently attending to everything gives different results."""
    window = 8
    fam = build_family("mistral", tmp_path, sliding_window=window)
    ids = prompt(24, seed=24)
    try:
        llm = fam.llm()
    except ValueError as e:  # refusing the checkpoint outright is acceptable too
        assert "sliding" in str(e).lower()
        return
    if llm.engine.max_model_len <= window:
        # The engine caps the context at the window: everything it accepts matches HF ...
        short = ids[: llm.engine.max_model_len - 4]
        res = run_engine(llm.engine, {"s": (short, SamplingParams(temperature=0.0, max_tokens=4, logprobs=0))})
        assert res["s"]["tokens"] == fam.greedy(short, 4)
        ref = fam.logprobs(short + res["s"]["tokens"])
        got = [chosen for chosen, _ in res["s"]["logprobs"]]
        want = [ref[len(short) - 1 + j, t].item() for j, t in enumerate(res["s"]["tokens"])]
        assert got == pytest.approx(want, abs=LOGPROB_TOL)
        # ... and a prompt that would need the window is refused, not silently mis-attended.
        with pytest.raises(RequestRejected):
            llm.engine.add_request("long", ids, SamplingParams(temperature=0.0, max_tokens=1))
        return
    ref = fam.logprobs(ids)
    res = run_engine(llm.engine, {"p": (ids, SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0))})
    got = torch.tensor([chosen for chosen, _ in res["p"]["prompt_logprobs"]])
    want = torch.tensor([ref[t - 1, ids[t]].item() for t in range(1, len(ids))])
    assert (got - want).abs().max().item() < LOGPROB_TOL
    assert res["p"]["tokens"] == fam.greedy(ids, 4)
