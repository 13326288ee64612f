"""logit_bias and the repetition / presence / frequency penalties, for all rows of a batch at once.

The definitions are vLLM's (and OpenAI's for presence and frequency):
- repetition_penalty divides a positive logit and multiplies a negative one, for every token seen in
  the prompt or the output, once however often it was seen;
- frequency_penalty * (times generated) + presence_penalty * (generated at all) is subtracted, counting
  output tokens only.
The host only lists the token ids (histories it already holds) as flat indices into the logits
(row * vocab + token). On the device one scatter_add counts them per row, and the penalised values
are computed and written back at those indices only: the work grows with the histories, not with
rows x vocabulary, and no loop runs over requests or tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .sampling_batch import SamplingBatch


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


def apply_logit_bias(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """In place; `logits` must be contiguous (the sampler's own copy). A dict has each token once, so
    no index repeats and the sum is exact."""
    logits.view(-1).index_add_(0, batch.t["bias_index"], batch.t["bias_value"])


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


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """In place; `logits` must be contiguous (the sampler's own copy)."""
    t = batch.t
    flat = logits.view(-1)
    gen = t["penalty_generated"]
    counts = torch.zeros_like(flat)
    counts.scatter_add_(0, gen, torch.ones_like(gen, dtype=flat.dtype))
    # Every touched entry, repeats included: each repeat computes and writes the same value.
    idx = torch.cat([gen, t["penalty_prompt"]])
    row = idx // batch.vocab
    x = flat[idx]
    c = counts[idx]
    rep = t["repetition_penalty"][row]
    x = torch.where(x > 0, x / rep, x * rep)
    x = x - (t["frequency_penalty"][row] * c + t["presence_penalty"][row] * (c > 0))
    flat[idx] = x
