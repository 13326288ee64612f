"""The batched sampler: one host read per step however mixed the batch, batched work (no per-request
ops, one sort at most), and the outputs of the per-row sampler it replaced (reference_sampler.py):

- plain sampling draws the same random stream as before, so for the same seeds every token, logprob
  and prompt logprob is identical to the reference's;
- draft verification draws its randomness differently (exponential race instead of multinomial), so
  there greedy verification is identical, seeded verification reproduces across runs and batch
  compositions, and the verified output has the target's distribution (chi-square).
Host reads are counted as tests/support/host_syncs.py explains; on CUDA the same counts hold (and blocking
uploads are counted too)."""

from __future__ import annotations

import functools

import pytest
import reference_sampler as ref
import torch
from host_syncs import count_host_syncs
from torch.utils._python_dispatch import TorchDispatchMode

from sluice_engine.core.request import Request
from sluice_engine.core.sched_output import ScheduledRequest, SchedulerOutput
from sluice_engine.sample.sampler import Sampler
from sluice_engine.sample.step_sampler import sample_step
from sluice_engine.sampling_params import SamplingParams

V = 128
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


pytestmark = pytest.mark.usefixtures("one_thread")


class BanToken:
    """A TokenConstraint (request.py) that masks with device ops only, as a grammar's batched mask does."""

    def __init__(self, token: int):
        self.token = token

    def accept(self, token_id: int) -> None:
        pass

    def valid_prefix(self, token_ids: list[int]) -> int:
        return len(token_ids)

    @classmethod
    def apply_batch(cls, logits, rows) -> None:
        for first, c, drafts in rows:
            logits[first : first + len(drafts) + 1, c.token] = float("-inf")


def _req(rid: str, prompt=(1, 2, 3), output=(), seed=None, device="cpu", constraint=None, **params) -> Request:
    r = Request(rid, list(prompt), SamplingParams(**params), logits_processors=[constraint] if constraint else [])
    for t in output:
        r.append_output_token(t)
    if seed is not None:  # as LLMEngine.add_request does
        r.generator = torch.Generator(device=device).manual_seed(seed)
    return r


def _decode(req: Request, drafts=()) -> ScheduledRequest:
    """A decode step of req: its last token, then drafts."""
    req.spec_token_ids = list(drafts)
    return ScheduledRequest(req.request_id, [req.all_token_ids[-1], *drafts], req.num_tokens - 1, [0], len(drafts))


def _mixed_requests(device: str, with_drafts: bool) -> list[tuple[Request, list[int]]]:
    """(request, drafts) for every kind of row the sampler knows."""
    mk = functools.partial(_req, device=device)
    out = [
        (mk("greedy", temperature=0.0), []),
        (mk("temp", temperature=0.7), []),
        (mk("seeded", temperature=1.1, seed=5), []),
        (mk("topk", temperature=0.9, top_k=9), []),
        (mk("topp", top_p=0.8, seed=6), []),
        (mk("minp", min_p=0.2), []),
        (mk("all-truncations", temperature=1.3, top_k=20, top_p=0.9, min_p=0.05, logprobs=3), []),
        (mk("penalties", output=[7, 7, 9], prompt=[7, 11], repetition_penalty=1.3, presence_penalty=0.4,
            frequency_penalty=0.2, logprobs=0), []),
        (mk("bias", logit_bias={3: 5.0, 4: -100.0}, logprobs=5), []),
        (mk("constrained", constraint=BanToken(10), temperature=0.5), []),
    ]
    if with_drafts:
        out += [
            (mk("spec-greedy", temperature=0.0, logprobs=2), [12, 13, 14]),
            (mk("spec-sampled", temperature=0.9, top_p=0.95, seed=8, constraint=BanToken(1), logprobs=1), [5, 6]),
            (mk("spec-unseeded", temperature=1.0, logit_bias={5: 2.0}), [5]),
        ]
    return out


def _mixed_step(device: str, with_drafts: bool, prompt_logprobs: bool = True):
    """A SchedulerOutput with all of the above, a prompt chunk that does not sample, and a last prompt
    chunk with prompt logprobs; and random logits of its layout."""
    pairs = _mixed_requests(device, with_drafts)
    requests = [r for r, _ in pairs]
    sched = SchedulerOutput([_decode(r, d) for r, d in pairs])
    prompt = list(range(20, 32))
    chunked = _req("chunk", prompt=prompt, device=device, prompt_logprobs=2 if prompt_logprobs else None)
    last = _req("last-chunk", prompt=prompt, device=device, temperature=0.8,
                prompt_logprobs=0 if prompt_logprobs else None)
    last.prompt_logprobs = [(0.0, [])] * 3  # positions 1..3 reported before a preemption: not again
    sched.scheduled += [
        ScheduledRequest("chunk", prompt[:5], 0, [0], samples=False, prompt_logprobs=prompt_logprobs),
        ScheduledRequest("last-chunk", prompt[2:], 2, [0], prompt_logprobs=prompt_logprobs),
    ]
    requests += [chunked, last]
    rows, _ = sched.logits_layout()
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(len(rows))) * 3
    return sched, requests, logits.to(device)


def _advance(results) -> None:
    """What the engine does between steps: emitted tokens join the output."""
    for res in results:
        for t in res.token_ids:
            res.request.append_output_token(t)


# -- one host read per step ------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_a_mixed_step_reads_the_device_once(device):
    sampler = Sampler(torch.device(device), seed=0)
    sched, requests, logits = _mixed_step(device, with_drafts=True)
    for _ in range(3):
        with count_host_syncs() as log:
            results = sample_step(sampler, logits, sched, requests)
        assert len(log.syncs) == 1, log.syncs
        assert log.blocking_uploads == [], log.blocking_uploads
        assert all(len(r.token_ids) == 1 for r in results[:10])
        assert all(1 <= len(r.token_ids) <= len(r.request.spec_token_ids) + 1 for r in results[10:13])
        assert results[-2].token_ids == [] and len(results[-2].prompt_logprobs) == 5
        _advance(results)


@pytest.mark.parametrize("device", DEVICES)
def test_sampler_call_and_verify_read_once(device):
    pairs = _mixed_requests(device, with_drafts=True)
    plain = [r for r, d in pairs if not d]
    spec = [r for r, d in pairs if d]
    for r, d in pairs:
        r.spec_token_ids = d
    sampler = Sampler(torch.device(device))
    logits = torch.randn(len(plain), V).to(device)
    with count_host_syncs() as log:
        sampler(logits, plain)
    assert len(log.syncs) == 1, log.syncs
    rows = sum(len(r.spec_token_ids) + 1 for r in spec)
    with count_host_syncs() as log:
        sampler.verify(torch.randn(rows, V).to(device), spec)
    assert len(log.syncs) == 1, log.syncs


def test_the_counter_sees_the_reads_the_old_sampler_made():
    """The count is not vacuous: the per-row sampler's step, on the same batch, reads back many times."""
    sched, requests, logits = _mixed_step("cpu", with_drafts=True)
    with count_host_syncs() as log:
        ref.sample_step(ref.Sampler(torch.device("cpu")), logits, sched, requests)
    assert len(log.syncs) > 20, log.syncs


# -- batched work --------------------------------------------------------------------------------
class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((func._overloadpacket.__name__, args[0].shape if args and isinstance(args[0], torch.Tensor)
                         else None))
        return func(*args, **(kwargs or {}))


def _ops(requests: list[Request], logits: torch.Tensor) -> list:
    with _OpCounter() as counter:
        Sampler(torch.device("cpu"))(logits, requests)
    return counter.ops


def test_the_ops_do_not_grow_with_the_batch():
    """Penalties, bias, truncation and logprobs for 2 requests or 40: the same ops (on bigger tensors),
    so nothing loops over requests (seeded requests draw from their own generators, one op each)."""
    def batch(n):
        kinds = [dict(temperature=0.8, top_k=5, presence_penalty=0.5, logprobs=2),
                 dict(top_p=0.7, repetition_penalty=1.2, frequency_penalty=0.3, logit_bias={2: 1.0}),
                 dict(temperature=0.0, min_p=0.1, logit_bias={3: -1.0}, logprobs=4)]
        return [_req(f"r{i}", output=[i % 7, 3, 3], **kinds[i % 3]) for i in range(n)]

    small, large = _ops(batch(3), torch.randn(3, V)), _ops(batch(42), torch.randn(42, V))
    assert [name for name, _ in small] == [name for name, _ in large]


@pytest.mark.parametrize(
    ("params", "sorts", "topks"),
    [
        ([dict(temperature=0.0), dict(temperature=0.8), dict(min_p=0.3)], 0, 0),  # nothing truncates
        ([dict(top_k=5), dict(top_k=40, temperature=0.5), dict(temperature=0.0, top_p=0.5)], 0, 1),  # top-k only
        ([dict(top_k=5, top_p=0.9), dict(top_k=40, top_p=0.5), dict()], 0, 1),  # every nucleus in its top-k
        ([dict(top_p=0.9), dict(top_k=7), dict(temperature=0.0, top_p=0.5), dict()], 1, 0),  # a full sort
    ],
)
def test_at_most_one_sort_and_only_of_the_rows_that_truncate(params, sorts, topks):
    requests = [_req(f"r{i}", **p) for i, p in enumerate(params)]
    ops = _ops(requests, torch.randn(len(requests), V))
    sorted_shapes = [shape for name, shape in ops if name == "sort"]
    assert len(sorted_shapes) == sorts
    assert len([name for name, _ in ops if name == "topk"]) == topks
    truncating = sum(1 for r in requests if not r.params.greedy and (r.params.top_k > 0 or r.params.top_p < 1))
    assert all(shape[0] == truncating for shape in sorted_shapes)  # greedy and plain rows are not sorted


# -- the same outputs as the per-row sampler --------------------------------------------------------
@pytest.mark.parametrize("engine_seed", [0, 17])
def test_plain_steps_match_the_reference_exactly(engine_seed):
    """Same seeds, same tokens, logprobs and prompt logprobs as the per-row sampler, step after step
    (both consume their generators alike, so the streams stay in step)."""
    new_state = _mixed_step("cpu", with_drafts=False)
    old_state = _mixed_step("cpu", with_drafts=False)
    new, old = Sampler(torch.device("cpu"), engine_seed), ref.Sampler(torch.device("cpu"), engine_seed)
    spread = set()
    for step in range(6):
        (sched, new_reqs, logits), (_, old_reqs, _) = new_state, old_state
        logits = torch.randn(logits.shape, generator=torch.Generator().manual_seed(100 + step)) * 2
        got = sample_step(new, logits, sched, new_reqs)
        want = ref.sample_step(old, logits, sched, old_reqs)
        for g, (tokens, lps, plp, rejected) in zip(got, want, strict=True):
            assert (g.token_ids, g.logprobs, g.prompt_logprobs, g.num_rejected) == (tokens, lps, plp, rejected), \
                g.request.request_id
            spread.update(tokens)
        _advance(got)
        for g, r in zip(got, old_reqs, strict=True):
            for t in g.token_ids:
                r.append_output_token(t)
    assert len(spread) > 20, "test setup: the rows should sample many different tokens"


def test_greedy_verification_matches_the_reference():
    gen = torch.Generator().manual_seed(3)
    counts = (2, 0, 3, 1)
    for trial in range(40):
        logits = torch.randn(sum(counts) + len(counts), V, generator=gen) * 2
        argmax = logits.argmax(-1).tolist()
        reqs, first = [], 0
        for i, n in enumerate(counts):
            r = _req(f"r{i}", temperature=0.0, logit_bias={7: 0.5} if i == 2 else None, logprobs=1)
            # Drafts right up to a point, then wrong: every acceptance length shows up.
            r.spec_token_ids = [argmax[first + j] if j < trial % (n + 1) else (argmax[first + j] + 1) % V
                                for j in range(n)]
            reqs.append(r)
            first += n + 1
        assert Sampler(torch.device("cpu")).verify(logits, reqs) == ref.Sampler(torch.device("cpu")).verify(logits, reqs)


def _seeded_verification(others: str, seed: int = 42) -> list[list[int]]:
    """The tokens a seeded request emits over a few verification steps, with other rows around it."""
    sampler = Sampler(torch.device("cpu"), seed=len(others))
    target = _req("t", seed=seed, temperature=1.0, top_k=30)
    emitted = []
    for step in range(8):
        mine = torch.randn(3, V, generator=torch.Generator().manual_seed(step))
        reqs = [target]
        rows = [mine]
        target.spec_token_ids = mine[:2].argmax(-1).tolist()  # likely guesses: some accepted
        if others == "around":
            a, b = _req("a", temperature=0.8), _req("b", seed=3, temperature=0.0)
            a.spec_token_ids, b.spec_token_ids = [1, 2, 3], []
            reqs, rows = [a, target, b], [torch.randn(4, V), mine, torch.randn(1, V)]
        (tokens, _), = [out for r, out in zip(reqs, sampler.verify(torch.cat(rows), reqs), strict=True) if r is target]
        emitted.append(tokens)
        for t in tokens:
            target.append_output_token(t)
    return emitted


def test_seeded_verification_reproduces_across_runs_and_batches():
    alone = _seeded_verification("alone")
    assert any(len(t) > 1 for t in alone) and any(len(t) < 3 for t in alone), "test setup: mixed acceptance"
    assert _seeded_verification("alone") == alone
    assert _seeded_verification("around") == alone
    assert _seeded_verification("alone", seed=43) != alone


def test_verified_tokens_of_seeded_requests_have_the_target_distribution():
    """Many requests with their own seeds verify the same drafts: the first emitted token follows the
    target's row 0 and, after an accepted first draft, the second follows row 1 (chi-square)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, generator=gen) * 1.5
    p = logits.softmax(-1).double()
    drafts = [int(p[0].argmax()), int(p[1].argsort()[-2])]  # a likely and a less likely guess
    n = 4000
    reqs = [_req(f"r{i}", seed=i) for i in range(n)]
    for r in reqs:
        r.spec_token_ids = list(drafts)
    out = Sampler(torch.device("cpu")).verify(logits.repeat(n, 1), reqs)
    first = torch.bincount(torch.tensor([t[0] for t, _ in out]), minlength=6).double()
    second = torch.bincount(torch.tensor([t[1] for t, _ in out if t[0] == drafts[0]]), minlength=6).double()
    for counts, probs in ((first, p[0]), (second, p[1])):
        stat = ((counts - probs * counts.sum()) ** 2 / (probs * counts.sum())).sum()
        pvalue = float(torch.special.gammaincc(torch.tensor(2.5, dtype=torch.float64), stat / 2))  # 5 dof
        assert pvalue > 1e-3, (counts.tolist(), probs.tolist())
        assert 0.5 * float((counts / counts.sum() - probs).abs().sum()) < 0.03  # total variation


# -- edges -----------------------------------------------------------------------------------------
def test_a_draft_outside_the_vocabulary_is_rejected_not_an_error():
    logits = torch.randn(2, V)
    for params in (dict(temperature=0.0), dict(temperature=1.0)):
        r = _req("r", **params)
        r.spec_token_ids = [V + 5]  # a draft model with a larger vocabulary, say
        ((tokens, _),) = Sampler(torch.device("cpu")).verify(logits, [r])
        assert len(tokens) == 1 and 0 <= tokens[0] < V


def test_draft_rows_see_the_drafts_before_them_as_generated():
    """Penalties on a verified row count the drafts before it (the engine does not speculate for
    penalised requests yet; the sampler is ready when it does)."""
    a, b = 5, 9
    logits = torch.full((3, V), -10.0)
    logits[:, a], logits[:, b] = 2.0, 1.5  # a is the argmax of every row
    r = _req("r", temperature=0.0, presence_penalty=1.0)
    r.spec_token_ids = [a, a]
    ((tokens, _),) = Sampler(torch.device("cpu")).verify(logits, [r])
    # Row 0 has no a before it: accepts a. Row 1 comes after one a: 2 - 1 < 1.5, so b replaces the draft.
    assert tokens == [a, b]


def test_logit_bias_outside_the_vocabulary_fails_the_call_on_the_host():
    with pytest.raises(ValueError, match="logit_bias token"):
        Sampler(torch.device("cpu"))(torch.randn(1, V), [_req("r", logit_bias={V: 1.0})])
