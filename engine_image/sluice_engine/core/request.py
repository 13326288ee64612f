"""A request inside the engine: token ids plus counters. There is no prefill or decode phase; the
scheduler only ever closes the gap between `num_computed_tokens` and `num_tokens`."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from ..sampling_params import SamplingParams
from .lora_slots import LoRARef

# A logits processor sees the tokens generated so far and the row of logits for the next token,
# and returns the row (in place is fine).
LogitsProcessor = Callable[[list[int], "object"], "object"]


@runtime_checkable
class TokenConstraint(Protocol):
    """A logits processor with state, passed in `logits_processors` like a plain one: it allows only
    some tokens next (a grammar: structured output, see structured/) and advances with every token
    the request emits. Unlike a plain processor it composes with speculative decoding.

    - `accept(token_id)`: the engine calls it for each token appended to the request's output.
    - `valid_prefix(token_ids)`: how many of these tokens, in order, may come next (drafts are cut there).
    - `apply_batch(logits, rows)`: one call per constraint class per sampling step, masking in place.
      `rows` holds (first logits row, constraint, drafts): row first + i gets the mask of the state
      after drafts[:i]. The constraints' own state is the same afterwards.
    """

    def accept(self, token_id: int) -> None: ...

    def valid_prefix(self, token_ids: list[int]) -> int: ...

    @classmethod
    def apply_batch(cls, logits, rows: list[tuple[int, TokenConstraint, list[int]]]) -> None: ...


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
    # The TokenConstraints among the processors given, moved here by __post_init__.
    constraints: list[TokenConstraint] = field(default_factory=list, init=False)

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
    # Async scheduling (docs/architecture.md): tokens scheduled in steps whose results are not back yet, and of
    # those steps, how many sample a token (each such token is a placeholder the next step reads on the device).
    # Both are 0 between steps when steps run one at a time.
    num_in_flight_tokens: int = 0
    num_output_placeholders: int = 0
    # Draft tokens proposed for this step (speculative decoding): computed after the last known token
    # and verified by the sampler; never part of all_token_ids until accepted.
    spec_token_ids: list[int] = field(default_factory=list)
    # An in-flight request with the same prompt (n > 1 siblings, identical concurrent prompts): once it
    # has computed the prompt, this one shares its blocks instead of prefilling (see KVCacheManager.fork).
    fork_source: Request | None = None
    # Pipeline parallelism: the virtual engine (scheduler partition) this request is stepped on.
    virtual_engine: int = 0
    # The LoRA adapter the request runs on (None: the base model), and its device slot while it holds one
    # (core/lora_slots.py: from admission until it finishes or is preempted).
    lora: LoRARef | None = None
    # host:port of another engine's KV receiver: the prompt's blocks are pushed there when this request finishes
    # (prefill/decode disaggregation, kv_transfer/).
    kv_push_to: str | None = None
    lora_slot: int | None = None
    # With --scheduling-policy priority: lower is served earlier (vLLM's rule); ties go by arrival. Set by the API.
    priority: int = 0

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        procs = self.logits_processors
        self.constraints = [p for p in procs if isinstance(p, TokenConstraint)]
        self.logits_processors = [p for p in procs if not isinstance(p, TokenConstraint)]

    @property
    def lora_name(self) -> str | None:
        return None if self.lora is None else self.lora.name

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Computed, or being computed by a step in flight: where the next step starts."""
        return self.num_computed_tokens + self.num_in_flight_tokens

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


class PromptLeaders:
    """n > 1 siblings and identical concurrent prompts share the prompt's KV (forked once the first of them, the
    leader, has computed it) instead of each prefilling it. The key holds the adapter: its KV is the adapter's."""

    def __init__(self) -> None:
        self._by_prompt: dict[tuple, Request] = {}

    def follow(self, req: Request) -> None:
        """A new request: it forks from the running leader of its prompt, or leads it."""
        key = (req.lora and req.lora.id, *req.prompt_token_ids)
        leader = self._by_prompt.get(key)
        if leader is not None and not leader.is_finished and req.params.prompt_logprobs is None:
            req.fork_source = leader
        else:
            self._by_prompt[key] = req

    def release(self, req: Request) -> None:
        """A finished request no longer leads its prompt."""
        key = (req.lora and req.lora.id, *req.prompt_token_ids)
        if self._by_prompt.get(key) is req:
            del self._by_prompt[key]
