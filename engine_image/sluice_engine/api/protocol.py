"""OpenAI request bodies (the fields Sluice honours), plus vLLM's extra sampling fields that users
of vLLM send. Unknown fields are ignored, as OpenAI-compatible servers do."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Base):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Base):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Sluice extra: false opts this request out of speculative decoding (when the server runs it).
    speculative: bool = True
    # Logprob entries name tokens as "token_id:<id>" (vLLM's flag): exact ids for clients that need them.
    return_tokens_as_token_ids: bool = False
    # Structured output (structured/): OpenAI's response_format ({"type": "json_object"} or
    # {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}), or one of vLLM's fields.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # EBNF (xgrammar's dialect, root rule `root`)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    prompt_logprobs: int | None = None


class ChatMessage(_Base):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # Tool calling (structured/tools.py): function tools; tool_choice none | auto | required | a named function.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
