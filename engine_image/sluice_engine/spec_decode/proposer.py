"""The draft-proposal hook of the engine step, and its configuration.

Each step, before scheduling, the engine asks the proposer for drafts for every running request that
is decoding (one known token left to compute) and allows speculation. The scheduler then computes
that token plus the drafts in one forward; the sampler verifies the drafts against the target's
distribution and the request's counters roll back past the first rejected one (no KV is copied: the
rejected slots are simply overwritten by later steps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class DraftProposer(Protocol):
    name: str
    k: int

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """At most `max_tokens` guessed continuations of `token_ids` (prompt + output so far)."""


@dataclass(slots=True)
class SpeculativeConfig:
    method: str | None = None  # None | "ngram"
    num_speculative_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    # Above this many running requests, a step does not speculate: the batch already uses the compute
    # that speculation would otherwise fill (see docs/BENCHMARKS.md for where the crossover lies).
    disable_batch_size: int = 8

    def __post_init__(self) -> None:
        if self.method not in (None, "ngram"):
            raise ValueError(f"--speculative-method must be ngram, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"--num-speculative-tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"--ngram-min/--ngram-max must satisfy 1 <= min <= max, got {self.ngram_min}/{self.ngram_max}"
            )
        if self.disable_batch_size < 1:
            raise ValueError(f"--speculative-disable-batch-size must be >= 1, got {self.disable_batch_size}")


def build_proposer(cfg: SpeculativeConfig) -> DraftProposer | None:
    if cfg.method is None:
        return None
    from .ngram import NgramProposer

    return NgramProposer(cfg.num_speculative_tokens, cfg.ngram_min, cfg.ngram_max)
