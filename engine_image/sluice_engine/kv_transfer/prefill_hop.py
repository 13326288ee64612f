"""A decode engine's first hop (`sluice serve --kv-role decode --prefill-url URL`): before a request runs here, its
prompts are sent to a prefill engine, which computes them and pushes their KV blocks to this engine's receiver
(kv_transfer_params.push_to), then answers; the request then runs here with those blocks as prefix hits, so a
long prompt's prefill never stalls this engine's decodes. llm-d does the same in a routing sidecar of the decode
pod; here it is part of the server, so the operator renders one container and clients (or the gateway) talk to
the decode Service only.

What goes over is the prompts' token ids (the completions API takes them), not the client's body: a chat request is
rendered once, here, so both engines see the same tokens whatever their templates. The prefill engine's token is
thrown away: this engine recomputes the prompt's last (partial) block and samples every token itself, so a
request's outputs are the same with or without the hop.

The hop proves to the prefill engine that `push_to` is this endpoint's own receiver with a token made with the
endpoint's KV key (keys.py; a prefill engine refuses push_to without one, so no client can make it connect
anywhere), and sends this engine's API key (both pools run one spec, so they share it). The prefill engine's answer
is read up to MAX_ANSWER bytes: it is one token.

Failure never costs the request: a prefill engine that is down, slow past the timeout, or answers an error only
means this engine computes the prompt itself (counted, logged). Prompts shorter than `min_prompt_tokens` skip the
hop: their prefill is cheaper here than a round trip.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import TYPE_CHECKING

from .keys import KVKey

if TYPE_CHECKING:
    import aiohttp

log = logging.getLogger("sluice.kv_transfer")

OUTCOMES = ("ok", "failed", "skipped")
MAX_ANSWER = 64 << 10  # a one-token completion (several prompts: one choice each) is far smaller


class PrefillHop:
    def __init__(self, url: str, push_to: str, model: str, key: KVKey, *, api_key: str | None = None,
                 block_size: int, min_prompt_tokens: int, timeout: float):
        """url: the prefill engines' OpenAI base URL (their Service), with or without /v1. push_to: this engine's
        KV receiver as the prefill engines reach it (host:port). model: the served name both pools share. key: the
        endpoint's KV key; api_key: the one both pools' APIs take."""
        base = url.rstrip("/")
        self.url = (base if base.endswith("/v1") else base + "/v1") + "/completions"
        self.push_to = push_to
        self.key = key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model
        # A prompt shorter than one full block plus its last token has nothing the decode engine could reuse.
        self.min_tokens = max(min_prompt_tokens, block_size + 1)
        self.timeout = timeout
        self.counts: Counter = Counter()  # hops by outcome: ok, failed, skipped (sluice_kv_prefill_hops_total)
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        # Imported here: only a decode engine with --prefill-url needs it (the GPU node's image has no aiohttp
        # wheel for engines that never hop: tests/engine/test_gpu_wheels.py).
        import aiohttp

        if self._session is None or self._session.closed:  # made in the server's loop, on first use
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        return self._session

    async def run(self, prompts: list[list[int]]) -> bool:
        """Prefill `prompts` on a prefill engine, their blocks pushed here. True when the prefill engine answered
        (its push has then ended: acked, or failed and counted there); False when this engine computes them."""
        long = [ids for ids in prompts if len(ids) >= self.min_tokens]
        if not long:
            self.counts["skipped"] += 1
            return False
        body = {"model": self.model, "prompt": long if len(long) > 1 else long[0], "max_tokens": 1,
                "temperature": 0, "kv_transfer_params": {"push_to": self.push_to,
                                                         "hop_token": self.key.hop_token(self.push_to)}}
        try:
            async with self._client().post(self.url, json=body, headers=self.headers) as resp:
                answer = await _read_at_most(resp, MAX_ANSWER + 1)  # bounded: never all of a hostile answer
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {answer[:300].decode(errors='replace')}")
                if len(answer) > MAX_ANSWER:
                    raise RuntimeError(f"an answer of more than {MAX_ANSWER} bytes")
        except asyncio.CancelledError:  # the client left: not the prefill engine's failure
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the hop means: compute here
            self.counts["failed"] += 1
            log.warning("prefill hop to %s failed (%s); computing the prompt here", self.url,
                        " ".join(str(e).split()) or type(e).__name__)
            return False
        self.counts["ok"] += 1
        return True

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


async def _read_at_most(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The response's body up to `limit` bytes."""
    out = bytearray()
    while len(out) < limit:
        chunk = await resp.content.read(limit - len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)
