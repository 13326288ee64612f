"""N-gram prompt lookup: the next tokens are guessed by finding the sequence's latest n-gram earlier
in its own prompt and output, and proposing what followed it there. No extra model; it pays off
when outputs repeat their input (summaries, code edits, extraction, RAG quotes)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..draft_interface import DraftQuery


def ngram_propose(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the sequence's last n
    tokens, trying the longest n first (a longer match predicts better). [] when nothing matches."""
    length = len(token_ids)
    if k <= 0 or length < n_min + 1:
        return []
    arr = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        pattern = arr[length - n :]
        # Windows starting at 0 .. length-n-1: every earlier occurrence that has a continuation
        # (the suffix itself starts at length-n and is excluded).
        windows = sliding_window_view(arr[: length - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the most recent match: local repetition predicts best
            return arr[start : start + k].tolist()
    return []


class NgramProposer:
    name = "ngram"

    def __init__(self, k: int, n_min: int, n_max: int):
        self.k = k
        self.n_min = n_min
        self.n_max = n_max

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        return ngram_propose(token_ids, min(self.k, max_tokens), self.n_min, self.n_max)

    def propose_batch(self, queries: list[DraftQuery]) -> list[list[int]]:
        return [self.propose(q.token_ids, q.max_tokens) for q in queries]

    def release(self, request_id: str) -> None:
        pass  # stateless
