"""Speculative decoding: proposers that guess the next tokens cheaply, and the engine-side policy of
when to ask them. Verification (one target forward over all drafts, then rejection sampling) lives in
the model runner and the sampler, so the output distribution is the target model's."""

from ..config import SpeculativeConfig
from ..draft_interface import DraftProposer, DraftQuery
from .proposer import build_proposer, load_draft_model, resolve_draft

__all__ = ["DraftProposer", "DraftQuery", "SpeculativeConfig", "build_proposer", "load_draft_model", "resolve_draft"]
