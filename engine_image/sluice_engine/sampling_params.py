"""Per-request sampling parameters, validated once at the API edge."""

from __future__ import annotations

from dataclasses import dataclass, field

# Bounds every request is held to (docs/reliability.md). The API adds those that need the model
# (token ids within the vocabulary) and the int64 range for `seed` (vLLM's rule; seed + i for choice
# i of n must still fit the generator, which takes [-2**63, 2**64 - 1]).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_TOP_K = 2**31 - 1  # larger than any vocabulary: values >= the vocabulary size mean "off"
MAX_N = 128  # OpenAI's limit on choices per request
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS = 64, 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_VALUE = 1024, 100.0  # OpenAI's bounds
# Below this a temperature samples the argmax anyway (vLLM's epsilon); dividing float32 logits by a
# smaller one overflows them to inf and the draw would be garbage.
GREEDY_TEMPERATURE = 1e-5
# top_p below this keeps only the most likely token, exactly as smaller values would, and still is a
# normal float32 (1e-300 would round to 0 in the sampler's tensors and drop every token).
MIN_TOP_P = 1e-30
# A request's scheduling priority (--scheduling-policy priority; lower is served earlier): a 32-bit signed range.
MAX_PRIORITY = 2**31 - 1


class InvalidParam(ValueError):
    """A request parameter is out of range. `param` names the field (OpenAI error shape)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def check_priority(priority: object, policy: str) -> None:
    """A request's `priority` (not a sampling parameter, but checked by the same rules): an integer within
    +-MAX_PRIORITY, and nonzero only where the engine schedules by priority (vLLM refuses it likewise)."""
    if type(priority) is not int:
        raise InvalidParam("priority", f"priority must be an integer, got {priority!r}")
    if not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidParam("priority", f"priority must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {priority}")
    if priority and policy != "priority":
        raise InvalidParam("priority", f"priority scheduling is not enabled: this server serves requests first come, "
                           f"first served (--scheduling-policy {policy}); send priority 0 or leave it out")


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
    # Added to a token's logit before penalties and sampling (OpenAI's logit_bias; -100 bans a
    # token, +100 all but forces it).
    logit_bias: dict[int, float] | None = None
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
        if not self.temperature <= MAX_TEMPERATURE:
            raise InvalidParam("temperature", f"temperature must be at most {MAX_TEMPERATURE:g}, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidParam("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_p < MIN_TOP_P:
            self.top_p = MIN_TOP_P
        if self.top_k == 0 or self.top_k < -1:
            raise InvalidParam("top_k", f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.top_k > MAX_TOP_K:
            raise InvalidParam("top_k", f"top_k must be at most {MAX_TOP_K}, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise InvalidParam("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise InvalidParam("presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise InvalidParam(
                "frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"
            )
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidParam(
                "repetition_penalty", f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                f"{MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}"
            )
        if self.n < 1:
            raise InvalidParam("n", f"n must be at least 1, got {self.n}")
        if self.n > MAX_N:
            raise InvalidParam("n", f"n must be at most {MAX_N}, got {self.n}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise InvalidParam("seed", f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidParam("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidParam("prompt_logprobs",
                               f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidParam("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        longest = max(map(len, self.stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise InvalidParam("stop", f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters, "
                               f"got one of {longest}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidParam("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, "
                               f"got {len(self.stop_token_ids)}")
        bad = next((t for t in self.stop_token_ids if not 0 <= t <= MAX_TOP_K), None)
        if bad is not None:
            raise InvalidParam("stop_token_ids", f"stop_token_ids holds {bad}, which is not a token id")
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise InvalidParam("logit_bias", f"at most {MAX_LOGIT_BIAS} logit_bias entries, got {len(self.logit_bias)}")
            bad = next((t for t in self.logit_bias if not 0 <= t <= MAX_TOP_K), None)
            if bad is not None:
                raise InvalidParam("logit_bias", f"logit_bias key {bad} is not a token id")
            bad = next((v for v in self.logit_bias.values() if not -MAX_LOGIT_BIAS_VALUE <= v <= MAX_LOGIT_BIAS_VALUE),
                       None)
            if bad is not None:
                raise InvalidParam("logit_bias", f"logit_bias values must be in [-{MAX_LOGIT_BIAS_VALUE:g}, "
                                   f"{MAX_LOGIT_BIAS_VALUE:g}], got {bad}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
