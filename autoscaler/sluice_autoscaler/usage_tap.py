"""Reading the engine's `usage` out of an answer as it passes through, for tenants' token counts and quotas.

A non-streamed answer carries `usage` in its JSON body. A stream carries it only when the client asked
(`stream_options.include_usage`): then each chunk has `"usage": null` and one last chunk, with no choices,
has the counts. For a client that did not ask, the gateway asks for it (`wants_usage`) and takes it back out:
the `"usage": null` of each chunk and the usage chunk itself never reach that client, so what it receives is
what it asked for (clients that index `choices[0]` of every chunk would fail on the extra one).

The engine writes each SSE event whole (`data: {...}\\n\\n`) and, with include_usage, `"usage"` as the
chunk's last key (json.dumps of the dict it builds; tests/gateway/test_tenants.py checks it against the
real engine). A chunk of the network stream may still end inside an event: the tail after its last blank
line waits for the next chunk. Only events that mention usage are parsed; the rest pass as bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MAX_JSON_BYTES = 16 << 20  # a non-streamed answer kept to read its usage; larger: not read (estimated)
EVENT_END = b"\n\n"
NULL_USAGE = b', "usage": null}'
USAGE_KEY = b'"usage": {'


@dataclass(frozen=True, slots=True)
class Usage:
    prompt: int
    completion: int

    @property
    def total(self) -> int:
        return self.prompt + self.completion


def wants_usage(body: dict[str, Any]) -> bool:
    """For a streamed request without include_usage: ask the engine for it (True: the body was changed)."""
    opts = body.get("stream_options")
    if isinstance(opts, dict) and opts.get("include_usage") is True:
        return False
    body["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
    return True


def _usage(payload: Any) -> Usage | None:
    u = payload.get("usage") if isinstance(payload, dict) else None
    if not isinstance(u, dict):
        return None
    p, c = u.get("prompt_tokens"), u.get("completion_tokens", 0)
    if not isinstance(p, int) or not isinstance(c, int) or isinstance(p, bool) or isinstance(c, bool):
        return None
    return Usage(p, c)


class UsageTap:
    """One answer's bytes in, the client's bytes out; `usage` once the engine's counts went by."""

    def __init__(self, strip: bool):
        self.strip = strip  # the gateway asked for usage: take it out of what the client gets
        self.sse: bool | None = None
        self.usage: Usage | None = None
        self.events = 0  # stream chunks seen: the completion estimate when no usage comes (client gone)
        self._tail = bytearray()
        self._json = bytearray()
        self._json_over = False

    def start(self, content_type: str) -> None:
        self.sse = content_type.startswith("text/event-stream")

    def feed(self, chunk: bytes) -> bytes:
        if not self.sse:
            if not self._json_over:
                if len(self._json) + len(chunk) > MAX_JSON_BYTES:
                    self._json_over = True
                    self._json.clear()
                else:
                    self._json += chunk
            return chunk
        if self._tail:
            self._tail += chunk
            data = bytes(self._tail)
        else:
            data = chunk
        end = data.rfind(EVENT_END)
        if end < 0:
            if not self._tail:
                self._tail += chunk
            return b""
        whole, rest = data[:end + 2], data[end + 2:]
        self._tail = bytearray(rest)
        self.events += whole.count(EVENT_END)
        if USAGE_KEY in whole:
            whole = self._take_usage(whole)
        if self.strip:
            whole = whole.replace(NULL_USAGE, b"}")
        return whole

    def _take_usage(self, whole: bytes) -> bytes:
        kept = []
        for event in whole.split(EVENT_END)[:-1]:
            if USAGE_KEY in event and event.startswith(b"data: {"):
                try:
                    payload = json.loads(event[6:])
                except ValueError:
                    payload = None
                usage = _usage(payload)
                if usage is not None:
                    self.usage = usage
                    self.events -= 1
                    if self.strip and not payload.get("choices"):
                        continue  # the usage chunk the client did not ask for
            kept.append(event + EVENT_END)
        return b"".join(kept)

    def flush(self) -> bytes:
        """What is left at the end of the answer (an unterminated last event goes out as it came)."""
        rest, self._tail = bytes(self._tail), bytearray()
        if self.sse is False and not self._json_over and self._json:
            try:
                self.usage = _usage(json.loads(self._json))
            except ValueError:
                pass
            self._json.clear()
        return rest
