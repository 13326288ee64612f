"""The proposer interface of speculative decoding, torch-free: what the engine asks (a DraftQuery per
decoding request) and what a proposer answers. See proposer.py for the policy of when to ask."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


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
