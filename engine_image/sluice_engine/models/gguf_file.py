"""A GGUF file's metadata and tensors, read in tens of milliseconds: its header parsed by hand and its tensor
data memory-mapped. gguf-py's GGUFReader takes ~3 s on the bundled model, nearly all of it building a numpy
view per element of the tokenizer's 49k-entry string arrays, which loading weights never reads: here string
arrays are stepped over (their values come back as None) and numeric arrays are one frombuffer each.

The format (GGUF v2/v3, little-endian): magic "GGUF", version u32, tensor count u64, metadata count u64; the
metadata as (key, value type u32, value); then per tensor its name, dimension count u32, dimensions u64
(innermost first), ggml type u32 and data offset u64; the data section starts at the next multiple of
`general.alignment` (32 when absent).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

# metadata value type -> (struct format, numpy dtype) for the fixed-size ones
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9

# ggml type -> (name, elements per block, bytes per block) for the types the engine reads itself; others are
# looked up in gguf-py's table (imported only then)
_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34),
          30: ("BF16", 1, 2)}
_PLAIN_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


@dataclass(frozen=True, slots=True)
class GgufTensor:
    name: str
    type_name: str  # F32, Q4_1, Q8_0, ...
    type_id: int  # the ggml type number
    shape: tuple[int, ...]  # GGUF order: innermost (columns) first
    data: np.ndarray  # float types: [rows, cols] of their dtype (BF16 as uint16); block types: [rows, row bytes] uint8

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))


class GgufFile:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        buf = memoryview(self._map)
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"{self.path}: not a GGUF file (magic {bytes(buf[:4])!r})")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 and 3 are)")
        self.version = version
        pos = 24
        self.fields: dict[str, object] = {}
        for _ in range(n_kv):
            key, pos = _string(buf, pos)
            (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            self.fields[key], pos = _value(buf, pos, vtype)
        infos = []
        for _ in range(n_tensors):
            name, pos = _string(buf, pos)
            (n_dims,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos)
            pos += 8 * n_dims
            type_id, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            infos.append((name, tuple(int(d) for d in dims), type_id, offset))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-pos // align) * align
        self.tensors: dict[str, GgufTensor] = {}
        for name, dims, type_id, offset in infos:
            type_name, block, size = _type(type_id)
            cols = dims[0] if dims else 1
            rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
            if cols % block:
                raise ValueError(f"{self.path}: tensor {name} has rows of {cols} values, not whole {type_name} blocks")
            row_bytes = cols // block * size
            raw = self._map[start + offset : start + offset + rows * row_bytes]
            if raw.size != rows * row_bytes:
                raise ValueError(f"{self.path}: tensor {name} runs past the end of the file (truncated?)")
            data = raw.reshape(rows, row_bytes)
            if type_name in _PLAIN_DTYPES:
                data = data.view(_PLAIN_DTYPES[type_name])
            self.tensors[name] = GgufTensor(name, type_name, type_id, dims, data)

    def field(self, key: str, default=None):
        return self.fields.get(key, default)


@lru_cache(maxsize=4)
def open_gguf(path: Path) -> GgufFile:
    """One parsed file per path (the loader reads the blocks and the dense tensors of the same file)."""
    return GgufFile(Path(path))


def _type(type_id: int) -> tuple[str, int, int]:
    if type_id in _TYPES:
        return _TYPES[type_id]
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    t = GGMLQuantizationType(type_id)
    block, size = GGML_QUANT_SIZES[t]
    return t.name, block, size


def _string(buf: memoryview, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", errors="replace"), pos + 8 + n


def _value(buf: memoryview, pos: int, vtype: int):
    if vtype in _SCALARS:
        fmt, _ = _SCALARS[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if vtype == _STRING:
        return _string(buf, pos)
    if vtype == _ARRAY:
        etype, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if etype in _SCALARS:
            dtype = np.dtype(_SCALARS[etype][1]).newbyteorder("<")
            return np.frombuffer(buf, dtype=dtype, count=count, offset=pos).copy(), pos + count * dtype.itemsize
        if etype == _STRING:  # stepped over: the tokenizer's vocabulary and merges (model_fetch reads them)
            for _ in range(count):
                (n,) = struct.unpack_from("<Q", buf, pos)
                pos += 8 + n
            return None, pos
        items = []
        for _ in range(count):
            item, pos = _value(buf, pos, etype)
            items.append(item)
        return items, pos
    raise ValueError(f"unknown GGUF metadata value type {vtype}")
