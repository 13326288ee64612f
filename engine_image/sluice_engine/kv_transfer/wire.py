"""A batch of KV blocks as they travel: a JSON header (the blocks' names and the cache layout they were computed
in) and the blocks' bytes, [blocks, layers, 2 (K and V), block_size, kv_heads, head_dim] in the cache's dtype.

On a socket: the header's length (8 bytes, big-endian), the header, then the payload (its length in the header).
A receiver takes blocks only from a sender whose layout is its own: same model, cache dtype, block size, layers,
KV heads and head dim; names mean the same tokens only then."""

from __future__ import annotations

import dataclasses
import json
import socket
import struct
from dataclasses import dataclass

import torch

MAX_HEADER = 16 << 20


@dataclass(frozen=True, slots=True)
class KVLayout:
    model: str  # the served model's name
    dtype: str  # the cache's element type, e.g. float32, float16
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def mismatch(self, other: KVLayout) -> str | None:
        """What differs from `other` (a message naming the field), or None."""
        for field in ("model", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim"):
            a, b = getattr(self, field), getattr(other, field)
            if a != b:
                return f"KV layout mismatch: {field} is {a!r} here, {b!r} in the blocks sent"
        return None


@dataclass(slots=True)
class BlockBatch:
    layout: KVLayout
    names: list[int]
    data: torch.Tensor  # [len(names), *layout.block_shape()], contiguous, on the host

    def send(self, sock: socket.socket) -> None:
        payload = memoryview(self.data.contiguous().view(torch.uint8).reshape(-1).numpy())
        header = json.dumps({"layout": dataclasses.asdict(self.layout), "names": self.names,
                             "nbytes": len(payload)}).encode()
        sock.sendall(struct.pack(">Q", len(header)) + header)
        sock.sendall(payload)

    @classmethod
    def recv(cls, sock: socket.socket) -> BlockBatch:
        (n,) = struct.unpack(">Q", _read(sock, 8))
        if n > MAX_HEADER:
            raise ValueError(f"KV batch header of {n} bytes (at most {MAX_HEADER})")
        head = json.loads(_read(sock, n))
        layout = KVLayout(**head["layout"])
        names = [int(x) for x in head["names"]]
        dtype = getattr(torch, layout.dtype)
        per_block = torch.Size(layout.block_shape()).numel() * dtype.itemsize
        if head["nbytes"] != per_block * len(names):
            raise ValueError(f"KV batch of {head['nbytes']} bytes for {len(names)} blocks of {per_block}")
        if not names:
            return cls(layout, [], torch.empty(0, *layout.block_shape(), dtype=dtype))
        raw = bytearray(head["nbytes"])
        _read_into(sock, memoryview(raw))
        data = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(len(names), *layout.block_shape())
        return cls(layout, names, data)


def _read(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _read_into(sock, memoryview(buf))
    return bytes(buf)


def _read_into(sock: socket.socket, view: memoryview) -> None:
    while len(view):
        got = sock.recv_into(view)
        if not got:
            raise ConnectionError("the sender closed the connection mid-batch")
        view = view[got:]
