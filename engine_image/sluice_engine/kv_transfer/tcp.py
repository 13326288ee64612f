"""KV blocks over TCP: `push_blocks` (the sending engine's side: one batch per connection, answered by an
acknowledgement) and `KVReceiver` (the receiving engine's: a threaded server that reads each batch and hands it to
the engine, which takes it into its offload tier between steps).

A batch is taken whole or not at all: a sender that dies mid-batch, a header that does not parse, a layout that is
not the receiver's, or a frame that fails authentication leaves nothing behind, and the receiving engine computes
those tokens itself when their request comes (a failed transfer costs time, never a wrong token).

What a receiver spends is bounded before it is spent (docs/security.md): at most `max_connections` connections at
once (more are closed on accept, without a thread); a header of at most MAX_HEADER bytes, authenticated and
checked before the payload is allocated; at most `max_blocks` blocks a batch; payload bytes held in flight (read,
or read and not yet taken in by the engine) at most `max_inflight_bytes`; and a deadline per connection, so a peer
that trickles bytes holds nothing for long. Refusals are counted by reason (`refusals`, the metric
sluice_kv_receiver_refusals_total) and logged once per peer and reason.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import threading
import time
from collections import Counter
from collections.abc import Callable

from ..config import is_loopback
from .channel import Channel, ChannelError
from .keys import KVKey
from .wire import MAX_HEADER, BlockBatch, KVLayout, parse_header

log = logging.getLogger("sluice.engine")

MAX_REPLY = 4096
HANDSHAKE_S = 10.0  # hellos and header
MIN_RATE = 64 << 20  # bytes/s a sender must keep up on average: a batch's deadline grows with its size
REFUSAL_REASONS = ("unauthenticated", "malformed", "layout", "busy", "timeout", "disconnected")


def push_blocks(host: str, port: int, batch: BlockBatch, key: KVKey | None, timeout: float = 30.0) -> int:
    """Send a batch; returns how many of its blocks the receiver took. Raises ConnectionError (or OSError) when
    the receiver cannot be reached or closes mid-batch, ValueError when it refuses the batch (the reason) or its
    reply is not one."""
    deadline = time.monotonic() + timeout
    with socket.create_connection((host, port), timeout=timeout) as sock:
        ch = Channel(sock, key, sender=True, deadline=deadline, read_timeout=timeout)
        ch.connect()
        ch.send(batch.header())
        _reply(ch, "ready", bool)  # the receiver has checked the header and holds room for the payload
        batch.send_payload(ch)
        return _reply(ch, "taken", int)


def _reply(ch: Channel, field: str, kind: type):
    """The receiver's answer: `field` of type `kind`, or ValueError with its refusal or what is wrong with it."""
    raw = ch.recv(MAX_REPLY)
    try:
        reply = json.loads(raw)
    except ValueError:
        raise ValueError(f"the receiver's reply is not JSON: {raw[:100]!r}") from None
    if isinstance(reply, dict) and isinstance(reply.get("error"), str):
        raise ValueError(reply["error"])
    if not isinstance(reply, dict) or type(reply.get(field)) is not kind:
        raise ValueError(f"the receiver's reply has no {field}: {raw[:100]!r}")
    return reply[field]


class _Budget:
    """Bytes held in flight: taken before a payload is allocated, given back when the engine has taken it in."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.used + n > self.limit:
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n


class KVReceiver:
    """Listens on (host, port) for batches of `layout`; `on_batch(batch)` takes a received batch and returns how many
    blocks it took (it must call batch.release() once it has taken the batch in), or raises ValueError naming why
    it refuses it (sent back to the sender). `key`: None only on a loopback address. on_refusal: told after each
    refusal (the engine republishes its metrics)."""

    def __init__(self, host: str, port: int, layout: KVLayout, on_batch: Callable[[BlockBatch], int],
                 key: KVKey | None, *, max_blocks: int, max_inflight_bytes: int, max_connections: int = 16,
                 timeout: float = 30.0, on_refusal: Callable[[], None] | None = None):
        if key is None and not is_loopback(host):
            raise ValueError(f"--kv-host {host}: a KV receiver reachable from other hosts needs --kv-secret-file "
                             "(without a key it listens on loopback only)")
        self.layout, self.key, self.timeout = layout, key, timeout
        self.max_blocks = max(0, min(max_blocks, max_inflight_bytes // layout.block_bytes()))
        self._budget = _Budget(max_inflight_bytes)
        self._on_batch = on_batch
        self._on_refusal = on_refusal
        self.received = 0
        self.refusals: Counter = Counter()
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._active = 0
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                try:
                    outer._serve(self.request, self.client_address[0])
                finally:
                    with outer._lock:
                        outer._active -= 1

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

            def process_request(self, request, client_address) -> None:
                with outer._lock:
                    full = outer._active >= max_connections
                    if not full:
                        outer._active += 1
                if full:  # no thread, nothing read: closed at once
                    outer._refuse(client_address[0], "busy", f"more than {max_connections} connections at once")
                    self.shutdown_request(request)
                    return
                super().process_request(request, client_address)

        self._server = Server((host.strip("[]"), port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kv-receiver", daemon=True)
        self._thread.start()

    @property
    def inflight_bytes(self) -> int:
        return self._budget.used

    def _serve(self, sock: socket.socket, peer: str) -> None:
        ch = Channel(sock, self.key, sender=False, deadline=time.monotonic() + HANDSHAKE_S, read_timeout=self.timeout)
        taken_bytes = 0
        try:
            ch.accept()
            layout, names = parse_header(ch.recv(MAX_HEADER), self.max_blocks)
            if (why := self.layout.mismatch(layout)) is not None:
                self._refuse(peer, "layout", why)
                self._reply(ch, {"error": why})
                return
            nbytes = layout.block_bytes() * len(names)
            if not self._budget.take(nbytes):
                why = f"busy: {self._budget.used} of {self._budget.limit} in-flight bytes held; retry later"
                self._refuse(peer, "busy", why)
                self._reply(ch, {"error": why})
                return
            taken_bytes = nbytes
            self._reply(ch, {"ready": True})
            ch.deadline = time.monotonic() + self.timeout + nbytes / MIN_RATE
            batch = BlockBatch.recv_payload(ch, layout, names)
        except ChannelError as e:
            self._refuse(peer, e.reason, str(e))
            if e.reason != "unauthenticated" or not ch.sealed:  # a forger is told nothing it could use
                self._reply(ch, {"error": f"bad batch: {e}"})
            self._budget.give(taken_bytes)
            return
        except OSError as e:  # the sender died or went silent mid-batch
            self._refuse(peer, "disconnected", str(e) or type(e).__name__)
            self._budget.give(taken_bytes)
            return
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                self._budget.give(taken_bytes)

        batch.release = release
        try:
            n = self._on_batch(batch)
        except ValueError as e:
            release()
            self._refuse(peer, "layout", str(e))
            self._reply(ch, {"error": str(e)})
            return
        with self._lock:
            self.received += 1
        self._reply(ch, {"taken": n})

    def _refuse(self, peer: str, reason: str, why: str) -> None:
        with self._lock:
            self.refusals[reason] += 1
            first = (peer, reason) not in self._logged and len(self._logged) < 4096
            if first:
                self._logged.add((peer, reason))
        if self._on_refusal is not None:
            self._on_refusal()
        if first:  # once per peer and reason: a flood does not flood the log
            log.warning("KV receiver: refused a batch from %s (%s): %s; further refusals of this peer for this "
                        "reason are counted only", peer, reason, why)

    @staticmethod
    def _reply(ch: Channel, msg: dict) -> None:
        try:
            ch.send(json.dumps(msg).encode())
        except OSError:
            pass  # the sender is gone: nothing to tell

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
