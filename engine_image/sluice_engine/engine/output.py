"""What the engine hands out for a request each step: a delta of tokens (and, once the output processor has
made it, their text). Plain data: it crosses from an engine-core process to the API process as it is."""

from __future__ import annotations

from dataclasses import dataclass

from ..sample.token_logprobs import TokenLogprobs


@dataclass(slots=True)
class RequestOutput:
    """A delta: what one request produced in one step."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    logprobs: list[TokenLogprobs]
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs] | None = None  # once, on the first delta, when asked
    error: str | None = None  # the request failed (finish_reason "error"): why
    # Tracing on (--otlp-traces-endpoint) only: the core's (arrival, first scheduled, first token) times
    # (time.monotonic(), one clock for the host's processes) on the request's first delta with tokens, and the API
    # side's seconds spent detokenizing it on its last delta (entrypoints/openai/tracing.py builds the span).
    timing: tuple[float, float, float] | None = None
    detokenize_seconds: float | None = None


def failed_output(request_id: str, num_prompt_tokens: int, num_output_tokens: int, e: Exception) -> RequestOutput:
    """A request's last delta when it fails (finish_reason "error"), naming why."""
    return RequestOutput(request_id, [], "", [], finished=True, finish_reason="error",
                         num_prompt_tokens=num_prompt_tokens, num_output_tokens=num_output_tokens,
                         error=f"{type(e).__name__}: {e}")
