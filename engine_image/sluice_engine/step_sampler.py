"""Rank 0's end of a step: the logits of the step's rows -> each request's new tokens (sampled, or
drafts verified), their logprobs, and prompt logprobs. The sampling state (parameters, generators,
grammars, penalties' history) lives with the requests, which only rank 0 has."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import Request
from .sampler import Sampler, TokenLogprobs, top_logprobs
from .sched_output import SchedulerOutput


@dataclass(slots=True)
class StepResult:
    """What one forward produced for one scheduled request."""

    request: Request
    num_scheduled: int
    # New tokens: [] for a prompt chunk that did not reach the end of the prompt, one token normally,
    # accepted drafts + one more with speculative decoding.
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: list[TokenLogprobs] | None
    # Draft tokens computed this step but rejected: their KV slots hold garbage until overwritten.
    num_rejected: int = 0


@torch.inference_mode()
def sample_step(sampler: Sampler, logits: torch.Tensor, sched: SchedulerOutput,
                requests: list[Request]) -> list[StepResult]:
    """`requests[i]` is the request of `sched.scheduled[i]`; `logits` has the rows of
    `sched.logits_layout()`."""
    _, firsts = sched.logits_layout()
    items = list(zip(sched.scheduled, requests, firsts, strict=True))
    # A plain sample reads the request's last row (with prompt logprobs its rows are all the chunk's).
    plain = [(req, first + s.logits_rows() - 1) for s, req, first in items if s.samples and not s.num_drafts]
    sampled = sampler(logits[[row for _, row in plain]], [r for r, _ in plain]) if plain else None
    spec = [(req, first, s.num_drafts + 1) for s, req, first in items if s.num_drafts]
    verified = None
    if spec:
        rows = [i for _, first, count in spec for i in range(first, first + count)]
        verified = sampler.verify(logits[rows], [r for r, _, _ in spec])

    results: list[StepResult] = []
    k = v = 0
    for s, req, first in items:
        tokens: list[int] = []
        lps: list[TokenLogprobs | None] = []
        rejected = 0
        if s.num_drafts:
            assert verified is not None
            tokens, lps = verified[v]
            rejected = s.num_drafts + 1 - len(tokens)
            v += 1
        elif s.samples:
            assert sampled is not None
            tokens, lps = [sampled.token_ids[k]], [sampled.logprobs[k]]
            k += 1
        plp = None
        if s.prompt_logprobs and not s.num_drafts:
            plp = _prompt_logprobs(req, logits[first : first + s.num_tokens], s.start)
        results.append(StepResult(req, s.num_tokens, tokens, lps, plp, rejected))
    return results


def _prompt_logprobs(req: Request, rows: torch.Tensor, start: int) -> list[TokenLogprobs]:
    """Logprobs of the prompt tokens that rows predict (row j predicts token start + j + 1)."""
    lps = torch.log_softmax(rows, dim=-1)
    out = []
    for j in range(rows.shape[0]):
        target_pos = start + j + 1
        if target_pos >= req.num_prompt_tokens:
            break
        if target_pos <= len(req.prompt_logprobs):
            continue  # recomputed after a preemption: already recorded
        out.append(top_logprobs(lps[j], req.all_token_ids[target_pos], req.params.prompt_logprobs or 0))
    return out
