"""Draft-model speculative decoding on the real model: lossless (greedy identical with drafts mostly
rejected and mostly accepted), the draft cache is returned, bad flags are refused, and the server's
flags and metrics work through the real `openai` client."""

import json
import shutil

import openai
import pytest
from distribution import chi_square_pvalue
from spec_prompts import PROMPTS

from sluice_engine.config import EngineConfig
from sluice_engine.entrypoints.llm import LLM
from sluice_engine.sampling_params import SamplingParams
from sluice_engine.spec_decode.layer_draft import write_layer_draft


@pytest.fixture(scope="module")
def layer_draft(model_dir, tmp_path_factory):
    """The first 8 of SmolLM2's 30 layers: a weak draft, so most drafts are rejected."""
    return write_layer_draft(model_dir, tmp_path_factory.mktemp("draft") / "smollm2-8l", 8)


# Every passage, each asked two ways ("Repeat ... exactly": a draft's tokens mostly right; "Summarise": mostly not).
GREEDY_PROMPTS = PROMPTS[::2]


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(str(model_dir), kv_cache_memory=64 << 20)
    encoded = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in GREEDY_PROMPTS]
    want = [c.token_ids for c in llm.generate(encoded, SamplingParams(max_tokens=16, temperature=0))]
    return encoded, want


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["layers-8", "same-model"])
def test_greedy_output_is_identical_with_a_draft_model(model_dir, layer_draft, reference, draft):
    encoded, want = reference
    draft_dir = layer_draft if draft == "layers-8" else model_dir
    llm = LLM(str(model_dir), kv_cache_memory=64 << 20, draft_model=str(draft_dir), num_speculative_tokens=4)
    params = SamplingParams(max_tokens=16, temperature=0)
    assert len(encoded) == 16
    # Concurrent, in groups of 8 (the default --speculative-disable-batch-size): drafts batched.
    assert [c.token_ids for i in range(0, 16, 8) for c in llm.generate(encoded[i : i + 8], params)] == want
    assert [llm.generate([e], params)[0].token_ids for e in encoded[::4]] == want[::4]  # batch 1
    st = llm.engine.stats
    assert st.spec_draft_tokens > 0
    rate = st.spec_accepted_tokens / st.spec_draft_tokens
    if draft == "same-model":
        assert rate > 0.9, f"a draft identical to the target should almost always be accepted, got {rate:.2f}"
    else:
        assert rate < 0.5, f"an 8-layer draft should be rejected mostly (exercising rollback), got {rate:.2f}"
    # Both caches came out of the one --kv-cache-memory budget, the draft's as many tokens as the target's.
    proposer = llm.engine.proposer
    runner = llm.engine.runner
    assert proposer.kv.num_blocks == runner.num_blocks
    draft_bytes = sum(c.numel() * c.element_size() for c in proposer.kv_caches)
    assert runner.kv_cache_bytes + draft_bytes <= 64 << 20
    # Every finished request gave its draft blocks back.
    assert proposer.kv.num_free_blocks() == proposer.kv.num_blocks
    assert not proposer._shadows


@pytest.mark.slow
def test_sampled_output_distribution_matches_with_a_draft_model(model_dir):
    """Many short sampled draws with and without a draft: a chi-square test over the tokens verified
    against drafts cannot tell the two distributions apart."""
    base = dict(kv_cache_memory=32 << 20)
    off = LLM(str(model_dir), **base)
    on = LLM(str(model_dir), draft_model=str(model_dir), num_speculative_tokens=2, **base)
    prompt = off.tokenizer.encode_chat([{"role": "user", "content": "Pick a random fruit and name it."}])
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=8)
    # With the draft in groups of 8 (the default --speculative-disable-batch-size: drafts batched); without one
    # nothing speculates, and the reference draws come in one batch.
    batches = {"off": [96], "on": [8] * 12}
    samples = {name: [tuple(c.token_ids[1:3]) for n in batches[name]
                      for c in llm.generate([prompt] * n, params) if len(c.token_ids) == 3]
               for name, llm in (("off", off), ("on", on))}
    assert on.engine.stats.spec_accepted_tokens > 0
    for pos in (0, 1):
        pvalue = chi_square_pvalue([s[pos] for s in samples["off"]], [s[pos] for s in samples["on"]])
        assert pvalue > 1e-3, f"position {pos + 1}: distributions differ (p={pvalue:.2g})"


def test_draft_flags_are_validated(model_dir, tmp_path):
    with pytest.raises(ValueError, match="needs --draft-model"):
        EngineConfig(speculative_method="draft")
    with pytest.raises(ValueError, match="only with --speculative-method draft"):
        EngineConfig(speculative_method="ngram", draft_model=str(model_dir))
    assert EngineConfig(draft_model=str(model_dir)).speculative_config().method == "draft"
    # A draft whose tokenizer differs from the target's is refused at start-up.
    other = tmp_path / "other-tokenizer"
    shutil.copytree(model_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[1000:1002]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="tokenizer differs"):
        LLM(str(model_dir), kv_cache_memory=16 << 20, draft_model=str(other))


@pytest.mark.slow
def test_server_with_a_draft_model(start_server, model_dir):
    server = start_server("--draft-model", str(model_dir), "--num-speculative-tokens", "3", "--kv-cache-memory", "64M")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x")
    out = client.completions.create(model=server.model, prompt="one two three four five six", max_tokens=12,
                                    temperature=0)
    assert out.usage.completion_tokens == 12
    m = server.metrics()
    assert m["sluice_spec_decode_num_draft_tokens_total"] > 0
    assert m["sluice_spec_decode_num_accepted_tokens_total"] > 0


@pytest.mark.slow
def test_a_gguf_target_keeps_llama_cpp_arithmetic_with_a_draft(model_dir):
    """The bundled GGUF served in its blocks (the `ggml` backend, fp16 cache) with an fp32 draft: the draft gets
    the fp32 path and its own cache, and the target's greedy tokens are the same bits as without the draft
    (its verification rows take the same per-row arithmetic as its decode)."""
    prompts = [[1, 504, 3287, 282, 4649, 314, 253, 1345, 30], [1, 9519, 1159, 288, 253, 1345, 28]]
    params = SamplingParams(max_tokens=12, temperature=0)
    alone = LLM(kv_cache_memory=32 << 20, warmup="off")
    assert alone.engine.runner.backend.name == "ggml"
    want = [c.token_ids for c in alone.generate(prompts, params)]
    del alone
    llm = LLM(kv_cache_memory=32 << 20, warmup="off", draft_model=str(model_dir), num_speculative_tokens=3)
    proposer = llm.engine.proposer
    assert proposer.model.layers[0].self_attn.backend.name == "cpu"
    assert [c.token_ids for c in llm.generate(prompts, params)] == want
    assert llm.engine.stats.spec_accepted_tokens > 0
