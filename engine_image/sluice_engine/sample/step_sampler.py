"""Rank 0's end of a step: the logits of the step's rows -> each request's new tokens (sampled, or
drafts verified), their logprobs, and prompt logprobs. The sampling state (parameters, generators,
grammars, penalties' history) lives with the requests, which only rank 0 has.

Plain samples and draft verification are one batched pass (a plain sample is a request with no
drafts), and everything the host needs from the step, prompt logprobs included, comes back in one
device-to-host transfer (device_io.fetch). `launch_step_sample` queues the step's sampling on the device and
starts that transfer; `LaunchedSample.results()` waits for it: async scheduling launches in the thread that
runs the step and reads in the engine's, with the next step queued in between. The sampled tokens stay on the
device for that next step's placeholders (`SampledTokens`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.request import Request
from ..core.sched_output import SchedulerOutput
from ..device_io import PendingFetch, start_fetch, upload
from .logprobs import TokenLogprobs, gather_logprobs
from .sampler import Sampler


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
    # The step reached the end of the request's tokens: it sampled (or verified) its next token.
    sampled: bool = True


@dataclass(slots=True)
class SampledTokens:
    """A step's sampled tokens still on the device, and the row of each request that sampled exactly one (no
    drafts): where the next step's PLACEHOLDER inputs come from (async scheduling, worker/model_runner.py)."""

    tokens: torch.Tensor  # [rows], int64
    row_of: dict[str, int]


@dataclass(slots=True)
class LaunchedSample:
    """A step's sampling queued on the device, its one transfer to the host under way."""

    items: list  # (ScheduledRequest, Request, first logits row)
    plp_counts: list[int]
    transfer: PendingFetch
    has_sampling: bool
    has_prompt_logprobs: bool
    sampled_tokens: SampledTokens | None

    def results(self) -> list[StepResult]:
        fetched = iter(self.transfer.result())
        sampled = iter(next(fetched) if self.has_sampling else [])
        prompt_lps = next(fetched) if self.has_prompt_logprobs else []
        results: list[StepResult] = []
        at = 0
        for (s, req, _), count in zip(self.items, self.plp_counts, strict=True):
            tokens: list[int] = []
            lps: list[TokenLogprobs | None] = []
            if s.samples or s.num_drafts:
                tokens, lps = next(sampled)
            plp = None
            if s.prompt_logprobs and not s.num_drafts:
                plp, at = prompt_lps[at : at + count], at + count
            rejected = s.num_drafts + 1 - len(tokens) if s.num_drafts else 0
            results.append(StepResult(req, s.num_tokens, tokens, lps, plp, rejected, s.samples))
        return results


def sample_step(sampler: Sampler, logits: torch.Tensor, sched: SchedulerOutput,
                requests: list[Request]) -> list[StepResult]:
    """`requests[i]` is the request of `sched.scheduled[i]`; `logits` has the rows of
    `sched.logits_layout()`."""
    return launch_step_sample(sampler, logits, sched, requests).results()


@torch.inference_mode()
def launch_step_sample(sampler: Sampler, logits: torch.Tensor, sched: SchedulerOutput,
                       requests: list[Request]) -> LaunchedSample:
    """Queue the step's sampling (and prompt logprobs) on the device and start their transfer to the host."""
    _, firsts = sched.logits_layout()
    items = list(zip(sched.scheduled, requests, firsts, strict=True))
    # A request samples from its last num_drafts + 1 rows (with prompt logprobs its rows are all the
    # chunk's); the drafts are the last tokens it computed this step.
    sampling = [(s, req, first + s.logits_rows() - s.num_drafts - 1) for s, req, first in items
                if s.samples or s.num_drafts]
    rows = [row + j for s, _, row in sampling for j in range(s.num_drafts + 1)]
    plp_rows, plp_targets, plp_ks, plp_counts = _prompt_logprob_rows(items)
    all_rows = rows == list(range(logits.shape[0]))  # the common decode step: every row samples
    needed: dict[str, list[int]] = {}
    if not all_rows:
        needed["rows"] = rows
    if plp_rows:
        needed.update(plp_rows=plp_rows, plp_targets=plp_targets)
    idx = upload(logits.device, needed)
    parts = []
    if sampling:
        picked = logits if all_rows else logits.index_select(0, idx["rows"])
        drafts = [s.token_ids[s.num_tokens - s.num_drafts:] for s, _, _ in sampling]
        parts.append(sampler.sample(picked, [req for _, req, _ in sampling], drafts))
    if plp_rows:
        parts.append(gather_logprobs(logits.index_select(0, idx["plp_rows"]), idx["plp_targets"], plp_ks))
    pending = parts[0] if sampling else None
    sampled_tokens = None
    if pending is not None:
        row_of = {s.request_id: first for (s, _, _), first in zip(sampling, pending.batch.firsts, strict=True)
                  if not s.num_drafts}
        sampled_tokens = SampledTokens(pending.tokens, row_of)
    return LaunchedSample(items, plp_counts, start_fetch(parts), bool(sampling), bool(plp_rows), sampled_tokens)


def _prompt_logprob_rows(items) -> tuple[list[int], list[int], list[int], list[int]]:
    """The rows whose prompt logprobs are reported: (rows, the prompt token each predicts, top-k per
    row, how many rows per request). Row first + j predicts prompt token start + j + 1."""
    rows: list[int] = []
    targets: list[int] = []
    ks: list[int] = []
    counts: list[int] = []
    for s, req, first in items:
        n = 0
        if s.prompt_logprobs and not s.num_drafts:
            # Positions recorded before a preemption are recomputed but not reported again.
            lo = max(s.start + 1, len(req.prompt_logprobs) + 1)
            hi = min(s.start + s.num_tokens + 1, req.num_prompt_tokens)
            for pos in range(lo, hi):
                rows.append(first + pos - s.start - 1)
                targets.append(req.all_token_ids[pos])
                ks.append(req.params.prompt_logprobs or 0)
                n += 1
        counts.append(n)
    return rows, targets, ks, counts
