"""What the API process needs to know of the served model, and the checks a request must pass before it reaches
the engine (they read only the model's fixed limits). Plain data, no torch: the API process imports it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..sampling_params import SamplingParams


class RequestRejected(ValueError):
    """The request can never be served as asked (too long for the context or the KV cache)."""

    def __init__(self, param: str, message: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the API layer needs to know of the served model (the engine client's model info)."""

    served_model_name: str
    model_dir: Path
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    lora_names: tuple[str, ...] = ()  # the LoRA adapters served beside the base model (--lora-modules)


def check_prompt(info: ModelInfo, prompt_token_ids: list[int], params: SamplingParams) -> None:
    """Raise RequestRejected if the request can never be served as asked: it reads only the model's fixed
    limits, so the API process checks before a request reaches the engine, wherever that runs."""
    n = len(prompt_token_ids)
    max_model_len = info.max_model_len
    if n == 0:
        raise RequestRejected("prompt", "prompt is empty", "empty_prompt")
    if n >= max_model_len:
        raise RequestRejected(
            "prompt", f"prompt has {n} tokens; this model's context window (max_model_len) is "
            f"{max_model_len} tokens, leaving no room to generate", "context_length_exceeded",
        )
    if n + params.max_tokens > max_model_len:
        raise RequestRejected(
            "max_tokens", f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the context window "
            f"of {max_model_len} tokens", "context_length_exceeded",
        )
    vocab = info.vocab_size
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestRejected("prompt", f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
