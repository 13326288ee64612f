"""The draft-proposal hook of the engine step, and its configuration.

Each step, before scheduling, the engine asks the proposer for drafts for every running request that
is decoding (one known token left to compute) and allows speculation, in one batched call. The scheduler then computes
that token plus the drafts in one forward; the sampler verifies the drafts against the target's
distribution and the request's counters roll back past the first rejected one (no KV is copied: the
rejected slots are simply overwritten by later steps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .draft_model import DraftQuery

if TYPE_CHECKING:
    from ..model_runner import ModelRunner
    from ..tokenizer import Tokenizer


class DraftProposer(Protocol):
    name: str
    k: int

    def propose_batch(self, queries: list[DraftQuery]) -> list[list[int]]:
        """Per query, at most `max_tokens` guessed continuations of `token_ids` (prompt + output so far)."""

    def release(self, request_id: str) -> None:
        """The request finished: drop whatever the proposer keeps for it."""


@dataclass(slots=True)
class SpeculativeConfig:
    method: str | None = None  # None | "ngram" | "draft"
    num_speculative_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    # Above this many running requests, a step does not speculate: the batch already uses the compute
    # that speculation would otherwise fill (see docs/BENCHMARKS.md for where the crossover lies).
    disable_batch_size: int = 8
    draft_model: str | None = None  # an HF directory (or GGUF) of a smaller model with the same tokenizer

    def __post_init__(self) -> None:
        if self.draft_model is not None and self.method is None:
            self.method = "draft"  # --draft-model alone means draft-model speculation
        if self.method not in (None, "ngram", "draft"):
            raise ValueError(f"--speculative-method must be ngram or draft, got {self.method!r}")
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("--speculative-method draft needs --draft-model")
        if self.method == "ngram" and self.draft_model is not None:
            raise ValueError("--draft-model is used only with --speculative-method draft")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"--num-speculative-tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"--ngram-min/--ngram-max must satisfy 1 <= min <= max, got {self.ngram_min}/{self.ngram_max}"
            )
        if self.disable_batch_size < 1:
            raise ValueError(f"--speculative-disable-batch-size must be >= 1, got {self.disable_batch_size}")


def build_proposer(cfg: SpeculativeConfig, runner: ModelRunner, tokenizer: Tokenizer,
                   num_kv_tokens: int) -> DraftProposer | None:
    if cfg.method is None:
        return None
    if cfg.method == "ngram":
        from .ngram import NgramProposer

        return NgramProposer(cfg.num_speculative_tokens, cfg.ngram_min, cfg.ngram_max)
    from ..model_fetch import resolve_model
    from ..tokenizer import Tokenizer
    from .draft_model import DraftModelProposer

    draft_dir = resolve_model(cfg.draft_model)
    if Tokenizer.from_dir(draft_dir).backend.get_vocab() != tokenizer.backend.get_vocab():
        raise ValueError(f"--draft-model {cfg.draft_model}: its tokenizer differs from the target model's; "
                         "a draft must share the target's vocabulary")
    return DraftModelProposer(draft_dir, cfg.num_speculative_tokens, backend=runner.backend, device=runner.device,
                              dtype=runner.dtype, block_size=runner.cfg.block_size, num_tokens=num_kv_tokens,
                              max_positions=runner.max_model_len, target_vocab_size=runner.model_config.vocab_size)
