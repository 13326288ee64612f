"""One step's sampling rows, laid out for batched tensor ops.

Every request being sampled owns `len(drafts) + 1` consecutive rows: one per draft token (verified
against the target's row before it) and one more for the token after the last draft (the bonus). A
plain sample is the case without drafts. What each row needs is read here, once, from the requests'
Python parameters: the per-row values go to the device as tensors (one upload, device_io.py), and the
decisions about which work a step needs at all (any sampled row? any top-p? which rows sort?) are
made from the same Python values, so none of them reads a tensor back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.request import Request
from ..device_io import upload


@dataclass(slots=True)
class SamplingBatch:
    requests: list[Request]
    drafts: list[list[int]]  # per request, the draft tokens its rows verify ([] for a plain sample)
    firsts: list[int]  # per request, its first row
    num_rows: int
    vocab: int
    all_greedy: bool
    any_greedy: bool
    any_drafts: bool
    # Rows that truncate the distribution by top-k or top-p (sampled rows only): the only rows sorted.
    sort_rows: list[int]
    any_top_p: bool
    max_top_k: int  # the largest top-k among sort_rows that use one; 0 if none does
    all_sorted_rows_top_k: bool  # every row in sort_rows has a top-k (so none needs a full sort)
    any_min_p: bool
    any_penalties: bool
    any_bias: bool
    # Rows drawing their noise from the sampler's shared generator (requests without a seed).
    unseeded_rows: list[int]
    # Rows whose logprobs are reported, and how many top entries each reports.
    logprob_rows: list[int]
    logprob_ks: list[int]
    # Device tensors by name (see build); per-row ones are [num_rows] unless noted.
    t: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def needs_clone(self) -> bool:
        """Whether anything edits the logits before sampling (then a copy is edited, not the model's)."""
        return self.any_penalties or self.any_bias or any(r.constraints or r.logits_processors
                                                          for r in self.requests)

    def rows_of(self, i: int) -> range:
        return range(self.firsts[i], self.firsts[i] + len(self.drafts[i]) + 1)

    def row_histories(self, i: int) -> list[list[int]]:
        """Request i's output tokens as each of its rows sees them: row j comes after drafts[:j]."""
        out = self.requests[i].output_token_ids
        d = self.drafts[i]
        return [out, *(out + d[:j] for j in range(1, len(d) + 1))]

    @classmethod
    def build(cls, requests: list[Request], drafts: list[list[int]] | None, vocab: int,
              device: torch.device) -> SamplingBatch:
        drafts = drafts if drafts is not None else [[] for _ in requests]
        firsts, row_req = [], []
        for i, d in enumerate(drafts):
            firsts.append(len(row_req))
            row_req.extend([i] * (len(d) + 1))
        num_rows = len(row_req)
        params = [requests[i].params for i in row_req]
        greedy = [p.greedy for p in params]
        # A top-k at or above the vocabulary keeps everything: it is off.
        top_k = [p.top_k if 0 < p.top_k < vocab and not g else vocab for p, g in zip(params, greedy, strict=True)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)]
        sort_rows = [r for r in range(num_rows) if top_k[r] < vocab or top_p[r] < 1]
        any_top_p = any(top_p[r] < 1 for r in sort_rows)
        ints: dict[str, list[int]] = {
            "greedy": [int(g) for g in greedy],
            "draft": [t for d in drafts for t in [*d, -1]],  # -1: the bonus row verifies nothing
            "row_request": row_req,
            "first_row": firsts,
            "sort_rows": sort_rows,
            "top_k": [top_k[r] for r in sort_rows],
        }
        floats: dict[str, list[float]] = {
            # Greedy rows are sampled by argmax; temperature 1 keeps their (unused) probabilities finite.
            "temperature": [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
            "top_p": [top_p[r] for r in sort_rows],
            "min_p": [0.0 if g else p.min_p for p, g in zip(params, greedy, strict=True)],
        }
        batch = cls(
            requests, drafts, firsts, num_rows, vocab,
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            any_drafts=any(drafts),
            sort_rows=sort_rows,
            any_top_p=any_top_p,
            max_top_k=max((top_k[r] for r in sort_rows if top_k[r] < vocab), default=0),
            all_sorted_rows_top_k=all(top_k[r] < vocab for r in sort_rows),
            any_min_p=any(m > 0 for m in floats["min_p"]),
            any_penalties=any(r.params.needs_penalties for r in requests),
            any_bias=any(r.params.logit_bias for r in requests),
            unseeded_rows=[r for r in range(num_rows) if requests[row_req[r]].generator is None],
            logprob_rows=[r for r in range(num_rows) if params[r].logprobs is not None],
            logprob_ks=[p.logprobs for p in params if p.logprobs is not None],
        )
        ints["unseeded_rows"] = batch.unseeded_rows
        ints["logprob_rows"] = batch.logprob_rows
        if batch.any_penalties:
            more_ints, more_floats = penalty_lists(batch)
            ints.update(more_ints)
            floats.update(more_floats)
        if batch.any_bias:
            more_ints, more_floats = bias_lists(batch)
            ints.update(more_ints)
            floats.update(more_floats)
        batch.t = upload(device, ints, floats)
        batch.t["greedy"] = batch.t["greedy"].bool()
        return batch


# -- the host lists sample/penalties.py applies on the device ---------------------------------------------
def bias_lists(batch: SamplingBatch) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    """logit_bias as (flat index, value) pairs for every row of a biased request; a draft row gets its
    request's bias like any other."""
    idx: list[int] = []
    val: list[float] = []
    v = batch.vocab
    for i, r in enumerate(batch.requests):
        bias = r.params.logit_bias
        if not bias:
            continue
        # Checked here, on the host: out of range on the device would be an assert that kills the
        # CUDA context for everyone; here it fails this request alone (the API checks it first anyway).
        bad = next((t for t in bias if t >= v), None)
        if bad is not None:
            raise ValueError(f"logit_bias token {bad} is outside the vocabulary of {v}")
        for row in batch.rows_of(i):
            idx.extend(row * v + t for t in bias)
            val.extend(bias.values())
    return {"bias_index": idx}, {"bias_value": val}


def penalty_lists(batch: SamplingBatch) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    """Flat indices of every generated token (once per occurrence: they are counted) and of every
    prompt token (repetition penalty only), and the penalties of every row (neutral where none)."""
    generated: list[int] = []
    prompt_seen: list[int] = []
    rep = [1.0] * batch.num_rows
    freq = [0.0] * batch.num_rows
    pres = [0.0] * batch.num_rows
    v = batch.vocab
    for i, r in enumerate(batch.requests):
        p = r.params
        if not p.needs_penalties:
            continue
        prompt = set(r.prompt_token_ids) if p.repetition_penalty != 1 else ()
        # Row j of a request with drafts comes after drafts[:j]: they count as generated there.
        for row, history in zip(batch.rows_of(i), batch.row_histories(i), strict=True):
            generated.extend(row * v + t for t in history)
            prompt_seen.extend(row * v + t for t in prompt)
            rep[row], freq[row], pres[row] = p.repetition_penalty, p.frequency_penalty, p.presence_penalty
    ints = {"penalty_generated": generated, "penalty_prompt": prompt_seen}
    floats = {"repetition_penalty": rep, "frequency_penalty": freq, "presence_penalty": pres}
    return ints, floats
