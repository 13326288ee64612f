"""A request inside the engine: token ids plus counters. There is no prefill or decode phase; the
scheduler only ever closes the gap between `num_computed_tokens` and `num_tokens`."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .sampling_params import SamplingParams

# A logits processor sees the tokens generated so far and the row of logits for the next token,
# and returns the row (in place is fine). Structured output plugs in here.
LogitsProcessor = Callable[[list[int], "object"], "object"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    logits_processors: list[LogitsProcessor] = field(default_factory=list)

    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache on first admission (reported in usage).
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # Per-request generator: a seeded request samples the same tokens whatever else is batched.
    generator: object | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # The metrics recorder's per-request state (metrics.RequestTimes), set the first time a step runs it.
    metrics: object | None = None
    # Prompt logprobs collected chunk by chunk: (token logprob, top-k) per prompt position >= 1.
    prompt_logprobs: list = field(default_factory=list)
    # Draft tokens proposed for this step (speculative decoding): computed after the last known token
    # and verified by the sampler; never part of all_token_ids until accepted.
    spec_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.params.max_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
