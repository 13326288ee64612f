"""logit_bias and the repetition / presence / frequency penalties, for all rows of a batch at once.

The definitions are vLLM's (and OpenAI's for presence and frequency):
- repetition_penalty divides a positive logit and multiplies a negative one, for every token seen in
  the prompt or the output, once however often it was seen;
- frequency_penalty * (times generated) + presence_penalty * (generated at all) is subtracted, counting
  output tokens only.
The host only lists the token ids (sampling_batch.penalty_lists and bias_lists, from the histories it
already holds) as flat indices into the logits (row * vocab + token). On the device one scatter_add counts them per row, and the penalised values
are computed and written back at those indices only: the work grows with the histories, not with
rows x vocabulary, and no loop runs over requests or tokens.
"""

from __future__ import annotations

import torch


def apply_logit_bias(logits: torch.Tensor, t: dict[str, torch.Tensor]) -> None:
    """In place; `logits` must be contiguous (the sampler's own copy). `t`: the batch's tensors, with the
    lists sampling_batch.bias_lists made. A dict has each token once, so no index repeats and the sum is
    exact."""
    logits.view(-1).index_add_(0, t["bias_index"], t["bias_value"])


def apply_penalties(logits: torch.Tensor, t: dict[str, torch.Tensor]) -> None:
    """In place; `logits` must be contiguous (the sampler's own copy). `t`: the batch's tensors, with the
    lists sampling_batch.penalty_lists made."""
    vocab = logits.shape[-1]
    flat = logits.view(-1)
    gen = t["penalty_generated"]
    counts = torch.zeros_like(flat)
    counts.scatter_add_(0, gen, torch.ones_like(gen, dtype=flat.dtype))
    # Every touched entry, repeats included: each repeat computes and writes the same value.
    idx = torch.cat([gen, t["penalty_prompt"]])
    row = idx // vocab
    x = flat[idx]
    c = counts[idx]
    rep = t["repetition_penalty"][row]
    x = torch.where(x > 0, x / rep, x * rep)
    x = x - (t["frequency_penalty"][row] * c + t["presence_penalty"][row] * (c > 0))
    flat[idx] = x
