"""OpenAI request bodies (the fields Sluice honours), plus vLLM's extra sampling fields that users
of vLLM send. Unknown fields are ignored, as OpenAI-compatible servers do.

Every field is bounded (docs/reliability.md): the sizes here, the sampling ranges in
SamplingParams, those that need the model (token ids, the context window) in serving.py, and the
body size in errors.BodySizeLimit. A value out of bounds is a 400 whose `param` names the field."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from ...sampling_params import MAX_N, MAX_PRIORITY, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

# vLLM's rule for `seed`: a signed 64-bit integer.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_MESSAGES = 4096
MAX_TOOLS = 128  # OpenAI's limit
MAX_CHAT_TEMPLATE_KWARGS = 64
MAX_LOGIT_BIAS = 1024
# Lists: a list over its bound is refused before its items are validated, so an 8 MiB body of
# wrongly typed items cannot make pydantic build millions of errors on the event loop.
MAX_PROMPTS = 1024  # prompts in one completions request (prompts x n must also fit --max-queue-len)
MAX_PROMPT_TOKEN_IDS = 2**20  # token ids in one prompt (the context window refuses far fewer)
MAX_CONTENT_PARTS = 4096
MAX_GUIDED_CHOICES = 4096
# Any one string in a request (a prompt, a message's content, a schema given as text), in characters;
# 4 Mi characters is several times the longest context a model here can take.
MAX_TEXT_CHARS = 4 * 2**20
# Nesting of objects and lists inside a field (a JSON schema, a message's content parts, tool
# parameters): deeper than this is refused before a template or grammar compiler recurses into it.
MAX_NESTING = 64


_PROMPT_SHAPE = ("prompt must be a non-empty string, list of strings, list of token ids, or list of lists of "
                 "token ids")


class _Base(BaseModel):
    # NaN and Infinity (which Python's JSON parser accepts) are refused in every number field.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Base):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class KVTransferParams(_Base):
    """Sluice extra (prefill/decode disaggregation, docs/architecture.md "KV beyond one engine"): where this
    request's prompt blocks go once it finishes here: the KV receiver of the decode engine that continues it. Sent
    by that engine's prefill hop only, with its hop token (docs/security.md)."""

    push_to: str = Field(pattern=r"^[A-Za-z0-9.\-\[\]:]+:[0-9]{1,5}$", max_length=300,
                         description="host:port of a decode engine's KV receiver (sluice serve --kv-role decode)")
    hop_token: str | None = Field(None, max_length=200,
                                  description="the decode engine's proof, made with the endpoint's KV key, that it "
                                              "names push_to (kv_transfer/keys.py); without it push_to is refused")


class _SamplingFields(_Base):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, le=MAX_N)  # >= 1 is checked by SamplingParams
    best_of: int | None = Field(None, ge=1, le=MAX_N)  # accepted when it equals n (no ranking of extras)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    user: str | None = None
    # Validated (token ids in the vocabulary, values in [-100, 100]) but not applied.
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    # vLLM extras
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
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
    guided_choice: list[str] | None = Field(None, max_length=MAX_GUIDED_CHOICES)
    guided_grammar: str | None = None  # EBNF (xgrammar's dialect, root rule `root`)
    kv_transfer_params: KVTransferParams | None = None
    # vLLM's: the request's place in the queue with --scheduling-policy priority, lower first. Strict: true, 1.0 and
    # "1" are refused, not read as 1.
    priority: StrictInt = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    prompt_logprobs: int | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, value: Any, handler):
        # Checked here rather than by the union, which validates every item against each member and
        # reports each failure: a million wrong items would be millions of errors.
        if isinstance(value, str):
            return value
        if not isinstance(value, list) or not value:
            raise ValueError(_PROMPT_SHAPE)
        if all(type(x) is str for x in value):
            if len(value) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts in one request, got {len(value)}")
            return value
        if all(type(x) is int for x in value):
            if len(value) > MAX_PROMPT_TOKEN_IDS:
                raise ValueError(f"at most {MAX_PROMPT_TOKEN_IDS} token ids in a prompt, got {len(value)}")
            return value
        if all(type(x) is list for x in value):
            if len(value) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts in one request, got {len(value)}")
            for ids in value:
                if len(ids) > MAX_PROMPT_TOKEN_IDS:
                    raise ValueError(f"at most {MAX_PROMPT_TOKEN_IDS} token ids in a prompt, got {len(ids)}")
                if not all(type(x) is int for x in ids):
                    raise ValueError(_PROMPT_SHAPE)
            return value
        raise ValueError(_PROMPT_SHAPE)


class ChatMessage(_Base):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=MAX_CHAT_TEMPLATE_KWARGS)
    # Tool calling (structured/tools.py): function tools; tool_choice none | auto | required | a named function.
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


def invalid_text(req: BaseModel) -> tuple[str, str] | None:
    """The first string in the request that cannot be served, as (param, reason): a lone surrogate
    (JSON allows "\\ud800"; no tokenizer or UTF-8 response can carry it), a string over
    MAX_TEXT_CHARS, or nesting deeper than MAX_NESTING. Walks field values, dict keys and a
    message's extra fields without recursion."""
    stack: list[tuple[Any, str, int]] = [(req, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if len(value) > MAX_TEXT_CHARS:
                return path, f"{path} is {len(value)} characters long; at most {MAX_TEXT_CHARS} are accepted"
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError as e:
                    return path, (f"{path} is not valid Unicode text: a lone surrogate "
                                  f"{value[e.start]!r} at character {e.start}")
            if _JSON_TEXT_FIELD.fullmatch(path) and json_nesting(value) > MAX_NESTING:
                return path, f"{path} is JSON nested more than {MAX_NESTING} levels deep"
            continue
        if depth > MAX_NESTING:
            field = path.split(".", 1)[0]
            return field, f"{field} is nested more than {MAX_NESTING} levels deep"
        prefix = f"{path}." if path else ""
        if isinstance(value, BaseModel):
            items = [(k, getattr(value, k)) for k in type(value).model_fields]
            items += list((value.model_extra or {}).items())
        elif isinstance(value, dict):
            items = list(value.items())
            stack.extend((k, path, depth + 1) for k in value)  # a bad key is reported as its dict's
        elif isinstance(value, list | tuple):
            items = list(enumerate(value))
        else:
            continue
        for k, v in reversed(items):
            if v is not None and not isinstance(v, bool | int | float):
                stack.append((v, f"{prefix}{k}", depth + 1))
    return None


# Fields whose strings are parsed as JSON later (a schema as text, a past tool call's arguments).
_JSON_TEXT_FIELD = re.compile(r"guided_json|messages\.\d+\.tool_calls\.\d+\.function\.arguments")
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_JSON_BRACKET = re.compile(r"[\[\]{}]")


def json_nesting(text: str) -> int:
    """How deeply JSON text nests objects and arrays, brackets inside strings not counted; computed
    without parsing, which recurses."""
    depth = deepest = 0
    for m in _JSON_BRACKET.finditer(_JSON_STRING.sub("", text)):
        depth += 1 if m.group() in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


# -- LoRA adapters at run time (vLLM's routes) ---------------------------------------------------------------
class LoadLoRAAdapterRequest(_Base):
    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(_Base):
    lora_name: str = Field(min_length=1, max_length=128)
