"""The distribution each row samples from: temperature -> top-k -> top-p -> min-p, each on what the
previous one left (vLLM's order), for all rows at once with per-row parameters as tensors.

At most one sort per step, and only of the rows that use top-k or top-p: greedy rows and rows
without truncation are not sorted. top-k alone needs no sort (the k-th largest value comes from
topk), nor does top-p when every truncating row also has a top-k (its nucleus is within its top k,
so a topk of the largest k is the sort). A step where no row truncates sorts nothing.
"""

from __future__ import annotations

import torch

from .sampling_batch import SamplingBatch


def sampling_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    t = batch.t
    x = logits / t["temperature"][:, None]
    if batch.sort_rows:
        x = _truncate(x, batch)
    probs = x.softmax(dim=-1)
    if batch.any_min_p:
        threshold = probs.max(dim=-1, keepdim=True).values * t["min_p"][:, None]
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _truncate(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """top-k then top-p on the rows in batch.sort_rows; the others come back unchanged."""
    t = batch.t
    whole = len(batch.sort_rows) == x.shape[0]
    sub = x if whole else x.index_select(0, t["sort_rows"])
    k = t["top_k"][:, None]  # vocab for a row without top-k
    if not batch.any_top_p:
        # Ties with the k-th value are kept (a set, not a count: the order among ties is arbitrary).
        drop = sub < sub.topk(batch.max_top_k, dim=-1).values.gather(1, k - 1)
    else:
        # When every row sorted has a top-k, its nucleus lies within its top k: the largest k among
        # them, from topk, is all the sorting needed. Otherwise the one full sort.
        if batch.all_sorted_rows_top_k:
            sorted_x, order = sub.topk(batch.max_top_k, dim=-1)
        else:
            sorted_x, order = sub.sort(dim=-1, descending=True)
        drop_sorted = sorted_x < sorted_x.gather(1, k - 1)
        sorted_x = sorted_x.masked_fill(drop_sorted, float("-inf"))
        probs = sorted_x.softmax(dim=-1)
        top_p = t["top_p"][:, None]
        # Drop a token when the mass before it already reaches top_p (the top token always stays). A row
        # with top_p = 1 drops nothing, even where rounding takes the running sum to 1 early.
        drop_sorted |= ((probs.cumsum(dim=-1) - probs) >= top_p) & (top_p < 1)
        # Tokens outside `order` (beyond the top max-k) are dropped: they are outside every row's top-k.
        drop = torch.ones_like(sub, dtype=torch.bool) if order.shape[1] < sub.shape[1] else torch.empty_like(
            sub, dtype=torch.bool)
        drop.scatter_(1, order, drop_sorted)
    sub = sub.masked_fill(drop, float("-inf"))
    return sub if whole else x.index_copy(0, t["sort_rows"], sub)
