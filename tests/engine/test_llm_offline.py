"""The offline `LLM` API over the same engine, on the real model."""

import pytest

from sluice_engine.engine.model_info import RequestRejected
from sluice_engine.entrypoints.llm import LLM
from sluice_engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), max_model_len=256)


def test_generate_n_seed_and_prompt_logprobs(llm):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=2, prompt_logprobs=1)
    a = llm.generate(["The weather today is", "My cat likes"], params)
    b = llm.generate(["The weather today is", "My cat likes"], params)
    assert len(a) == 4 and [c.text for c in a] == [c.text for c in b]
    assert a[0].prompt_token_ids == a[1].prompt_token_ids and a[0].token_ids != a[1].token_ids
    for c in a:
        assert len(c.prompt_logprobs) == len(c.prompt_token_ids) - 1
        assert all(lp <= 0 and len(top) == 1 for lp, top in c.prompt_logprobs)


def test_rejected_prompt_leaves_engine_clean(llm):
    with pytest.raises(RequestRejected, match="context window"):
        llm.generate(["fine", "word " * 300], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished()
    (out,) = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0))
    assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_chat_uses_the_template(llm):
    out = llm.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams(max_tokens=8, temperature=0))
    assert out.text and out.prompt_token_ids[0] == llm.tokenizer.token_to_id("<|im_start|>")


def test_n_siblings_fork_the_prompt_instead_of_prefilling_it(model_dir):
    # No prefix cache and a small step budget: without forking every sibling would prefill the whole
    # prompt in chunks; forked, each computes one token of it and shares (or copies) the rest.
    llm = LLM(str(model_dir), max_model_len=256, enable_prefix_caching=False, max_num_batched_tokens=16,
              kv_cache_memory=16 << 20)
    prompt = "Write one sentence about the sea and the wind and the old lighthouse keeper who"
    (single,) = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0))
    outs = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, n=3))
    assert [o.token_ids for o in outs] == [single.token_ids] * 3
    n_prompt = len(single.prompt_token_ids)
    assert n_prompt % llm.engine.cfg.block_size != 1  # the fork has a partial block to copy
    assert [o.num_cached_tokens for o in outs] == [0, n_prompt - 1, n_prompt - 1]
    kv = llm.engine.kv
    assert kv.num_free_blocks() == kv.num_blocks and not kv.req_blocks  # nothing leaked
    seeded = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=3))
    again = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=3))
    assert [o.token_ids for o in seeded] == [o.token_ids for o in again]
    assert len({tuple(o.token_ids) for o in seeded}) > 1
