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
from ..draft_interface import DraftProposer

if TYPE_CHECKING:
    from pathlib import Path

    from ..tokenizer import Tokenizer
    from ..worker.model_runner import ModelRunner
    from .draft_model import DraftModelProposer


def build_proposer(cfg: SpeculativeConfig, draft: DraftModelProposer | None = None) -> DraftProposer | None:
    """The proposer of the configured method. A draft model is loaded beforehand (load_draft_model),
    beside the target, since its KV cache comes out of the same memory budget."""
    if cfg.method is None:
        return None
    if cfg.method == "ngram":
        from .ngram import NgramProposer

        return NgramProposer(cfg.num_speculative_tokens, cfg.ngram_min, cfg.ngram_max)
    assert draft is not None, "--speculative-method draft: the draft model is loaded with the target"
    return draft


def resolve_draft(cfg: SpeculativeConfig, tokenizer: Tokenizer) -> Path | None:
    """The draft model's directory (None without one), refused before any weight loads when its
    tokenizer differs from the target's."""
    if cfg.method != "draft":
        return None
    from ..model_fetch import resolve_model
    from ..tokenizer import Tokenizer

    draft_dir = resolve_model(cfg.draft_model)
    if Tokenizer.from_dir(draft_dir).backend.get_vocab() != tokenizer.backend.get_vocab():
        raise ValueError(f"--draft-model {cfg.draft_model}: its tokenizer differs from the target model's; "
                         "a draft must share the target's vocabulary")
    return draft_dir


def load_draft_model(draft_dir: Path, runner: ModelRunner) -> DraftModelProposer:
    """The draft's weights on the target's device, in its dtype, with its attention backend; no KV
    cache yet (allocate_kv_cache, once memory_profile.plan_kv_cache has sized both caches)."""
    from .draft_model import DraftModelProposer

    cfg = runner.cfg
    backend = runner.backend
    if backend.name == "ggml":  # the target is a GGUF in its blocks (fp16 cache); the draft keeps its dtype's
        from ..attention.backend import select_backend

        backend = select_backend("cpu", runner.device)
    return DraftModelProposer(draft_dir, cfg.num_speculative_tokens, backend=backend, device=runner.device,
                              dtype=runner.dtype, block_size=cfg.block_size, max_positions=runner.max_model_len,
                              target_vocab_size=runner.model_config.vocab_size,
                              max_forward_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs)
