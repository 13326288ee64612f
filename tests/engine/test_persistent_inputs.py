"""Issue 15, acceptance 2: the persistent-buffer step inputs (input_buffers.py, eager on CPU) give the same
tokens and logprobs (within 1e-5) as the per-step builder they replaced (reference_inputs.py), on the
bundled model in float32, with the CPU and the torch attention backends.

One engine per configuration runs the same workload twice in this process: first with the reference
builder swapped into its runner (and its draft model), then with its own persistent buffers. The workload
mixes prompt chunks and decodes in one batch, shares a system prompt (prefix-cache hits) and a whole prompt
(a fork with a block copy), asks for prompt logprobs, samples with a seed, speculates (n-gram or a draft
model), and has a KV cache small enough that requests are preempted and resumed. The engine's counters
prove each of those happened in both runs."""

import dataclasses

import pytest
from reference_inputs import ReferenceInputs

from sluice_engine.config import EngineConfig
from sluice_engine.engine.llm_engine import LLMEngine
from sluice_engine.sampling_params import SamplingParams
from sluice_engine.spec_decode.layer_draft import write_layer_draft
from sluice_engine.worker.input_buffers import InputBuffers

pytestmark = pytest.mark.slow

LOGPROB_TOL = 1e-5
BLOCK = 16
KV_BLOCKS = 14  # 4 blocks a request (prompt ~45 tokens + 16), 6 running at once: preemption is certain

SYSTEM = ("You are a careful assistant. Repeat the user's words exactly, then continue the pattern they "
          "follow for as long as you are asked to. ")  # two blocks of it are shared by every prompt
TAILS = [
    "one two three, one two three, one two three,",
    "red green blue red green blue red green",
    "the cat sat on the mat and the cat sat on the",
    "alpha beta gamma delta alpha beta gamma delta alpha",
    "1 2 3 4 5 1 2 3 4 5 1 2 3",
]


def workload(engine: LLMEngine) -> list[tuple[int, str, list[int], SamplingParams]]:
    """(step to add it at, request id, prompt, params): arrivals spread over the first steps, so new
    prompts' chunks share batches with running decodes."""
    enc = engine.tokenizer.encode
    greedy = SamplingParams(max_tokens=16, temperature=0, logprobs=3)
    prompts = [enc(SYSTEM + t) for t in TAILS]
    return [
        (0, "a", prompts[0], greedy),
        (0, "b", prompts[1], greedy),
        (0, "plp", prompts[2], dataclasses.replace(greedy, prompt_logprobs=2)),  # every prompt row's logits
        (2, "a-twin", prompts[0], greedy),  # the same prompt while a runs: forks a's blocks
        (2, "seeded", prompts[3], SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=7, logprobs=3)),
        (5, "c", prompts[2], greedy),  # the system prompt's blocks are cached by now
        (5, "d", prompts[4], greedy),
        (9, "e", prompts[3], greedy),
    ]


def run(engine: LLMEngine, work) -> tuple[dict, dict]:
    """Outputs by request id, and what the engine's counters say happened during the run."""
    engine.kv.pool.reset_prefix_cache()  # the second run must schedule exactly as the first
    st, kv, sched = engine.stats, engine.kv, engine.scheduler
    before = (sched.num_preemptions, kv.prefix_hits, st.spec_draft_tokens, st.spec_accepted_tokens)
    outs: dict[str, dict] = {}
    pending = sorted(work, key=lambda w: w[0])
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
            outs[rid] = {"tokens": [], "logprobs": [], "prompt_logprobs": None, "finish": None}
        for out in engine.step():
            o = outs[out.request_id]
            o["tokens"] += out.new_token_ids
            o["logprobs"] += out.logprobs
            if out.prompt_logprobs is not None:
                o["prompt_logprobs"] = out.prompt_logprobs
            if out.finished:
                o["finish"] = out.finish_reason
        step += 1
    after = (sched.num_preemptions, kv.prefix_hits, st.spec_draft_tokens, st.spec_accepted_tokens)
    counters = dict(zip(("preemptions", "prefix_hit_tokens", "drafts", "accepted"),
                        (y - x for x, y in zip(before, after, strict=True)), strict=True))
    return outs, counters


def assert_logprobs_close(got, want, where):
    assert len(got) == len(want), where
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        (g_lp, g_top), (w_lp, w_top) = g, w
        assert abs(g_lp - w_lp) <= LOGPROB_TOL, (where, i, g_lp, w_lp)
        assert [t for t, _ in g_top] == [t for t, _ in w_top], (where, i)
        assert all(abs(a - b) <= LOGPROB_TOL for (_, a), (_, b) in zip(g_top, w_top, strict=True)), (where, i)


def compare(engine: LLMEngine, uses_draft: bool = False) -> dict:
    persistent = engine.runner.inputs
    assert isinstance(persistent, InputBuffers)
    work = workload(engine)
    reference = ReferenceInputs(engine.cfg.block_size, engine.runner.device)
    engine.runner.inputs = reference
    if uses_draft:
        draft_inputs, engine.proposer.inputs = engine.proposer.inputs, ReferenceInputs(engine.cfg.block_size,
                                                                                        engine.runner.device)
    want, want_counts = run(engine, work)
    engine.runner.inputs = persistent
    if uses_draft:
        engine.proposer.inputs = draft_inputs
    got, got_counts = run(engine, work)
    assert reference.steps > 0 and got_counts == want_counts, (got_counts, want_counts)
    for rid, w in want.items():
        g = got[rid]
        assert w["finish"] is not None and g["finish"] == w["finish"], rid
        assert g["tokens"] == w["tokens"], rid
        assert_logprobs_close(g["logprobs"], w["logprobs"], rid)
    assert_logprobs_close(got["plp"]["prompt_logprobs"], want["plp"]["prompt_logprobs"], "prompt logprobs")
    # Every request's row went back, but those of the last to finish: their release rides on the next step.
    assert set(persistent.rows.holders()) <= set(engine.scheduler._freed)
    # What the workload is for: all of it happened (the same in both runs, checked above).
    assert got_counts["preemptions"] > 0 and got_counts["prefix_hit_tokens"] > 0, got_counts
    assert got_counts["drafts"] > 0, got_counts
    return got_counts


def engine_config(model_dir, draft_layers: int = 0, **kw) -> EngineConfig:
    # SmolLM2-135M in float32: 30 layers, 3 KV heads of 64. --kv-cache-memory holds the draft's cache too
    # (the same number of blocks, of its own layers).
    per_block = 2 * (30 + draft_layers) * 3 * 64 * 4 * BLOCK
    return EngineConfig(model=str(model_dir), device="cpu", dtype="float32", block_size=BLOCK,
                        kv_cache_memory=KV_BLOCKS * per_block, max_num_seqs=6, max_num_batched_tokens=64,
                        max_model_len=KV_BLOCKS * BLOCK, **kw)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_same_outputs_as_the_per_step_builder_with_ngram_speculation(model_dir, backend):
    engine = LLMEngine(engine_config(model_dir, attention_backend=backend, speculative_method="ngram",
                                     num_speculative_tokens=3))
    assert engine.kv.num_blocks == KV_BLOCKS
    assert compare(engine)["accepted"] > 0  # some drafts verified in place, the rest rolled back


def test_same_outputs_as_the_per_step_builder_with_a_draft_model(model_dir, tmp_path):
    draft = write_layer_draft(model_dir, tmp_path / "draft-4l", 4)  # weak: its drafts are mostly rejected
    engine = LLMEngine(engine_config(model_dir, draft_layers=4, attention_backend="cpu", draft_model=str(draft),
                                     num_speculative_tokens=3))
    assert engine.kv.num_blocks == KV_BLOCKS
    compare(engine, uses_draft=True)
