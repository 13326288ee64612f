"""Gateway replicas tell each other their demand, so that whichever replica KEDA reaches answers for all.

KEDA dials the scaler address (the gateway's Service) and keeps that gRPC connection: every IsActive,
StreamIsActive and GetMetrics call of a ScaledObject lands on the one replica the connection went to. Each
replica holds only its own requests. So every replica serves its own counts on the peer port

    GET /peer/demand?since=<epoch>&wait=<seconds>
    -> {"replica": "<id>", "epoch": <n>, "demand": {"<endpoint key>": [held, in_flight, hold_starts]},
        "usage": {"<tenant>\t<scope>": [[second, requests, tokens], ...]}}

and follows every other replica's with a long poll: the answer comes at once when the replica's epoch is no
longer `since` (a new edge: an endpoint's activity flipped or a hold began), else after `wait` seconds with
fresh counts. `usage` is each tenant's last minute on this replica (quota.py): the others add it to their
own when they admit a tenant's request, so limits hold across replicas (at most --peer-interval late). A hold on any replica therefore reaches the replica KEDA streams from within one round trip,
and counts are never older than --peer-interval.

With --peer-token-file every replica presents the shared token (`Authorization: Bearer`) and refuses a caller
without it (401, before any work): the answers carry tenants' usage, which the quotas trust.

Peers come from discovery: `--peer URL` (static), or the EndpointSlices of the gateway's headless peers
Service (kube.py). A replica finds itself in that list by its id and skips it. A peer that stops answering
keeps its last counts for --peer-timeout seconds (a brief partition must not look like demand gone, which
would let KEDA scale in), then counts for nothing (a replica that died took its requests with it).

Owner of each peer's counts on the board: this module (DemandBoard.set_peer), one task per peer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import time
import uuid
from collections.abc import Callable, Container, Iterable
from typing import Any

import aiohttp
from aiohttp import web

from .auth import SharedToken, bearer
from .demand import DemandBoard, PeerCounts
from .quota import UsageBoard, parse_snapshot

log = logging.getLogger("sluice.gateway")

PEER_PATH = "/peer/demand"
MAX_WAIT_S = 30.0  # the longest a long poll is held open
MAX_ANSWER_BYTES = 8 << 20  # a peer's answer; beyond, it is not read (one entry per endpoint is ~100 bytes)
RETRY_MAX_S = 5.0


def replica_id() -> str:
    """Unique per process (a restarted pod is a new replica); the host name is there for logs."""
    return f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


# -- serving this replica's counts ------------------------------------------------------------------------------
def peer_app(board: DemandBoard, replica: str, usage: UsageBoard | None = None,
             token: SharedToken | None = None) -> web.Application:
    async def demand(request: web.Request) -> web.Response:
        if token is not None and token.enabled:
            presented = bearer(request.headers.get("Authorization"))
            if not presented or not token.accepts([presented]):
                log.warning("peer port: refused %s without the peer token", request.remote)
                return web.json_response({"error": "the peer token is missing or wrong (--peer-token-file)"},
                                         status=401, headers={"WWW-Authenticate": "Bearer"})
        try:
            since = int(request.query.get("since", "-1"))
            wait = float(request.query.get("wait", "0"))
            if not math.isfinite(wait):
                raise ValueError
        except ValueError:
            return web.json_response({"error": "since must be an integer and wait a number of seconds"},
                                     status=400)
        await board.wait_epoch(since, min(max(wait, 0.0), MAX_WAIT_S))
        counts = {k: [c.held, c.inflight, c.hold_starts] for k, c in board.local_counts().items()}
        answer: dict[str, Any] = {"replica": replica, "epoch": board.epoch, "demand": counts}
        if usage is not None:
            answer["usage"] = usage.local_snapshot()
        return web.json_response(answer)

    app = web.Application()
    app.router.add_get(PEER_PATH, demand)
    return app


def parse_answer(payload: Any) -> tuple[str, int, dict[str, PeerCounts]]:
    """(replica, epoch, counts) of a peer's answer; ValueError when it is not one."""
    if not isinstance(payload, dict) or not isinstance(payload.get("replica"), str) or not isinstance(
            payload.get("epoch"), int) or not isinstance(payload.get("demand"), dict):
        raise ValueError("not a peer demand answer")
    counts = {}
    for key, value in payload["demand"].items():
        if not (isinstance(value, list) and len(value) == 3 and all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value)):
            raise ValueError(f"bad counts for {key!r}")
        counts[key] = PeerCounts(*value)
    return payload["replica"], payload["epoch"], counts


# -- following the other replicas ---------------------------------------------------------------------------
class PeerSync:
    """One long-poll task per peer URL; `set_peers` follows discovery."""

    def __init__(self, board: DemandBoard, replica: str, interval: float, stale_after: float,
                 connect_timeout: float, known: Callable[[], Container[str]], usage: UsageBoard | None = None,
                 tenants: Callable[[], Iterable[str]] = tuple, token: SharedToken | None = None):
        self.board, self.replica = board, replica
        self.token = token  # presented to every peer (--peer-token-file)
        self.usage, self.tenants = usage, tenants  # tenants' windows; the tenant names this replica knows
        self.interval, self.stale_after, self.connect_timeout = interval, stale_after, connect_timeout
        self.known = known  # endpoint keys this replica serves: a peer's other keys are not kept
        self.selves: set[str] = set()  # URLs that turned out to be this replica
        self._tasks: dict[str, asyncio.Task] = {}
        self._first_pending: set[str] | None = None  # first listing's peers not yet tried once
        self.synced = asyncio.Event()  # discovery listed the peers once and each was tried once
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        if self._session:
            await self._session.close()

    @property
    def peer_urls(self) -> list[str]:
        return sorted(u for u in self._tasks if u not in self.selves)

    def set_peers(self, urls: Iterable[str]) -> None:
        wanted = {u.rstrip("/") for u in urls}
        for url in [u for u in self._tasks if u not in wanted]:
            self._tasks.pop(url).cancel()
            self.board.set_peer(url, None)
            log.info("peer %s left", url)
        loop = asyncio.get_running_loop()
        for url in sorted(wanted - self._tasks.keys()):
            self._tasks[url] = loop.create_task(self._follow(url))
        if self._first_pending is None:
            self._first_pending = set(wanted)
            self._tried(None)

    def _tried(self, url: str | None) -> None:
        if self._first_pending is None:
            return
        self._first_pending.discard(url)  # type: ignore[arg-type]
        if not self._first_pending:
            self.synced.set()

    async def _fetch(self, url: str, since: int) -> tuple[str, int, dict[str, PeerCounts], Any]:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=self.interval + self.connect_timeout + 5,
                                        sock_connect=self.connect_timeout)
        secret = self.token.value() if self.token is not None else None
        headers = {"Authorization": f"Bearer {secret}"} if secret else None
        async with self._session.get(f"{url}{PEER_PATH}", params={"since": str(since), "wait": str(self.interval)},
                                     timeout=timeout, headers=headers) as r:
            body = await r.content.read(MAX_ANSWER_BYTES + 1)
            if r.status != 200 or len(body) > MAX_ANSWER_BYTES:
                raise ValueError(f"answered {r.status} ({len(body)} bytes)")
            payload = json.loads(body)
            usage = parse_snapshot(payload.get("usage", {}), self.tenants()) if self.usage is not None else None
            return (*parse_answer(payload), usage)

    async def _follow(self, url: str) -> None:
        since, last_ok, backoff, failing = -1, None, 0.25, False
        try:
            while True:
                try:
                    replica, since, counts, usage = await self._fetch(url, since)
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
                    if not failing:
                        log.warning("peer %s: %s: %s; retrying (its last counts stay for %gs)", url,
                                    type(e).__name__, e, self.stale_after)
                    failing = True
                    if last_ok is None or time.monotonic() - last_ok > self.stale_after:
                        self.board.set_peer(url, None)
                        if self.usage is not None:
                            self.usage.set_peer(url, None)
                    self._tried(url)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, RETRY_MAX_S)
                    continue
                if replica == self.replica:
                    log.info("peer %s is this replica", url)
                    self.selves.add(url)
                    self._tried(url)
                    return
                if failing or last_ok is None:
                    log.info("peer %s (replica %s) answers", url, replica)
                known = self.known()
                self.board.set_peer(url, {k: c for k, c in counts.items() if k in known})
                if self.usage is not None:
                    self.usage.set_peer(url, usage)
                last_ok, backoff, failing = time.monotonic(), 0.25, False
                self._tried(url)
        finally:
            self.board.set_peer(url, None)
            if self.usage is not None:
                self.usage.set_peer(url, None)
