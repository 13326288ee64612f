"""The proposer interface of speculative decoding, torch-free and below every layer (pyproject's import-linter
layers): what the engine asks (a DraftQuery per decoding request), what a proposer answers, and what the memory
planner needs of a draft model. The worker layer (warm-up, memory planning) uses these without importing
spec_decode/, which sits above it (its draft model runs on the worker's buffers). See spec_decode/proposer.py for
the policy of when to ask."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(slots=True)
class DraftQuery:
    request_id: str
    token_ids: list[int]  # the request's known tokens; the last one is not in the target's cache yet
    max_tokens: int  # at most this many drafts


class DraftProposer(Protocol):
    name: str
    k: int

    def propose_batch(self, queries: list[DraftQuery]) -> list[list[int]]:
        """Per query, at most `max_tokens` guessed continuations of `token_ids` (prompt + output so far)."""

    def release(self, request_id: str) -> None:
        """The request finished: drop whatever the proposer keeps for it."""


class DraftModel(Protocol):
    """A draft model as the memory planner sees it (spec_decode/draft_model.py DraftModelProposer)."""

    model: Any
    kv_bytes_per_token: int

    def profile_step_peak(self, num_seqs: int) -> int:
        """The activation peak of one draft step over `num_seqs` sequences, in bytes."""
