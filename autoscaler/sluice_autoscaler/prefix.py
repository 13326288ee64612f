"""The routing key of a request: the leading characters of its prompt.

The gateway has no tokenizer; it only needs text whose shared beginnings match what the engine's prefix
cache shares. For chat, that is the messages rendered in order (role, then content), so every turn of a
conversation, and every request behind one system prompt, starts with the same key as long as the key is
shorter than what they share.

A request for a LoRA adapter has the adapter's name in front of its key: the engine never shares KV blocks
between adapters, or between an adapter and the base model (the same prompt is other KV under each), so the
same prompt under another adapter is another key.
"""

from __future__ import annotations

from typing import Any


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def render_messages(messages: list[Any], limit: int) -> str:
    out: list[str] = []
    size = 0
    for m in messages:
        if not isinstance(m, dict):
            continue
        part = f"<{m.get('role', '')}>{_content_text(m.get('content'))}\n"
        out.append(part)
        size += len(part)
        if size >= limit:
            break
    return "".join(out)


def routing_key(body: dict[str, Any], chars: int, adapter: str | None = None) -> str | None:
    """The first `chars` characters of the prompt, or None when the request has none; for a LoRA adapter's
    request, behind the adapter's name."""
    text = ""
    messages = body.get("messages")
    prompt = body.get("prompt")
    if isinstance(messages, list):
        text = render_messages(messages, chars)
    elif isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):  # a batch of prompts: route by the first
            text = first
        elif isinstance(first, int):  # token ids
            text = " ".join(str(t) for t in prompt[:chars])
        elif isinstance(first, list):  # a batch of token-id prompts
            text = " ".join(str(t) for t in first[:chars])
    text = text[:chars]
    if not text:
        return None
    # NUL ends the name (adapter names hold none): `a` + `b...` is not `ab` + `...`. A key only picks a backend,
    # so a prompt that happens to look like another adapter's key costs a cache miss at most.
    return f"{adapter}\0{text}" if adapter else text
