"""The draft-proposal hook of the engine step, and its configuration.

Each step, before scheduling, the engine asks the proposer for drafts for every running request that
is decoding (one known token left to compute) and allows speculation, in one batched call. The scheduler then computes
that token plus the drafts in one forward; the sampler verifies the drafts against the target's
distribution and the request's counters roll back past the first rejected one (no KV is copied: the
rejected slots are simply overwritten by later steps).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import SpeculativeConfig
from .interface import DraftProposer

if TYPE_CHECKING:
    from ..model_runner import ModelRunner
    from ..tokenizer import Tokenizer


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
                              max_positions=runner.max_model_len, target_vocab_size=runner.model_config.vocab_size,
                              max_num_seqs=runner.cfg.max_num_seqs,
                              max_num_batched_tokens=runner.cfg.max_num_batched_tokens)
