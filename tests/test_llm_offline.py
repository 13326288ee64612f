"""The offline `LLM` API over the same engine, on the real model."""

import pytest

from sluice_engine.engine import RequestRejected
from sluice_engine.llm import LLM
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
