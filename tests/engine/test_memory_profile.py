"""The memory profile on CPU (memory_profile.py): the dummy step of the bundled model, and of the bundled
model as its own draft, runs and measures a plausible activation peak; the start-up line reports it;
the CPU budget stays the set one; and the draft's long catch-ups run in forwards no larger than the
token budget the profile measured."""

import logging
import re

import pytest
import torch

from sluice_engine.config import EngineConfig
from sluice_engine.spec_decode import DraftQuery, load_draft_model
from sluice_engine.tokenizer import Tokenizer
from sluice_engine.worker.memory_budget import DEFAULT_CPU_KV_CACHE_BYTES
from sluice_engine.worker.memory_meter import PeakMeter, dummy_step
from sluice_engine.worker.memory_profile import (
    max_sampled_rows,
    plan_kv_cache,
    profile_target_step,
)
from sluice_engine.worker.model_runner import ModelRunner

TOKENS = 48  # --max-num-batched-tokens of the profiled step: small, so a CPU forward is quick
SEQS = 4


@pytest.fixture(scope="module")
def runner_and_draft(model_dir):
    cfg = EngineConfig(model=str(model_dir), max_num_batched_tokens=TOKENS, max_num_seqs=SEQS,
                       draft_model=str(model_dir), num_speculative_tokens=2)
    runner = ModelRunner(cfg, model_dir)
    return runner, load_draft_model(model_dir, runner)


def test_cpu_meter_counts_live_tensors_not_views_or_existing_ones():
    weight = torch.ones(256, 256)
    with PeakMeter(torch.device("cpu")) as meter:
        a = torch.empty(1024, 1024)  # 4 MiB
        view = a.view(-1)[:10]
        del a  # its storage lives on in the view
        b = torch.empty(1024, 1024)  # 4 MiB more: peak 8 MiB
        del b, view
        c = torch.empty(512, 1024)  # 2 MiB, under the peak
        weight.t()  # a view of a tensor made before: nothing allocated
        del c
    assert meter.peak == 8 << 20


def test_dummy_step_spreads_the_token_budget_within_the_context():
    step = dummy_step(100, 8, 16, 4096, every_row=True)
    assert [s.num_tokens for s in step.sched.scheduled] == [13] * 4 + [12] * 4
    assert step.sched.num_tokens == 100 and len(step.sched.logits_layout()[0]) == 100  # every row's logits
    assert step.num_blocks == 1 and all(s.block_ids == [0] for s in step.sched.scheduled)
    # No sequence longer than the context (the rotary tables end there); the scheduler fills no more.
    short = dummy_step(2048, 2, 16, 512, every_row=False)
    assert [s.num_tokens for s in short.sched.scheduled] == [512, 512] and short.num_blocks == 32
    assert len(short.sched.logits_layout()[0]) == 2


def test_sampled_rows_with_and_without_speculation():
    assert max_sampled_rows(EngineConfig(max_num_seqs=64)) == 64
    # 8 speculating sequences (the disable batch size) x (4 drafts + 1) = 40 < 64 running ones.
    assert max_sampled_rows(EngineConfig(max_num_seqs=64, speculative_method="ngram")) == 64
    assert max_sampled_rows(EngineConfig(max_num_seqs=64, speculative_method="ngram",
                                         num_speculative_tokens=9)) == 80
    assert max_sampled_rows(EngineConfig(max_num_seqs=64, max_num_batched_tokens=32)) == 32


@pytest.mark.slow
def test_profile_on_cpu_with_the_model_as_its_own_draft(runner_and_draft, caplog):
    runner, draft = runner_and_draft
    mc = runner.model_config
    with caplog.at_level(logging.INFO, logger="sluice.engine"):
        plan = plan_kv_cache(runner, draft, profile_anyway=True)
    # On CPU the budget stays the set one, both caches out of it, the same number of tokens each.
    per_block = runner.cfg.block_size * (runner.kv_bytes_per_token + draft.kv_bytes_per_token)
    assert plan.num_blocks == plan.draft_num_blocks == DEFAULT_CPU_KV_CACHE_BYTES // per_block
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("memory:"))
    m = re.search(r"activations peak ([\d.]+) MiB \(draft ([\d.]+) MiB\)", line)
    assert m, line
    assert "KV budget 1.00 GiB (the CPU default)" in line and re.search(r"weights [\d.]+ MiB \(\+draft [\d.]+ MiB\)", line)
    assert line.endswith(f"= {plan.num_blocks} blocks (target) + {plan.num_blocks} blocks (draft) "
                         f"= {plan.num_tokens} tokens")
    # The profile leaves no cache behind: the real ones are allocated from the plan.
    assert runner.kv_caches == [] and draft.kv_caches == []

    target, draft_peak = (float(g) * 2**20 for g in m.groups())
    logits = TOKENS * mc.vocab_size * 4  # float32 logits of every row of the step
    # Sane figures: the logits of every row and their log-softmax (prompt logprobs) are alive at once,
    # on top of what sampling left; a few dozen MiB for a 48-token step of a 135M model.
    assert 2 * logits <= target < 256 * 2**20
    # The draft's forward: the fused gate/up projection of every token is alive at some point; its
    # logits are only one row per speculating sequence, so it needs far less than the target.
    assert TOKENS * 2 * mc.intermediate_size * 4 <= draft_peak < target
    # The figure the start-up line rounds is the one a profile measures.
    assert abs(profile_target_step(runner) - target) < 2**20


@pytest.mark.slow
def test_draft_catch_up_runs_in_forwards_of_the_token_budget(runner_and_draft, model_dir, monkeypatch):
    """A whole prompt caught up in forwards of at most --max-num-batched-tokens tokens (the size the
    profile measured) drafts what one forward over it drafts."""
    _, draft = runner_and_draft
    tok = Tokenizer.from_dir(model_dir)
    prompts = [tok.encode("The quick brown fox jumps over the lazy dog, and then it runs into the forest to "
                          "find its friends, who are waiting by the river for the"),
               tok.encode("Paris is the capital of France, and Berlin is the capital of")]
    sizes: list[int] = []
    run = draft._run
    monkeypatch.setattr(draft, "_run", lambda scheduled: (sizes.append(sum(s.num_tokens for s in scheduled)),
                                                          run(scheduled))[1])
    draft.allocate_kv_cache(16)
    try:
        def propose(max_forward_tokens: int) -> list[list[int]]:
            monkeypatch.setattr(draft, "max_forward_tokens", max_forward_tokens)
            sizes.clear()
            out = draft.propose_batch([DraftQuery(str(i), p, 2) for i, p in enumerate(prompts)])
            for i in range(len(prompts)):
                draft.release(str(i))
            return out

        whole = propose(4096)
        assert sizes[0] == sum(map(len, prompts))  # the two catch-ups in one forward
        chunked = propose(8)
        assert max(sizes) <= 8 and len(sizes) > sum(map(len, prompts)) // 8
        assert chunked == whole and all(len(d) == 2 for d in whole)
    finally:
        draft.kv_caches, draft.kv = [], None  # the module's other tests profile a draft without a cache
