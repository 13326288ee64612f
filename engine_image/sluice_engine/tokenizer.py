"""Tokenization, chat templates and streaming detokenization, on `tokenizers` + jinja2 only.

transformers is deliberately not imported: it is slow to import and the server only needs the fast
tokenizer file plus the few settings HF keeps beside it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

NO_CHAT_TEMPLATE_ERROR = "model has no chat template; use /v1/completions"

# What HF's `clean_up_tokenization_spaces` undoes: spaces a word-level tokenizer put before punctuation.
_CLEANUP_REPLACEMENTS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_special_tokens: dict[str, str] | None = None,
        add_bos_token: bool | None = None,
        eos_token_ids: Iterable[int] = (),
        bos_token_id: int | None = None,
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self._backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._special_tokens = {
            "bos_token": bos_token,
            "eos_token": eos_token,
            **(extra_special_tokens or {}),
        }
        self._add_bos_token = add_bos_token
        self._clean_up_spaces = clean_up_tokenization_spaces
        eos_ids = set(eos_token_ids)
        if eos_token is not None and (eos_id := backend.token_to_id(eos_token)) is not None:
            eos_ids.add(eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        if bos_token is not None and (named_bos_id := backend.token_to_id(bos_token)) is not None:
            bos_token_id = named_bos_id
        self.bos_token_id: int | None = bos_token_id

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        tok_config = _read_json(path / "tokenizer_config.json")
        gen_config = _read_json(path / "generation_config.json")
        model_config = _read_json(path / "config.json")

        # HF gives a separate chat_template.jinja priority over the entry in tokenizer_config.json.
        template_file = path / "chat_template.jinja"
        if template_file.is_file():
            chat_template: str | None = template_file.read_text(encoding="utf-8")
        else:
            chat_template = _pick_default_template(tok_config.get("chat_template"))

        # Multimodal configs keep the language model's ids under text_config.
        text_config = model_config.get("text_config") or {}
        eos_ids: set[int] = set()
        for config in (gen_config, model_config, text_config):
            eos_ids.update(_as_id_list(config.get("eos_token_id")))
        bos_id = next(
            (
                c["bos_token_id"]
                for c in (gen_config, model_config, text_config)
                if _is_int(c.get("bos_token_id"))
            ),
            None,
        )
        extra_special = {
            name: token
            for name in ("unk_token", "pad_token")
            if (token := _token_content(tok_config.get(name))) is not None
        }
        add_bos = tok_config.get("add_bos_token")
        return cls(
            backend,
            chat_template=chat_template,
            bos_token=_token_content(tok_config.get("bos_token")),
            eos_token=_token_content(tok_config.get("eos_token")),
            extra_special_tokens=extra_special,
            add_bos_token=add_bos if isinstance(add_bos, bool) else None,
            eos_token_ids=eos_ids,
            bos_token_id=bos_id,
            clean_up_tokenization_spaces=bool(tok_config.get("clean_up_tokenization_spaces", False)),
        )

    # --- ids <-> text -------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The `tokenizers` object (structured output indexes its vocabulary and decoder)."""
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        # Older Llama-style configs ask for BOS via add_bos_token while tokenizer.json's post-processor
        # does not add it; HF's Llama tokenizer honoured the flag, so we do too.
        if (
            add_special_tokens
            and self._add_bos_token
            and self.bos_token_id is not None
            and (not ids or ids[0] != self.bos_token_id)
        ):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up_spaces:
            for before, after in _CLEANUP_REPLACEMENTS:
                text = text.replace(before, after)
        return text

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    # --- chat templates -----------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """Render messages to the prompt text; raises ValueError for bad input or a failing template."""
        if not self.chat_template:
            raise ValueError(NO_CHAT_TEMPLATE_ERROR)
        context = {
            **{name: token for name, token in self._special_tokens.items() if token is not None},
            # Same names HF passes, so templates that test `documents is defined`/`tools` behave alike.
            "tools": tools,
            "documents": None,
            **extra,
            "messages": [_flatten_content(message) for message in messages],
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._compiled_chat_template.render(**context)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> list[int]:
        prompt = self.apply_chat_template(messages, add_generation_prompt, tools, **extra)
        # The template writes any BOS/role tokens itself; adding special tokens again would double them.
        return self.encode(prompt, add_special_tokens=False)

    @cached_property
    def _compiled_chat_template(self) -> jinja2.Template:
        assert self.chat_template is not None
        try:
            return _chat_template_env().from_string(self.chat_template)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template does not compile: {e}") from e


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into a stream of text pieces.

    Text for a token can depend on its neighbours (byte-level BPE splits one UTF-8 character across
    tokens; SentencePiece-style decoders drop a leading space only at the start of the decoded text). So
    each step decodes a short window of tokens and emits what is new: `_prefix_offset.._read_offset` is
    context whose text was already emitted, `_read_offset..` are the tokens still being emitted, of whose
    text the first `_pending_emitted` characters were already sent.
    """

    # Prompt tokens kept as context for the first generated token (enough for any leading-space rule).
    _PROMPT_CONTEXT_TOKENS = 5
    # An unfinished UTF-8 character has at most 3 bytes, which decode to at most 3 trailing U+FFFD (one per
    # byte with SentencePiece byte fallback, one in all for byte-level BPE). Text before them is final.
    _MAX_UNFINISHED_CHARS = 3

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids[-self._PROMPT_CONTEXT_TOKENS :])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._pending_emitted = 0
        self._pieces: list[str] = []
        self.token_count = 0

    @property
    def text(self) -> str:
        """All generated text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add generated tokens; return the text they completed (may be "" while a character is split)."""
        self._ids.extend(new_token_ids)
        self.token_count += len(new_token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of generation: emit whatever is still held back, even an unfinished character."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        context_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        start = len(context_text) + self._pending_emitted
        unfinished = 0 if final else _trailing_replacement_chars(full_text, self._MAX_UNFINISHED_CHARS)
        if unfinished:
            # Send what is final now (a model may chain tokens that each end inside a character), hold the
            # tail, and keep the tokens pending so the held character is decoded whole next time.
            delta = full_text[start : len(full_text) - unfinished]
            self._pending_emitted += len(delta)
        elif len(full_text) <= start:
            # Nothing printable yet (say, a skipped special token). Keep the tokens pending rather than
            # making them the next context: a context that decodes to "" would lose a leading space.
            return ""
        else:
            delta = full_text[start:]
            # Everything up to here is emitted; these tokens become the context for the next step and
            # older ids can go, so a long generation keeps a short list.
            del self._ids[: self._read_offset]
            self._prefix_offset = 0
            self._read_offset = len(self._ids)
            self._pending_emitted = 0
        if delta:
            self._pieces.append(delta)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


def _trailing_replacement_chars(text: str, limit: int) -> int:
    count = 0
    while count < limit and count < len(text) and text[-1 - count] == "\ufffd":
        count += 1
    return count


def _flatten_content(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI allows content as a list of parts; text-only templates expect one string."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text":
            texts.append(str(part.get("text", "")))
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"unsupported message content part {kind!r}: this model takes text only")
    # Newline-joined, as vLLM does for text-only models, so adjacent parts don't run into each other.
    return {**message, "content": "\n".join(texts)}


def _chat_template_env() -> ImmutableSandboxedEnvironment:
    # Matches the environment HF renders chat templates in, so templates written for it render the same.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
):
    # Jinja's built-in tojson HTML-escapes (<, >, &, ') and would corrupt tool schemas in the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_template_exception(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` marks assistant text for HF's training masks; render the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _pick_default_template(value: Any) -> str | None:
    # Either one template string, or a list of named templates of which "default" is the chat one.
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, dict) and entry.get("name") == "default":
                return entry.get("template")
    return None


def _token_content(value: Any) -> str | None:
    # Special tokens are saved either as plain strings or as serialized AddedToken dicts.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_id_list(value: Any) -> list[int]:
    if _is_int(value):
        return [value]
    if isinstance(value, list):
        return [v for v in value if _is_int(v)]
    return []
