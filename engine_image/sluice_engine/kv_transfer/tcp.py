"""KV blocks over TCP: `push_blocks` (the sending engine's side: one batch per connection, answered by an
acknowledgement) and `KVReceiver` (the receiving engine's: a threaded server that reads each batch and hands it to
the engine, which takes it into its offload tier between steps).

A batch is taken whole or not at all: a sender that dies mid-batch, a header that does not parse, or a layout
that is not the receiver's leaves nothing behind, and the receiving engine computes those tokens itself when
their request comes (a failed transfer costs time, never a wrong token). Every read has a timeout, so a sender
that stalls never holds a receiver thread for ever."""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import struct
import threading
from collections.abc import Callable

from .wire import BlockBatch

log = logging.getLogger("sluice.engine")


def push_blocks(host: str, port: int, batch: BlockBatch, timeout: float = 30.0) -> int:
    """Send a batch; returns how many of its blocks the receiver took. Raises ConnectionError (or OSError) when
    the receiver cannot be reached or closes mid-batch, ValueError when it refuses the batch (the reason)."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        batch.send(sock)
        (n,) = struct.unpack(">I", _recv_exact(sock, 4))
        reply = json.loads(_recv_exact(sock, n))
    if "error" in reply:
        raise ValueError(reply["error"])
    return int(reply["taken"])


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise ConnectionError("the receiver closed the connection before its reply")
        buf += got
    return buf


class KVReceiver:
    """Listens on (host, port); `on_batch(batch)` takes a received batch and returns how many blocks it took, or
    raises ValueError naming why it refuses it (sent back to the sender)."""

    def __init__(self, host: str, port: int, on_batch: Callable[[BlockBatch], int], timeout: float = 30.0):
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                self.request.settimeout(timeout)
                try:
                    batch = BlockBatch.recv(self.request)
                except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
                    outer.failed += 1
                    log.warning("KV receiver: a batch from %s dropped: %s", self.client_address[0], e)
                    self._reply({"error": f"bad batch: {e}"})
                    return
                try:
                    taken = on_batch(batch)
                except ValueError as e:
                    outer.refused += 1
                    self._reply({"error": str(e)})
                    return
                outer.received += 1
                self._reply({"taken": taken})

            def _reply(self, msg: dict) -> None:
                body = json.dumps(msg).encode()
                try:
                    self.request.sendall(struct.pack(">I", len(body)) + body)
                except OSError:
                    pass  # the sender is gone: nothing to tell

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.received = self.refused = self.failed = 0
        self._server = Server((host, port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kv-receiver", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
