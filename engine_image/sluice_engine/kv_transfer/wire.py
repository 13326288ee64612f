"""A batch of KV blocks as they travel: a JSON header (the blocks' names and the cache layout they were computed
in) and the blocks' bytes, [blocks, layers, 2 (K and V), block_size, kv_heads, head_dim] in the cache's dtype.

Over a channel (channel.py): the header as one frame; the receiver's answer (ready, or why not); then the payload
in frames of at most CHUNK bytes; then the receiver's count of blocks taken. A
receiver takes blocks only from a sender whose layout is its own: same model, cache dtype, block size, layers,
KV heads and head dim; names mean the same tokens only then. Everything in a header is checked before a byte of
its payload is read or allocated (parse_header): known fields of known types within bounds, a dtype from a fixed
list, at most the receiver's number of blocks, and a payload size that is exactly the layout's."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .channel import Channel, ChannelError

MAX_HEADER = 256 << 10  # a header's JSON: ~21 bytes a name, so about 12,000 names
CHUNK = 1 << 20  # payload frame size
MAX_DIM = 1 << 16  # any one layout number (block size, layers, heads, head dim)
# The cache dtypes a batch may name; never an arbitrary attribute of torch.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                                  "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
_INT64 = 1 << 63


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

    def block_bytes(self) -> int:
        return math.prod(self.block_shape()) * DTYPES[self.dtype].itemsize

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
    # Called once the receiving engine has taken the batch in (or dropped it): frees its share of the receiver's
    # in-flight bytes (tcp.py).
    release: Callable[[], None] | None = None

    def header(self) -> bytes:
        return json.dumps({"layout": dataclasses.asdict(self.layout), "names": self.names,
                           "nbytes": self.data.numel() * self.data.element_size()}).encode()

    def send_payload(self, ch: Channel) -> None:
        payload = memoryview(self.data.contiguous().view(torch.uint8).reshape(-1).numpy())
        for start in range(0, len(payload), CHUNK):
            ch.send(payload[start : start + CHUNK])

    @classmethod
    def recv_payload(cls, ch: Channel, layout: KVLayout, names: list[int]) -> BlockBatch:
        """The payload that follows a header parse_header accepted."""
        dtype = DTYPES[layout.dtype]
        raw = bytearray(layout.block_bytes() * len(names))
        view = memoryview(raw)
        for start in range(0, len(raw), CHUNK):
            ch.recv_into(view[start : start + CHUNK])
        if not names:
            return cls(layout, [], torch.empty(0, *layout.block_shape(), dtype=dtype))
        data = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(len(names), *layout.block_shape())
        return cls(layout, names, data)


def parse_header(raw: bytes, max_blocks: int) -> tuple[KVLayout, list[int]]:
    """A header's layout and names, every field checked (ChannelError, reason "malformed", naming what is wrong).
    Its payload size must be exactly its blocks' at its layout."""
    try:
        head = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ChannelError("the header is not JSON", "malformed") from None
    if not isinstance(head, dict) or set(head) != {"layout", "names", "nbytes"}:
        raise ChannelError("the header needs exactly layout, names and nbytes", "malformed")
    lay, names, nbytes = head["layout"], head["names"], head["nbytes"]
    fields = [f.name for f in dataclasses.fields(KVLayout)]
    if not isinstance(lay, dict) or set(lay) != set(fields):
        raise ChannelError(f"layout needs exactly {', '.join(fields)}", "malformed")
    if not isinstance(lay["model"], str) or len(lay["model"]) > 256:
        raise ChannelError("layout.model must be a name of at most 256 characters", "malformed")
    if lay["dtype"] not in DTYPES:
        raise ChannelError(f"layout.dtype must be one of {', '.join(DTYPES)}", "malformed")
    for f in fields[2:]:
        v = lay[f]
        if type(v) is not int or not 1 <= v <= MAX_DIM:
            raise ChannelError(f"layout.{f} must be an integer in [1, {MAX_DIM}]", "malformed")
    if not isinstance(names, list) or len(names) > max_blocks:
        raise ChannelError(f"names must be a list of at most {max_blocks} block names", "malformed")
    if any(type(n) is not int or not -_INT64 <= n < _INT64 for n in names):
        raise ChannelError("names must be 64-bit integers", "malformed")
    layout = KVLayout(**lay)
    if type(nbytes) is not int or nbytes != layout.block_bytes() * len(names):
        raise ChannelError(f"nbytes is {nbytes!r}; {len(names)} blocks of this layout are "
                           f"{layout.block_bytes() * len(names)}", "malformed")
    return layout, names
