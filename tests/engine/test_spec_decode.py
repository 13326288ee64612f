"""Speculative decoding: n-gram prompt lookup, the verifier's rejection sampling (the output has the
target's distribution), and lossless greedy output through the engine on the real model."""

import dataclasses

import pytest
import torch
from distribution import chi_square_pvalue
from spec_prompts import PROMPTS

from sluice_engine.config import EngineConfig
from sluice_engine.core.request import Request
from sluice_engine.entrypoints.llm import LLM
from sluice_engine.sample.sampler import Sampler
from sluice_engine.sampling_params import SamplingParams
from sluice_engine.spec_decode.ngram import NgramProposer, ngram_propose

CPU = torch.device("cpu")


# -- n-gram proposer -----------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_match():
    toks = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert ngram_propose(toks, k=3, n_min=2, n_max=3) == [4, 5, 9]
    # The most recent earlier occurrence wins: [7, 8] appears twice, followed by 1 then by 2.
    assert ngram_propose([7, 8, 1, 7, 8, 2, 7, 8], k=1, n_min=2, n_max=2) == [2]


def test_ngram_prefers_the_longest_match_and_respects_k():
    # The 1-gram [3] last occurred before 6; the 3-gram [1, 2, 3] before 4.
    toks = [1, 2, 3, 4, 0, 3, 6, 1, 2, 3]
    assert ngram_propose(toks, k=1, n_min=1, n_max=3) == [4]
    assert ngram_propose(toks, k=1, n_min=1, n_max=1) == [6]
    assert ngram_propose(toks, k=10, n_min=3, n_max=3) == [4, 0, 3, 6, 1, 2, 3]  # up to the end
    assert NgramProposer(k=4, n_min=2, n_max=4).propose(toks, max_tokens=2) == [4, 0]


def test_ngram_without_a_match_proposes_nothing():
    assert ngram_propose([1, 2, 3, 4, 5], k=4, n_min=2, n_max=4) == []
    assert ngram_propose([1, 1], k=4, n_min=2, n_max=4) == []  # too short for a 2-gram plus a match
    assert ngram_propose([5, 5, 5], k=2, n_min=2, n_max=2) == [5]


def test_speculative_flags_are_validated():
    with pytest.raises(ValueError, match="--speculative-method"):
        EngineConfig(speculative_method="medusa")
    with pytest.raises(ValueError, match="--ngram-min"):
        EngineConfig(speculative_method="ngram", ngram_min=3, ngram_max=2)
    with pytest.raises(ValueError, match="--num-speculative-tokens"):
        EngineConfig(speculative_method="ngram", num_speculative_tokens=0)


# -- verifier ------------------------------------------------------------------------------------
def _req(drafts, seed=None, **params) -> Request:
    r = Request("r", [1, 2, 3], SamplingParams(**params))
    r.spec_token_ids = list(drafts)
    if seed is not None:
        r.generator = torch.Generator().manual_seed(seed)
    return r


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "drew a token of probability 0"
    n = counts.sum()
    exp = probs[keep] * n
    stat = ((counts[keep] - exp) ** 2 / exp).sum()
    dof = int(keep.sum()) - 1
    assert dof >= 1 and exp.min() >= 5, "chi-square cannot be computed here: too few categories or draws"
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat.double() / 2))


def test_greedy_verification_accepts_the_argmax_prefix():
    logits = torch.full((4, 10), -5.0)
    for row, tok in enumerate([4, 7, 1, 2]):
        logits[row, tok] = 5.0
    sampler = Sampler(CPU)
    (tokens, _), = sampler.verify(logits, [_req([4, 7, 3], temperature=0)])
    assert tokens == [4, 7, 1]  # two drafts accepted, the third replaced by the target's argmax
    (tokens, _), = sampler.verify(logits, [_req([4, 7, 1], temperature=0)])
    assert tokens == [4, 7, 1, 2]  # all accepted, plus the bonus token


def test_rejection_sampling_preserves_the_target_distribution():
    """First emitted token ~ p0 whatever the draft; given the draft was accepted, the next ~ p1."""
    torch.manual_seed(0)
    vocab = 6
    logits = torch.randn(3, vocab) * 1.5
    params = dict(temperature=0.8, top_k=5)
    # What plain sampling draws from: temperature 0.8, then the top 5 of 6 renormalised.
    scaled = logits / 0.8
    p = scaled.masked_fill(scaled <= scaled.min(dim=-1, keepdim=True).values, float("-inf")).softmax(-1)
    drafts = [int(p[0].argmax()), int(p[1].argsort()[-2])]  # a likely and a less likely guess
    sampler = Sampler(CPU, seed=1)
    first = torch.zeros(vocab, dtype=torch.float64)
    second = torch.zeros(vocab, dtype=torch.float64)
    lengths = torch.zeros(4)
    for _ in range(6000):
        (tokens, _), = sampler.verify(logits, [_req(drafts, **params)])
        first[tokens[0]] += 1
        lengths[len(tokens)] += 1
        if tokens[0] == drafts[0]:
            second[tokens[1]] += 1
    p = p.double()
    assert _chi2_pvalue(first, p[0]) > 1e-3
    assert _chi2_pvalue(second, p[1]) > 1e-3
    # Acceptance of draft 0 happens with probability p0(d0).
    assert abs(lengths[2:].sum() / 6000 - p[0, drafts[0]]) < 0.03


def test_verification_with_a_seeded_request_is_reproducible():
    logits = torch.randn(3, 20)
    a = Sampler(CPU, seed=1).verify(logits, [_req([3, 4], seed=7, temperature=1.0)])
    b = Sampler(CPU, seed=2).verify(logits, [_req([3, 4], seed=7, temperature=1.0)])
    assert a == b


# -- end to end on the real model -----------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(model_dir):
    base = dict(kv_cache_memory=64 << 20, seed=0)
    off = LLM(str(model_dir), **base)
    on = LLM(str(model_dir), speculative_method="ngram", num_speculative_tokens=4, **base)
    return off, on


@pytest.mark.slow
def test_greedy_output_is_identical_with_speculation(engines):
    off, on = engines
    assert len(PROMPTS) >= 32
    encoded = [off.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(max_tokens=16, temperature=0)
    want = [c.token_ids for c in off.generate(encoded, params)]
    # Concurrent: batches of 8 (the default --speculative-disable-batch-size), drafts verified side by side.
    concurrent = [c.token_ids for i in range(0, len(encoded), 8) for c in on.generate(encoded[i : i + 8], params)]
    assert on.engine.stats.spec_accepted_tokens > 0, "speculation never kicked in"
    assert concurrent == want
    # Batch 1: one prompt of each passage (its "Repeat exactly" variant, where drafts match most), as
    # test_draft_model.py does; all 32 one at a time were most of this test's time.
    batch1 = [on.generate([e], params)[0].token_ids for e in encoded[::4]]
    assert batch1 == want[::4]
    st = on.engine.stats
    assert st.spec_accepted_tokens <= st.spec_draft_tokens
    assert st.spec_drafted_per_pos[0] >= st.spec_drafted_per_pos[-1]


@pytest.mark.slow
def test_stops_and_lengths_hold_with_accepted_drafts(engines):
    off, on = engines
    prompt = [off.tokenizer.encode_chat([{"role": "user", "content": PROMPTS[0]}])]
    for params in (SamplingParams(max_tokens=7, temperature=0), SamplingParams(max_tokens=40, temperature=0, stop=["dog"])):
        a, b = off.generate(prompt, params)[0], on.generate(prompt, params)[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
    assert len(on.generate(prompt, SamplingParams(max_tokens=7, temperature=0))[0].token_ids) == 7


@pytest.mark.slow
def test_sampled_output_distribution_matches_without_speculation(engines):
    """Same short horizon, many draws with and without speculation: a two-sample chi-square test over
    the second and third tokens (the ones verified against drafts) cannot tell them apart."""
    off, on = engines
    prompt = off.tokenizer.encode_chat([{"role": "user", "content": "Say 'la la la la la la la la' again."}])
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=8)
    draws = 96
    samples = {}
    for name, llm in (("off", off), ("on", on)):
        before = llm.engine.stats.spec_draft_tokens
        # Groups of 8: at most --speculative-disable-batch-size running, so every step speculates.
        outs = [c for _ in range(draws // 8) for c in llm.generate([prompt] * 8, dataclasses.replace(params, seed=None))]
        samples[name] = [tuple(c.token_ids[1:3]) for c in outs if len(c.token_ids) == 3]
        if name == "on":
            assert llm.engine.stats.spec_draft_tokens > before, "no drafts were verified"
    for pos in (0, 1):
        pvalue = chi_square_pvalue([s[pos] for s in samples["off"]], [s[pos] for s in samples["on"]])
        assert pvalue > 1e-3, f"position {pos + 1}: distributions differ (p={pvalue:.2g})"


def test_no_drafts_above_the_batch_size_threshold(model_dir):
    llm = LLM(str(model_dir), kv_cache_memory=32 << 20, speculative_method="ngram", speculative_disable_batch_size=2)
    # Distinct prompts (identical ones would fork from the first, which then runs alone for a step).
    prompts = [llm.tokenizer.encode(f"{w} b {w} b {w} b {w} b {w} b") for w in ("a", "c", "d", "e")]
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0))
    assert llm.engine.stats.spec_draft_tokens == 0
    llm.generate(prompts[:1], SamplingParams(max_tokens=6, temperature=0))
    assert llm.engine.stats.spec_draft_tokens > 0
    # The counters reach /metrics (read here through the exporter's collector, in process).
    from sluice_engine.metrics import _EngineCollector

    families = {f.name: f for f in _EngineCollector(llm.engine).collect()}
    st = llm.engine.stats
    assert families["sluice_spec_decode_num_draft_tokens"].samples[0].value == st.spec_draft_tokens
    assert families["sluice_spec_decode_num_accepted_tokens"].samples[0].value == st.spec_accepted_tokens
    assert families["sluice_spec_decode_num_drafts"].samples[0].value == st.spec_drafted_per_pos[0]
