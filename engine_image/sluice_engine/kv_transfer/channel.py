"""One KV connection's framing and protection (docs/security.md, "KV transfer").

On accept the receiver speaks first: a hello (magic, version, its mode, a fresh 16-byte nonce); the sender answers
with a hello of its own. With a key (`--kv-secret-file`) both modes are `sealed`: every frame after the hellos is
AES-256-GCM under a key derived from the endpoint's key and both nonces (kv_transfer/keys.py), its nonce the
frame's direction and sequence number. So a peer without the key cannot make the receiver take a byte (the
header frame is authenticated before anything is allocated for the payload), cannot read blocks on the path
(they are encrypted), and cannot replay, reorder or splice frames (fresh keys per connection, counters per
direction). Without a key both modes are `plain` (the receiver then listens on loopback only: tcp.py) and frames
are the bytes themselves. A sender and a receiver whose modes differ refuse each other with a reason.

A frame is its length (4 bytes, big-endian) and its body; every read is bounded by what the reader expects next
(a header of at most MAX_HEADER bytes, a payload chunk of exactly the size still due) and by the connection's
deadline, so a peer can neither make a reader allocate nor hold it for longer than it allows.
"""

from __future__ import annotations

import os
import socket
import struct
import time

from .keys import KVKey

MAGIC = b"SLKV"
VERSION = 2
PLAIN, SEALED = 0, 1
_HELLO = struct.Struct(">4sBB16s")  # magic, version, mode, nonce
_LEN = struct.Struct(">I")
TAG = 16  # AES-GCM's tag
TO_RECEIVER, TO_SENDER = 0, 1


class ChannelError(ValueError):
    """The peer broke the protocol (or is not one of the endpoint's engines): `reason` is the metric label."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class Channel:
    """Frames over a connected socket, sealed when a key is given. `deadline`: time.monotonic() by which the
    whole exchange must be done; each read also waits at most `read_timeout`."""

    def __init__(self, sock: socket.socket, key: KVKey | None, *, sender: bool, deadline: float,
                 read_timeout: float = 30.0):
        self.sock = sock
        # A frame's length and body, and a small reply after a big payload, must not wait for delayed ACKs (Nagle's
        # algorithm held each small frame ~40 ms).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.deadline = deadline
        self.read_timeout = read_timeout
        self._key = key
        self._aead = None
        self._out_dir, self._in_dir = (TO_RECEIVER, TO_SENDER) if sender else (TO_SENDER, TO_RECEIVER)
        self._sent = self._received = 0
        self._scratch = bytearray()

    @property
    def sealed(self) -> bool:
        return self._key is not None

    # -- the hellos --------------------------------------------------------------------------------
    def accept(self) -> None:
        """The receiver's side of the hellos."""
        mine = os.urandom(16)
        self.sock.sendall(_HELLO.pack(MAGIC, VERSION, self._mode(), mine))
        theirs = self._check_mode(*self._peer_hello())
        self._start(mine + theirs)

    def connect(self) -> None:
        """The sender's side of the hellos."""
        mode, theirs = self._peer_hello()
        mine = os.urandom(16)
        # Sent even when the modes differ, so that the receiver counts (and logs) why.
        self.sock.sendall(_HELLO.pack(MAGIC, VERSION, self._mode(), mine))
        self._start(self._check_mode(mode, theirs) + mine)

    def _mode(self) -> int:
        return SEALED if self._key is not None else PLAIN

    def _peer_hello(self) -> tuple[int, bytes]:
        raw = bytearray(_HELLO.size)
        self._read_into(memoryview(raw))
        magic, version, mode, nonce = _HELLO.unpack(raw)
        if magic != MAGIC or version != VERSION:
            raise ChannelError("not a Sluice KV peer of this version", "malformed")
        return mode, nonce

    def _check_mode(self, mode: int, nonce: bytes) -> bytes:
        if mode != self._mode():
            here = "has a KV key (--kv-secret-file)" if self._key is not None else "has no KV key"
            raise ChannelError(f"the peer's KV key mode differs: this engine {here}", "unauthenticated")
        return nonce

    def _start(self, salt: bytes) -> None:
        if self._key is not None:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            self._aead = AESGCM(self._key.transfer_key(salt))

    # -- frames ------------------------------------------------------------------------------------
    def send(self, data: bytes | bytearray | memoryview) -> None:
        """One frame."""
        n = len(data)
        if self._aead is None:
            if n <= 65536:  # one write for a small frame
                self.sock.sendall(_LEN.pack(n) + bytes(data))
            else:
                self.sock.sendall(_LEN.pack(n))
                self.sock.sendall(data)
            return
        if len(self._scratch) < _LEN.size + n + TAG:
            self._scratch = bytearray(_LEN.size + n + TAG)
        frame = memoryview(self._scratch)[: _LEN.size + n + TAG]
        _LEN.pack_into(frame, 0, n + TAG)
        self._aead.encrypt_into(self._nonce(self._out_dir, self._sent), data, None, frame[_LEN.size :])
        self._sent += 1
        self.sock.sendall(frame)

    def recv(self, max_len: int) -> bytes:
        """One frame of at most `max_len` bytes (more: refused before it is read)."""
        n = self._frame_len(None, max_len)
        body = bytearray(n)
        self._read_into(memoryview(body))
        if self._aead is None:
            return bytes(body)
        return self._open(body)

    def recv_into(self, view: memoryview) -> None:
        """One frame of exactly len(view) bytes, into `view` (a payload chunk)."""
        n = self._frame_len(len(view), len(view))
        if self._aead is None:
            self._read_into(view)
            return
        if len(self._scratch) < n:
            self._scratch = bytearray(n)
        body = memoryview(self._scratch)[:n]
        self._read_into(body)
        try:
            self._aead.decrypt_into(self._nonce(self._in_dir, self._received), body, None, view)
        except Exception:  # cryptography's InvalidTag: forged, corrupted or out of order
            raise ChannelError("a frame failed authentication", "unauthenticated") from None
        self._received += 1

    def _frame_len(self, exact: int | None, max_len: int) -> int:
        raw = bytearray(_LEN.size)
        self._read_into(memoryview(raw))
        (n,) = _LEN.unpack(raw)
        overhead = TAG if self._aead is not None else 0
        if (exact is not None and n != exact + overhead) or n > max_len + overhead or n < overhead:
            raise ChannelError(f"a frame of {n} bytes where {'exactly' if exact is not None else 'at most'} "
                               f"{max_len + overhead} were due", "malformed")
        return n

    def _open(self, body: bytearray) -> bytes:
        try:
            plain = self._aead.decrypt(self._nonce(self._in_dir, self._received), bytes(body), None)
        except Exception:  # InvalidTag
            raise ChannelError("a frame failed authentication", "unauthenticated") from None
        self._received += 1
        return plain

    @staticmethod
    def _nonce(direction: int, counter: int) -> bytes:
        return bytes([direction, 0, 0, 0]) + counter.to_bytes(8, "big")

    def _read_into(self, view: memoryview) -> None:
        while len(view):
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise ChannelError("the peer was too slow (the connection's deadline passed)", "timeout")
            self.sock.settimeout(min(self.read_timeout, left))
            try:
                got = self.sock.recv_into(view)
            except TimeoutError:
                raise ChannelError("the peer sent nothing in time", "timeout") from None
            if not got:
                raise ConnectionError("the peer closed the connection mid-frame")
            view = view[got:]
