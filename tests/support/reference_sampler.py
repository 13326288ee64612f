"""The sampler as it was before it was batched (per-row Python loops, host reads; commit d510f8c),
kept as the oracle the batched sampler is checked against: same tokens for the same seeds wherever the
random stream is the same (plain sampling), same greedy choices, same logprobs and prompt logprobs.
Test code only: nothing in the engine imports it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice_engine.core.request import Request, TokenConstraint
from sluice_engine.sample.cpu_draw import inverse_cdf_torch

# (logprob of the chosen token, [(token_id, logprob) for the top-k])
TokenLogprobs = tuple[float, list[tuple[int, float]]]


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def top_logprobs(logprobs_row: torch.Tensor, token_id: int, k: int) -> TokenLogprobs:
    chosen = float(logprobs_row[token_id])
    if k <= 0:
        return chosen, []
    vals, ids = logprobs_row.topk(k)
    return chosen, list(zip(ids.tolist(), vals.tolist(), strict=True))


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits: [B, V] float32, row i for requests[i]."""
        raw = logits
        want_logprobs = any(r.params.logprobs is not None for r in requests)
        logprobs = torch.log_softmax(raw, dim=-1) if want_logprobs else None

        logits = raw.clone() if any(r.logits_processors or r.constraints or r.params.needs_penalties
                                    or r.params.logit_bias for r in requests) else raw
        apply_constraints(logits, [(i, c, []) for i, r in enumerate(requests) for c in r.constraints])
        for i, r in enumerate(requests):
            for proc in r.logits_processors:
                logits[i] = proc(r.output_token_ids, logits[i])
            if r.params.logit_bias:
                _apply_logit_bias(logits[i], r.params.logit_bias)
            if r.params.needs_penalties:
                _apply_penalties(logits[i], r)

        greedy = [r.params.greedy for r in requests]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, requests, greedy)
        token_ids = tokens.tolist()

        out_lp: list[TokenLogprobs | None] = [None] * len(requests)
        if logprobs is not None:
            for i, r in enumerate(requests):
                if r.params.logprobs is not None:
                    out_lp[i] = top_logprobs(logprobs[i], token_ids[i], r.params.logprobs)
        return SamplerOutput(token_ids, out_lp)

    def _sample(self, logits: torch.Tensor, requests: list[Request], greedy: list[bool]) -> torch.Tensor:
        dev = logits.device
        probs = self._probs(logits, requests, greedy)
        if dev.type == "cpu":
            # On CPU the engine draws by the inverse CDF, one float64 uniform per row (sample/cpu_draw.py); its
            # torch definition is the oracle here. Unseeded rows share the sampler's generator in row order.
            u = torch.empty(len(requests), dtype=torch.float64)
            unseeded = [i for i, r in enumerate(requests) if r.generator is None]
            if unseeded:
                u[unseeded] = torch.rand(len(unseeded), 1, dtype=torch.float64, generator=self.generator)[:, 0]
            for i, r in enumerate(requests):
                if r.generator is not None:
                    u[i] = torch.rand(1, 1, dtype=torch.float64, generator=r.generator)[0, 0]
            sampled = inverse_cdf_torch(probs, u)
            if any(greedy):
                sampled = torch.where(torch.tensor(greedy, device=dev), logits.argmax(dim=-1), sampled)
            return sampled
        # Exponential race (argmax p/q with q ~ Exp(1)) samples from p without a host sync; a seeded
        # request draws its noise from its own generator so its tokens do not depend on the batch.
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(requests) if r.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=dev).exponential_(
                generator=self.generator
            )
        for i, r in enumerate(requests):
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        sampled = (probs / noise).argmax(dim=-1)
        if any(greedy):
            sampled = torch.where(torch.tensor(greedy, device=dev), logits.argmax(dim=-1), sampled)
        return sampled

    def verify(self, logits: torch.Tensor, requests: list[Request]) -> list[tuple[list[int], list[TokenLogprobs | None]]]:
        """Speculative decoding: accept or reject each request's drafts against the target model.

        logits holds, per request in order, len(spec_token_ids) + 1 rows: row i is the target's
        distribution for the token after draft i-1. Greedy: a draft is accepted iff it is the argmax.
        Sampling: the drafts are deterministic guesses (q = one-hot), so draft d is accepted with
        probability p(d) and, on rejection, the token is drawn from p with d removed (renormalised);
        after all k are accepted a bonus token is drawn from the last row. That is the standard
        rejection-sampling scheme with q one-hot; the output has exactly the target's distribution.
        Returns (emitted tokens, their logprobs) per request: accepted drafts plus one more token.
        """
        row_reqs = [r for r in requests for _ in range(len(r.spec_token_ids) + 1)]
        assert len(row_reqs) == logits.shape[0]
        want_logprobs = any(r.params.logprobs is not None for r in requests)
        logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        constrained = []
        row = 0
        for r in requests:
            constrained.extend((row, c, r.spec_token_ids) for c in r.constraints)
            row += len(r.spec_token_ids) + 1
        biased = [(i, r.params.logit_bias) for i, r in enumerate(row_reqs) if r.params.logit_bias]
        if constrained or biased:
            logits = logits.clone()
            # Each row masked by the constraint's state after the drafts before it; a bias is the
            # same at every position.
            apply_constraints(logits, constrained)
            for i, bias in biased:
                _apply_logit_bias(logits[i], bias)
        greedy = [r.params.greedy for r in row_reqs]
        argmax = logits.argmax(dim=-1).tolist()
        probs = None if all(greedy) else self._probs(logits, row_reqs, greedy)
        results = []
        row = 0
        for r in requests:
            drafts = r.spec_token_ids
            emitted: list[int] = []
            for i in range(len(drafts) + 1):
                is_bonus = i == len(drafts)
                if r.params.greedy:
                    token = argmax[row + i]
                    emitted.append(token)
                    if is_bonus or token != drafts[i]:
                        break
                    continue
                p = probs[row + i]
                if is_bonus:
                    emitted.append(int(torch.multinomial(p, 1, generator=r.generator or self.generator)))
                    break
                d = drafts[i]
                u = torch.rand((), device=p.device, generator=r.generator or self.generator)
                if float(u) < float(p[d]):
                    emitted.append(d)
                    continue
                residual = p.clone()
                residual[d] = 0.0
                emitted.append(int(torch.multinomial(residual, 1, generator=r.generator or self.generator)))
                break
            lps: list[TokenLogprobs | None] = [None] * len(emitted)
            if logprobs is not None and r.params.logprobs is not None:
                lps = [top_logprobs(logprobs[row + j], t, r.params.logprobs) for j, t in enumerate(emitted)]
            results.append((emitted, lps))
            row += len(drafts) + 1
        return results

    def _probs(self, logits: torch.Tensor, requests: list[Request], greedy: list[bool]) -> torch.Tensor:
        """The distribution each row samples from: temperature, top-k, top-p, min-p applied."""
        dev = logits.device
        temps = torch.tensor([1.0 if g else r.params.temperature for r, g in zip(requests, greedy, strict=True)],
                             device=dev)
        logits = logits / temps[:, None]
        top_k = [r.params.top_k for r in requests]
        if any(k > 0 for k in top_k):
            vocab = logits.shape[-1]
            ks = torch.tensor([k if k > 0 else vocab for k in top_k], device=dev).clamp(max=vocab)
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (ks - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        top_p = torch.tensor([r.params.top_p for r in requests], device=dev)
        if bool((top_p < 1).any()):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            # Drop a token when the mass before it already reaches top_p (the top token always stays).
            drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p[:, None]
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        probs = logits.softmax(dim=-1)
        min_p = torch.tensor([r.params.min_p for r in requests], device=dev)
        if bool((min_p > 0).any()):
            threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs


def apply_constraints(logits: torch.Tensor, rows: list[tuple[int, TokenConstraint, list[int]]]) -> None:
    """Masks logits in place: one apply_batch call per constraint class, so a class can fill all its
    rows' masks and apply them to the batch in one operation."""
    by_class: dict[type, list[tuple[int, TokenConstraint, list[int]]]] = {}
    for item in rows:
        by_class.setdefault(type(item[1]), []).append(item)
    for cls, items in by_class.items():
        cls.apply_batch(logits, items)


def _apply_logit_bias(row: torch.Tensor, bias: dict[int, float]) -> None:
    ids = torch.tensor(list(bias), device=row.device, dtype=torch.long)
    row[ids] += torch.tensor(list(bias.values()), device=row.device, dtype=row.dtype)


def _apply_penalties(row: torch.Tensor, r: Request) -> None:
    p = r.params
    dev = row.device
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(r.all_token_ids)), device=dev, dtype=torch.long)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
        ids, counts = torch.tensor(r.output_token_ids, device=dev, dtype=torch.long).unique(return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty


# -- the step around it (step_sampler.sample_step before batching) --------------------------------
def sample_step(sampler: Sampler, logits: torch.Tensor, sched, requests: list[Request]) -> list:
    """(token ids, logprobs, prompt logprobs, rejected drafts) per scheduled request."""
    _, firsts = sched.logits_layout()
    items = list(zip(sched.scheduled, requests, firsts, strict=True))
    plain = [(req, first + s.logits_rows() - 1) for s, req, first in items if s.samples and not s.num_drafts]
    sampled = sampler(logits[[row for _, row in plain]], [r for r, _ in plain]) if plain else None
    spec = [(req, first, s.num_drafts + 1) for s, req, first in items if s.num_drafts]
    verified = None
    if spec:
        rows = [i for _, first, count in spec for i in range(first, first + count)]
        verified = sampler.verify(logits[rows], [r for r, _, _ in spec])
    results = []
    k = v = 0
    for s, req, first in items:
        tokens, lps, rejected = [], [], 0
        if s.num_drafts:
            tokens, lps = verified[v]
            rejected = s.num_drafts + 1 - len(tokens)
            v += 1
        elif s.samples:
            tokens, lps = [sampled.token_ids[k]], [sampled.logprobs[k]]
            k += 1
        plp = None
        if s.prompt_logprobs and not s.num_drafts:
            plp = _prompt_logprobs(req, logits[first : first + s.num_tokens], s.start)
        results.append((tokens, lps, plp, rejected))
    return results


def _prompt_logprobs(req: Request, rows: torch.Tensor, start: int) -> list[TokenLogprobs]:
    lps = torch.log_softmax(rows, dim=-1)
    out = []
    for j in range(rows.shape[0]):
        target_pos = start + j + 1
        if target_pos >= req.num_prompt_tokens:
            break
        if target_pos <= len(req.prompt_logprobs):
            continue
        out.append(top_logprobs(lps[j], req.all_token_ids[target_pos], req.params.prompt_logprobs or 0))
    return out
