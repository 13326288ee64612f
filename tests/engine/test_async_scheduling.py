"""Async scheduling (issue 25): the next step is scheduled and queued while this one computes, and the tokens
are exactly those of steps run one at a time, on the real model: greedy, seeded sampling, prompt logprobs and
n > 1 siblings, preemption, grammars and logits processors, speculative decoding, and requests ended while a
step ahead of them is in flight."""

from __future__ import annotations

import json

import pytest

from sluice_engine.entrypoints.llm import LLM
from sluice_engine.sampling_params import SamplingParams
from sluice_engine.structured import StructuredOutputs
from sluice_engine.structured.grammar import GrammarSpec

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,", "Once upon a time",
           "List three colours:", "def add(a, b):"]


def _pair(model_dir, **kw) -> dict[bool, LLM]:
    return {mode: LLM(str(model_dir), max_model_len=256, async_scheduling=mode, **kw) for mode in (False, True)}


@pytest.fixture(scope="module")
def llms(model_dir):
    pair = _pair(model_dir, max_num_seqs=8)
    yield pair
    for llm in pair.values():
        llm.engine.shutdown()


def _tokens(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


def test_steps_run_ahead_and_give_the_same_tokens(llms):
    eng = llms[True].engine
    assert eng.async_scheduling and not llms[False].engine.async_scheduling
    depths: list[int] = []
    start = eng._start_step

    def counting_start() -> bool:
        depths.append(len(eng._in_flight))
        return start()

    eng._start_step = counting_start
    try:
        params = SamplingParams(max_tokens=20, temperature=0)  # stop tokens end some early
        got = {m: _tokens(llm.generate(PROMPTS, params)) for m, llm in llms.items()}
    finally:
        del eng._start_step
    assert got[True] == got[False]
    assert max(depths) == 1  # a step was scheduled while another was in flight...
    assert max(len(t) for t in got[True]) == 20  # ...and lengths and stop tokens still end requests exactly
    for llm in llms.values():
        kv = llm.engine.kv
        assert kv.num_free_blocks() == kv.num_blocks and not kv.req_blocks  # nothing leaked


def test_seeded_sampling_prompt_logprobs_and_siblings_are_the_same(llms):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=11, n=2, logprobs=2, prompt_logprobs=1,
                            presence_penalty=0.5)
    got = {m: llm.generate(PROMPTS[:3], params) for m, llm in llms.items()}
    assert _tokens(got[True]) == _tokens(got[False])
    for a, b in zip(got[True], got[False], strict=True):
        assert a.prompt_logprobs == b.prompt_logprobs
        assert [lp for lp, _ in a.logprobs] == pytest.approx([lp for lp, _ in b.logprobs], abs=1e-5)


def test_preemption_with_a_step_in_flight_gives_the_same_tokens(model_dir):
    # A KV cache of a few blocks for 8 growing requests: the scheduler preempts by recompute, in async mode
    # while the preempted request's step ahead is in flight.
    pair = _pair(model_dir, max_num_seqs=8, kv_cache_memory=24 * 16 * 30 * 2 * 3 * 64 * 4)
    try:
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        got = {m: _tokens(llm.generate(PROMPTS + PROMPTS[:2], params)) for m, llm in pair.items()}
        assert got[True] == got[False]
        for llm in pair.values():
            assert llm.engine.scheduler.num_preemptions > 0
            assert llm.engine.kv.num_free_blocks() == llm.engine.kv.num_blocks
    finally:
        for llm in pair.values():
            llm.engine.shutdown()


def _run_engine(eng, requests) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for rid, text, params, procs in requests:
        eng.add_request(rid, eng.tokenizer.encode(text), params, procs)
        got[rid] = []
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id].extend(o.new_token_ids)
    return got


def test_grammars_and_logits_processors_see_every_earlier_token(llms):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name", "n"]}

    def no_repeat(history: list[int], row):
        # Reads the tokens so far: with a step ahead in flight it must still see the one sampled just before.
        if history:
            row[history[-1]] = float("-inf")
        return row

    got = {}
    for mode, llm in llms.items():
        eng = llm.engine
        so = StructuredOutputs(eng.tokenizer, eng.model_info.vocab_size, eng.model_info.eos_token_ids)
        compiled = so.compiled_now(GrammarSpec("json_schema", json.dumps(schema), "guided_json"))
        greedy = SamplingParams(max_tokens=40, temperature=0)
        reqs = [(f"g{i}", text, greedy, [so.constraint(compiled)]) for i, text in enumerate(PROMPTS[:3])]
        reqs += [(f"p{i}", text, SamplingParams(max_tokens=16, temperature=0), [no_repeat])
                 for i, text in enumerate(PROMPTS[3:])]
        reqs.append(("plain", PROMPTS[0], greedy, None))
        got[mode] = _run_engine(eng, reqs)
    assert got[True] == got[False]
    for i in range(3):
        json.loads(llms[True].tokenizer.decode(got[True][f"g{i}"]).strip())  # the grammar held to the end
    for i in range(3):
        toks = got[True][f"p{i}"]
        assert all(a != b for a, b in zip(toks, toks[1:], strict=False))


def test_an_abort_with_a_step_ahead_in_flight_leaves_the_rest_exact(llms):
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    got = {}
    for mode, llm in llms.items():
        eng = llm.engine
        for i, text in enumerate(PROMPTS[:4]):
            eng.add_request(f"r{i}", eng.tokenizer.encode(text), greedy)
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
        steps = 0
        while eng.has_unfinished():
            for o in eng.step():
                tokens[o.request_id].extend(o.new_token_ids)
            steps += 1
            if steps == 5:
                eng.abort_request("r1")  # its next step is already queued in async mode
        got[mode] = tokens
        assert eng.kv.num_free_blocks() == eng.kv.num_blocks
    assert got[True] == got[False]
    assert len(got[True]["r1"]) < 16 and all(len(got[True][r]) == 16 for r in ("r0", "r2", "r3"))


def test_speculative_decoding_is_exact_and_runs_its_drafts_alone(model_dir):
    pair = _pair(model_dir, max_num_seqs=8, speculative_method="ngram")
    try:
        rep = "Repeat after me: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat,"
        params = SamplingParams(max_tokens=24, temperature=0)
        got = {m: _tokens(llm.generate([rep, rep + " and", *PROMPTS[:2]], params)) for m, llm in pair.items()}
        assert got[True] == got[False]
        assert pair[True].engine.stats.spec_accepted_tokens > 0
    finally:
        for llm in pair.values():
            llm.engine.shutdown()
