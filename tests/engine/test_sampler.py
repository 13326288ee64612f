"""The sampler row by row: greedy, seeded sampling, top-k / top-p / min-p supports, temperature
frequencies, OpenAI/vLLM penalties, raw logprobs, logits processors; and SamplingParams validation."""

import math

import pytest
import torch

from sluice_engine.core.request import Request
from sluice_engine.sample.sampler import Sampler
from sluice_engine.sampling_params import InvalidParam, SamplingParams

V = 100
CPU = torch.device("cpu")

# Upper 0.1% points of the chi-square distribution by degrees of freedom (tests are seeded, so this is
# only a bound on how wrong a distribution may look, not a source of flakiness).
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88}


pytestmark = pytest.mark.usefixtures("one_thread")


def make_req(rid="r", prompt=(1, 2, 3), output=(), processors=(), seed=None, **params) -> Request:
    r = Request(rid, list(prompt), SamplingParams(**params), logits_processors=list(processors))
    for t in output:
        r.append_output_token(t)
    if seed is not None:  # what LLMEngine.add_request does for a seeded request
        r.generator = torch.Generator(device=CPU)
        r.generator.manual_seed(seed)
    return r


def rand_logits(rows: int, vocab: int = V, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def draw(logits_row: torch.Tensor, n: int, seed: int = 0, **params) -> torch.Tensor:
    """n independent samples from one row (a batch of n identical rows, unseeded requests)."""
    sampler = Sampler(CPU, seed=seed)
    reqs = [make_req(f"r{i}", **params) for i in range(n)]
    out = sampler(logits_row.expand(n, -1).contiguous(), reqs)
    return torch.tensor(out.token_ids)


def chi_square(samples: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's statistic of the samples against `expected` probabilities; tokens with expected
    probability 0 must never be drawn."""
    n = samples.numel()
    counts = torch.bincount(samples, minlength=expected.numel()).double()
    zero = expected == 0
    assert counts[zero].sum() == 0, f"drew tokens of probability 0: {zero.nonzero().flatten().tolist()}"
    exp = expected[~zero].double() * n
    assert exp.min() >= 5, "test setup: too few draws for a chi-square check"
    return float(((counts[~zero] - exp) ** 2 / exp).sum())


def assert_distribution(samples: torch.Tensor, expected: torch.Tensor) -> None:
    df = int((expected > 0).sum()) - 1
    stat = chi_square(samples, expected)
    assert stat < CHI2_999[df], f"chi2={stat:.1f} with {df} dof; expected probs {expected.tolist()}"


# -- greedy ----------------------------------------------------------------------------------------
def test_greedy_is_argmax():
    logits = rand_logits(16)
    reqs = [make_req(f"r{i}", temperature=0.0) for i in range(16)]
    out = Sampler(CPU)(logits, reqs)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 16


def test_greedy_rows_stay_argmax_in_a_mixed_batch():
    logits = rand_logits(8)
    reqs = [make_req(f"r{i}", temperature=0.0 if i % 2 == 0 else 1.0, top_p=0.9) for i in range(8)]
    out = Sampler(CPU)(logits, reqs)
    assert out.token_ids[::2] == logits[::2].argmax(-1).tolist()


def test_top_k_1_equals_greedy():
    logits = rand_logits(32, seed=1, scale=0.5)  # flat rows: plain sampling would rarely pick the argmax
    alone = Sampler(CPU)(logits, [make_req(f"r{i}", temperature=1.5, top_k=1) for i in range(32)])
    assert alone.token_ids == logits.argmax(-1).tolist()
    # Also through the sampling path: top_k=1 rows batched with ordinary sampled rows.
    reqs = [make_req(f"r{i}", temperature=1.5, top_k=1 if i % 2 else -1) for i in range(32)]
    mixed = Sampler(CPU)(logits, reqs)
    assert mixed.token_ids[1::2] == logits[1::2].argmax(-1).tolist()


# -- seeded sampling ---------------------------------------------------------------------------------
def _seeded_run(sampler_seed: int, batch_layout: str, steps: int = 24, seed: int = 1234, **params) -> list[int]:
    """The tokens a seeded request samples over `steps` steps, with other rows around it."""
    sampler = Sampler(CPU, seed=sampler_seed)
    target = make_req("target", seed=seed, **params)
    tokens = []
    for step in range(steps):
        row = rand_logits(1, seed=1000 + step, scale=1.0)  # fairly flat: many tokens are likely
        if batch_layout == "alone":
            reqs, logits = [target], row
        else:
            others = [
                make_req("u1", temperature=0.8),
                make_req("s2", seed=99, temperature=1.3, top_k=10),
                make_req("g3", temperature=0.0),
                make_req("u4", temperature=1.0, top_p=0.5, min_p=0.1),
            ]
            reqs = others[:2] + [target] + others[2:] if batch_layout == "middle" else [target, *others]
            logits = rand_logits(len(reqs), seed=5000 + step, scale=2.0)
            logits[reqs.index(target)] = row[0]
        out = sampler(logits, reqs)
        tok = out.token_ids[reqs.index(target)]
        target.append_output_token(tok)
        tokens.append(tok)
    return tokens


@pytest.mark.parametrize("params", [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.95, "top_k": 50}])
def test_seeded_request_is_reproducible_across_samplers_and_batches(params):
    ref = _seeded_run(0, "alone", **params)
    assert len(set(ref)) > 5, "test setup: the distribution should be spread"
    assert _seeded_run(12345, "alone", **params) == ref  # a different engine-wide seed
    assert _seeded_run(7, "middle", **params) == ref  # other rows before and after it
    assert _seeded_run(0, "first", **params) == ref
    assert _seeded_run(0, "alone", seed=4321, **params) != ref  # the seed does matter


def test_unseeded_rows_follow_the_sampler_seed():
    logits = rand_logits(64, scale=1.0)
    reqs = [make_req(f"r{i}") for i in range(64)]
    a = Sampler(CPU, seed=3)(logits, reqs).token_ids
    b = Sampler(CPU, seed=3)(logits, reqs).token_ids
    c = Sampler(CPU, seed=4)(logits, reqs).token_ids
    assert a == b and a != c


def test_seeded_rows_sample_the_right_distribution():
    # 3000 requests, each with its own seed: the per-request-generator path must sample softmax too.
    logits = torch.tensor([1.0, 0.0, -0.5, 0.5, -1.0])
    n = 3000
    reqs = [make_req(f"r{i}", seed=i) for i in range(n)]
    out = Sampler(CPU)(logits.expand(n, -1).contiguous(), reqs)
    assert_distribution(torch.tensor(out.token_ids), logits.softmax(-1))


# -- supports of top-k / top-p / min-p -----------------------------------------------------------------
def test_top_k_never_samples_outside_the_k_largest():
    logits = rand_logits(1, seed=2, scale=1.0)[0]
    samples = draw(logits, 4000, top_k=7)
    allowed = set(logits.topk(7).indices.tolist())
    assert set(samples.tolist()) <= allowed
    assert set(samples.tolist()) == allowed  # flat logits: all seven do get drawn


def _top_p_set(probs: torch.Tensor, top_p: float) -> set[int]:
    """The smallest set of most likely tokens whose mass reaches top_p."""
    order = probs.argsort(descending=True)
    kept, mass = [], 0.0
    for t in order.tolist():
        if mass >= top_p:
            break
        kept.append(t)
        mass += float(probs[t])
    return set(kept)


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.9])
def test_top_p_never_samples_outside_the_nucleus(top_p):
    logits = rand_logits(1, seed=3, scale=1.5)[0]
    probs = logits.softmax(-1)
    allowed = _top_p_set(probs, top_p)
    cum = probs.sort(descending=True).values.cumsum(0)
    assert (cum - top_p).abs().min() > 1e-4, "test setup: nucleus boundary too close to call"
    samples = set(draw(logits, 4000, top_p=top_p).tolist())
    assert samples <= allowed
    assert len(samples) >= min(len(allowed), 3)


def test_top_p_keeps_the_top_token_even_when_it_alone_exceeds_p():
    logits = torch.full((V,), -5.0)
    logits[17] = 5.0
    assert set(draw(logits, 500, top_p=0.01).tolist()) == {17}


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.8])
def test_min_p_never_samples_below_the_threshold(min_p):
    logits = rand_logits(1, seed=4, scale=1.5)[0]
    probs = logits.softmax(-1)
    allowed = set((probs >= min_p * probs.max()).nonzero().flatten().tolist())
    samples = set(draw(logits, 4000, min_p=min_p).tolist())
    assert samples <= allowed
    assert len(samples) >= min(len(allowed), 2)


def test_min_p_is_relative_to_the_tempered_distribution():
    # At temperature 2 the distribution flattens, so more tokens clear min_p * max.
    logits = rand_logits(1, seed=5, scale=2.0)[0]
    temp, min_p = 2.0, 0.2
    probs = (logits / temp).softmax(-1)
    allowed = set((probs >= min_p * probs.max()).nonzero().flatten().tolist())
    assert len(allowed) > len((logits.softmax(-1) >= min_p * logits.softmax(-1).max()).nonzero())
    samples = set(draw(logits, 4000, temperature=temp, min_p=min_p).tolist())
    assert samples <= allowed and len(samples) >= 2


# -- sampled frequencies -------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sampling_matches_softmax(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0])
    samples = draw(logits, 6000, seed=11, temperature=temperature)
    assert_distribution(samples, (logits / temperature).softmax(-1))


def test_truncated_sampling_matches_renormalised_softmax():
    # temperature -> top-k -> top-p -> min-p, each renormalising what survives (vLLM's order).
    logits = torch.tensor([3.0, 2.5, 2.0, 1.2, 1.0, 0.1, -1.0, -2.0])
    temp = 1.5
    p = (logits / temp).softmax(-1)
    keep = torch.zeros_like(p, dtype=torch.bool)
    keep[:6] = True  # top_k=6
    p = torch.where(keep, p, 0.0)
    p = p / p.sum()
    keep &= torch.tensor([t in _top_p_set(p, 0.9) for t in range(len(p))])  # top_p=0.9
    p = torch.where(keep, p, 0.0)
    p = p / p.sum()
    p = torch.where(p >= 0.15 * p.max(), p, 0.0)  # min_p=0.15
    p = p / p.sum()
    assert 2 < int((p > 0).sum()) < 6, "test setup: each filter should matter"
    samples = draw(logits, 6000, seed=12, temperature=temp, top_k=6, top_p=0.9, min_p=0.15)
    assert_distribution(samples, p)


# -- penalties (vLLM / OpenAI definitions) ---------------------------------------------------------------
def _pick(logits_row: torch.Tensor, **kw) -> int:
    return Sampler(CPU)(logits_row[None].clone(), [make_req(temperature=0.0, **kw)]).token_ids[0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    a, b = 5, 9  # a has been seen, b has not
    pos = torch.full((V,), -10.0)
    pos[a], pos[b] = 2.0, 1.5
    assert _pick(pos, prompt=[a]) == a
    assert _pick(pos, prompt=[a], repetition_penalty=1.2) == a  # 2 / 1.2 = 1.67 > 1.5
    assert _pick(pos, prompt=[a], repetition_penalty=1.5) == b  # 2 / 1.5 = 1.33 < 1.5
    # A negative logit is multiplied (pushed further down), not divided (which would raise it).
    neg = torch.full((V,), -10.0)
    neg[a], neg[b] = -1.0, -1.5
    assert _pick(neg, prompt=[a], repetition_penalty=1.4) == a  # -1.4 > -1.5
    assert _pick(neg, prompt=[a], repetition_penalty=2.0) == b  # -2.0 < -1.5
    # Output tokens count as seen too, and a penalty below 1 favours seen tokens.
    assert _pick(pos, prompt=[1], output=[a], repetition_penalty=1.5) == b
    assert _pick(pos, prompt=[1], output=[b], repetition_penalty=1.5) == a
    assert _pick(pos, prompt=[b], repetition_penalty=0.5) == b  # 1.5 / 0.5 = 3 > 2


def test_repetition_penalty_counts_a_token_once():
    a, b = 5, 9
    pos = torch.full((V,), -10.0)
    pos[a], pos[b] = 2.0, 1.5
    assert _pick(pos, prompt=[a, a, a], output=[a, a], repetition_penalty=1.2) == a  # 2/1.2, not 2/1.2^5


def test_frequency_penalty_scales_with_the_output_count():
    a, b = 5, 9
    row = torch.full((V,), -10.0)
    row[a], row[b] = 1.0, 0.5
    out = [a, 3, a, a]  # a generated 3 times
    assert _pick(row, output=out, frequency_penalty=0.1) == a  # 1 - 0.3 = 0.7 > 0.5
    assert _pick(row, output=out, frequency_penalty=0.2) == b  # 1 - 0.6 = 0.4 < 0.5
    # A negative frequency penalty rewards repetition.
    row2 = row.clone()
    row2[a], row2[b] = 0.5, 1.0
    assert _pick(row2, output=out, frequency_penalty=-0.2) == a  # 0.5 + 0.6 = 1.1 > 1.0


def test_presence_penalty_is_flat_per_seen_token():
    a, b = 5, 9
    row = torch.full((V,), -10.0)
    row[a], row[b] = 1.0, 0.5
    out = [a, a, a]
    assert _pick(row, output=out, presence_penalty=0.4) == a  # 1 - 0.4 = 0.6 > 0.5 (not 1 - 1.2)
    assert _pick(row, output=out, presence_penalty=0.6) == b  # 1 - 0.6 = 0.4 < 0.5


def test_presence_and_frequency_penalties_ignore_prompt_tokens():
    a, b = 5, 9
    row = torch.full((V,), -10.0)
    row[a], row[b] = 1.0, 0.5
    assert _pick(row, prompt=[a, a, a], presence_penalty=2.0, frequency_penalty=2.0) == a
    assert _pick(row, prompt=[a], output=[b], presence_penalty=1.0) == a  # b: 0.5 - 1 = -0.5


def test_penalties_combine():
    a, b, c = 5, 9, 11
    row = torch.full((V,), -10.0)
    row[a], row[b], row[c] = 3.0, 1.0, 0.9
    # a: 3 / 2 = 1.5, then - (2 * 0.3 + 0.5) = 0.4; b untouched 1.0; c is in the prompt only: 0.9 / 2.
    assert _pick(row, prompt=[c], output=[a, a], repetition_penalty=2.0, frequency_penalty=0.3,
                 presence_penalty=0.5) == b


def test_penalties_do_not_touch_the_callers_logits_or_other_rows():
    logits = rand_logits(3)
    before = logits.clone()
    top = logits.argmax(-1).tolist()
    reqs = [
        make_req("a", temperature=0.0),
        make_req("b", temperature=0.0, prompt=[top[1]], repetition_penalty=100.0),
        make_req("c", temperature=0.0),
    ]
    out = Sampler(CPU)(logits, reqs)
    assert torch.equal(logits, before)
    assert out.token_ids[0] == top[0] and out.token_ids[2] == top[2]
    assert before[1, top[1]] > 0 and out.token_ids[1] != top[1]  # divided by 100: no longer the top


# -- logprobs ----------------------------------------------------------------------------------------------
def test_logprobs_are_raw_log_softmax_with_sorted_top_k():
    logits = rand_logits(4, seed=7)
    raw_lp = torch.log_softmax(logits, -1)
    forced = 42
    reqs = [
        make_req("greedy", temperature=0.0, logprobs=5),
        # Processed logits differ from the raw ones: logprobs still report the raw distribution.
        make_req("penalised", temperature=0.7, top_k=3, repetition_penalty=1.8, presence_penalty=1.0,
                 prompt=[int(logits[1].argmax())], output=[int(logits[1].argmax())], logprobs=20),
        make_req("forced", processors=[_only(forced)], logprobs=3),
        make_req("none", temperature=0.0),
    ]
    out = Sampler(CPU)(logits.clone(), reqs)
    for i, k in ((0, 5), (1, 20), (2, 3)):
        tok = out.token_ids[i]
        chosen, top = out.logprobs[i]
        assert chosen == pytest.approx(float(raw_lp[i, tok]), abs=1e-6)
        vals, ids = raw_lp[i].topk(k)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(vals.tolist(), abs=1e-6)
        assert all(top[j][1] >= top[j + 1][1] for j in range(k - 1))
    assert out.token_ids[2] == forced
    assert out.logprobs[2][0] == pytest.approx(float(raw_lp[2, forced]), abs=1e-6)  # not log(1) = 0
    assert out.logprobs[3] is None


def test_logprobs_zero_gives_only_the_chosen_token():
    logits = rand_logits(1)
    out = Sampler(CPU)(logits, [make_req(temperature=0.0, logprobs=0)])
    chosen, top = out.logprobs[0]
    assert top == []
    assert chosen == pytest.approx(float(torch.log_softmax(logits[0], -1).max()), abs=1e-6)


# -- logits processors -----------------------------------------------------------------------------------
def _only(token: int):
    def proc(output_ids, row):
        mask = torch.full_like(row, float("-inf"))
        mask[token] = 0.0
        return row + mask

    return proc


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.0},
        {"temperature": 1.0},
        {"temperature": 1.3, "top_p": 0.5, "top_k": 5, "min_p": 0.2},
        {"temperature": 1.0, "repetition_penalty": 1.5, "frequency_penalty": 1.0, "presence_penalty": 1.0},
    ],
)
def test_logits_processor_masking_all_but_one_token_forces_it(params):
    forced = 63
    logits = rand_logits(200, seed=8)
    logits[:, forced] = -30.0  # the least likely token by far
    reqs = [make_req(f"r{i}", processors=[_only(forced)], output=[forced, 1], **params) for i in range(200)]
    out = Sampler(CPU)(logits, reqs)
    assert set(out.token_ids) == {forced}


def test_logits_processor_sees_the_output_so_far_and_only_its_own_row():
    seen = []

    def proc(output_ids, row):
        seen.append(list(output_ids))
        row[7] = 1e4
        return row

    logits = rand_logits(2, seed=9)
    before = logits.clone()
    reqs = [make_req("a", temperature=0.0, output=[4, 5], processors=[proc]), make_req("b", temperature=0.0)]
    out = Sampler(CPU)(logits, reqs)
    assert seen == [[4, 5]]
    assert out.token_ids == [7, int(before[1].argmax())]
    assert torch.equal(logits, before)  # processors edit a copy, not the model's logits


# -- logit bias ------------------------------------------------------------------------------------
def test_logit_bias_moves_the_greedy_choice_and_only_its_own_row():
    logits = rand_logits(2, seed=3)
    top, second = logits[0].topk(2).indices.tolist()
    gap = float(logits[0, top] - logits[0, second])
    before = logits.clone()
    reqs = [make_req("a", temperature=0.0, logit_bias={top: -(gap + 0.1)}), make_req("b", temperature=0.0)]
    out = Sampler(CPU)(logits, reqs)
    assert out.token_ids == [second, int(logits[1].argmax())]
    assert torch.equal(logits, before)  # the bias edits a copy
    assert _pick(logits[0], logit_bias={top: -(gap - 0.1)}) == top  # not quite enough
    assert _pick(logits[0], logit_bias={7: 100.0}) == 7  # +100 all but forces a token
    assert _pick(logits[0], logit_bias={top: -100.0}) != top  # -100 bans it


def test_logit_bias_shifts_the_sampled_distribution_not_the_reported_logprobs():
    logits = torch.full((V,), -30.0)
    logits[:4] = torch.tensor([2.0, 1.5, 1.0, 0.5])
    bias = {0: -1.0, 3: 1.2}
    biased = logits.clone()
    for t, b in bias.items():
        biased[t] += b
    samples = draw(logits, 4000, seed=5, temperature=1.0, logit_bias=bias)
    expected = torch.softmax(biased, -1)
    expected[expected < 1e-6] = 0
    assert_distribution(samples, expected / expected.sum())
    out = Sampler(CPU)(logits[None].clone(), [make_req(temperature=0.0, logit_bias={3: 100.0}, logprobs=1)])
    assert out.token_ids == [3]
    assert out.logprobs[0][0] == pytest.approx(float(torch.log_softmax(logits, -1)[3]))  # raw, before the bias


def test_logit_bias_applies_to_speculative_verification():
    logits = rand_logits(3, seed=4)  # rows for 2 drafts plus the bonus
    first = int(logits[0].argmax())
    r = make_req(temperature=0.0, logit_bias={first: -100.0})
    r.spec_token_ids = [first, 1]
    (tokens, _), = Sampler(CPU).verify(logits, [r])
    biased = logits[0].clone()
    biased[first] -= 100
    assert tokens == [int(biased.argmax())]  # the draft is rejected: the biased argmax differs


# -- SamplingParams validation -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("temperature", -0.01),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.01),
        ("top_k", 0),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("presence_penalty", 2.01),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 2.5),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("n", 0),
        ("logprobs", -1),
        ("logprobs", 21),
        ("prompt_logprobs", -1),
        ("prompt_logprobs", 21),
        ("logit_bias", {5: 100.5}),
        ("logit_bias", {5: -101.0}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {i: 1.0 for i in range(1025)}),
    ],
)
def test_out_of_range_param_is_rejected_by_name(field, value):
    with pytest.raises(InvalidParam) as exc:
        SamplingParams(**{field: value})
    assert exc.value.param == field
    assert isinstance(exc.value, ValueError)
    assert field in str(exc.value)


@pytest.mark.parametrize(
    "field", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]
)
def test_nan_param_is_rejected_by_name(field):
    # JSON bodies may carry NaN (Python's json and pydantic accept it); it must not reach the sampler.
    with pytest.raises(InvalidParam) as exc:
        SamplingParams(**{field: math.nan})
    assert exc.value.param == field


@pytest.mark.parametrize(
    "kw",
    [
        {"max_tokens": 1},
        {"temperature": 0.0},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"top_k": -1},
        {"top_k": 1},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"presence_penalty": 2.0, "frequency_penalty": -2.0},
        {"repetition_penalty": 0.01},  # the bounds (docs/reliability.md): [0.01, 100]
        {"repetition_penalty": 100.0},
        {"logprobs": 0, "prompt_logprobs": 20},
        {"logprobs": 20, "prompt_logprobs": 0},
        {"logit_bias": {0: -100.0, 1: 100.0}},
        {"logit_bias": {i: 0.5 for i in range(1024)}},
    ],
)
def test_boundary_values_are_accepted(kw):
    SamplingParams(**kw)


def test_greedy_and_penalty_flags():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=0.8, top_k=1).greedy
    assert not SamplingParams(temperature=0.8).greedy
    assert not SamplingParams().needs_penalties
    for kw in ({"presence_penalty": 0.1}, {"frequency_penalty": -0.1}, {"repetition_penalty": 1.1}):
        assert SamplingParams(**kw).needs_penalties
