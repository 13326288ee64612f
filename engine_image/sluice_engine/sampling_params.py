"""Per-request sampling parameters, validated once at the API edge."""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidParam(ValueError):
    """A request parameter is out of range. `param` names the field (OpenAI error shape)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: off; k >= 0: sampled token's logprob plus top-k
    prompt_logprobs: int | None = None  # None: off; k >= 0: logprob of each prompt token (+top-k)
    n: int = 1
    skip_special_tokens: bool = True
    # Per-request opt-out of speculative decoding (when the server runs it).
    speculative: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidParam("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if not self.temperature >= 0:  # written so that NaN fails too
            raise InvalidParam("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidParam("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise InvalidParam("top_k", f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise InvalidParam("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise InvalidParam("presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise InvalidParam(
                "frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"
            )
        if not self.repetition_penalty > 0:
            raise InvalidParam(
                "repetition_penalty", f"repetition_penalty must be > 0, got {self.repetition_penalty}"
            )
        if self.n < 1:
            raise InvalidParam("n", f"n must be at least 1, got {self.n}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidParam("logprobs", f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise InvalidParam("prompt_logprobs", f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
