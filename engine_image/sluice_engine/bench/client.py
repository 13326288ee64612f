"""One streaming OpenAI request (aiohttp, a runtime dependency) and what the client saw of it.

A chunk counts as output when it carries text (completions `text`, chat `delta.content`), or carries an
empty string that is neither the chat role preamble nor the finishing chunk: a token whose characters are
not complete yet (some servers send those). Output tokens come from the final usage chunk
(`stream_options.include_usage`); a server that sends no usage gets its output chunks counted instead.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from .metrics import RequestRecord
from .workloads import BenchRequest

ENDPOINT_TYPES = ("completions", "chat")


@dataclass(slots=True)
class Target:
    name: str
    url: str  # base URL without /v1
    model: str | None = None  # the served model name; None: the first of GET /v1/models


def parse_target(text: str) -> Target:
    """`URL` or `NAME=URL`; the name defaults to host:port."""
    name, sep, url = text.partition("=")
    if not sep or "://" in name:
        name, url = "", text
    url = url.rstrip("/").removesuffix("/v1")
    if "://" not in url:
        raise ValueError(f"not a URL: {text!r} (want http://host:port or NAME=http://host:port)")
    return Target(name or url.split("://", 1)[1], url)


@dataclass(slots=True)
class RequestOptions:
    endpoint_type: str = "completions"
    temperature: float = 0.0
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    timeout_s: float = 3600.0

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def request_body(model: str, req: BenchRequest, opts: RequestOptions) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "temperature": opts.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if opts.ignore_eos:
        body["ignore_eos"] = True  # a vLLM extra; servers without it generate until EOS (see short_outputs)
    if opts.endpoint_type == "chat":
        body["messages"] = req.messages or [{"role": "user", "content": req.prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = req.prompt
        path = "/v1/completions"
    return path, body | opts.extra_body


async def fetch_model(session, target: Target, opts: RequestOptions) -> str:
    """The first model the server lists (GET /v1/models)."""
    async with session.get(f"{target.url}/v1/models", headers=opts.headers()) as resp:
        if resp.status != 200:
            raise ValueError(f"{target.url}/v1/models: HTTP {resp.status}: {(await resp.text())[:300]}")
        data = (await resp.json()).get("data") or []
    if not data:
        raise ValueError(f"{target.url}/v1/models lists no model; pass --model")
    return data[0]["id"]


def _chunk_output(choice: dict[str, Any], chat: bool) -> str | None:
    """The output text a stream choice carries, or None when it carries no output token."""
    if chat:
        delta = choice.get("delta") or {}
        text = delta.get("content")
        if text is None:
            text = delta.get("reasoning_content")
        preamble = "role" in delta
    else:
        text = choice.get("text")
        preamble = False
    if text is None:
        return None
    if text == "" and (preamble or choice.get("finish_reason") is not None):
        return None
    return text


async def send(session, url: str, model: str, req: BenchRequest, opts: RequestOptions,
               run_start: float) -> RequestRecord:
    path, body = request_body(model, req, opts)
    rec = RequestRecord(req.index, req.max_tokens, req.prompt_len)
    chat = opts.endpoint_type == "chat"
    texts: list[str] = []
    usage: dict[str, Any] | None = None
    chunks = 0
    last = start = time.perf_counter()
    rec.send_s = start - run_start
    try:
        async with session.post(f"{url}{path}", json=body, headers=opts.headers()) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return rec
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators, SSE comments (keep-alives)
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    rec.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"[:200]
                    return rec
                now = time.perf_counter()
                for choice in chunk.get("choices") or []:
                    text = _chunk_output(choice, chat)
                    if text is None:
                        continue
                    if chunks == 0:
                        rec.ttft_s = now - start
                    else:
                        rec.itl_s.append(now - last)
                    last = now
                    chunks += 1
                    texts.append(text)
                if chunk.get("usage"):
                    usage = chunk["usage"]
        rec.e2el_s = time.perf_counter() - start
    except Exception as e:  # connection refused or reset, timeout, bad JSON: a failed request, not a crash
        rec.error = f"{type(e).__name__}: {e}"[:200]
        return rec
    rec.output_text = "".join(texts)
    if usage and usage.get("completion_tokens") is not None:
        rec.output_tokens = int(usage["completion_tokens"])
        if usage.get("prompt_tokens"):
            rec.prompt_tokens = int(usage["prompt_tokens"])
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            rec.cached_tokens = int(details["cached_tokens"])
    else:
        rec.output_tokens, rec.output_tokens_from = chunks, "chunks"
    if chunks == 0 or rec.output_tokens == 0:
        rec.error = "no output tokens in the stream"
        return rec
    rec.success = True
    return rec
