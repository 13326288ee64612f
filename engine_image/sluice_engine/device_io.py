"""The sampler's traffic between host and device, kept to what a step must pay for.

Up: everything the step's sampling needs from the host (per-row parameters, token histories, index
lists) goes in one copy per dtype, from pinned memory and non-blocking, so the host never waits for
the forward still queued on the device. Down: everything the host needs back (tokens, accepted
lengths, logprobs) comes in ONE blocking copy per step, `fetch`.

NOTE: a plain `torch.tensor(values, device=cuda)` or `t[python_list]` is also a copy up, and a
pageable one waits for the stream to drain: on CUDA that is as much a host sync as `.item()`. Code on
the sampling path uploads through `upload` instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


def upload(device: torch.device, ints: dict[str, Sequence[int]] | None = None,
           floats: dict[str, Sequence[float]] | None = None) -> dict[str, torch.Tensor]:
    """Named host lists as device tensors (int64 and float32), in one copy per dtype."""
    out: dict[str, torch.Tensor] = {}
    for group, dtype in ((ints, torch.int64), (floats, torch.float32)):
        if not group:
            continue
        sizes = [len(v) for v in group.values()]
        flat = [x for v in group.values() for x in v]
        dev = to_device(torch.tensor(flat, dtype=dtype), device)
        out.update(zip(group, dev.split(sizes), strict=True))
    return out


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device, copied without making the host wait."""
    if device.type == "cuda":
        # Pinned, so the copy is truly asynchronous; the caching host allocator keeps the buffer
        # until the copy has run, so it may go out of scope here.
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class DeviceResult(Protocol):
    """Part of a step's output still on the device: the tensors it needs read, and how to turn their
    values (as Python lists, flattened) into its host result."""

    def tensors(self) -> list[torch.Tensor]: ...

    def read(self, values: list[list[float]]) -> object: ...


def fetch(parts: Sequence[DeviceResult]) -> list[object]:
    """The step's one device-to-host transfer: every part's tensors packed into one float64 vector
    (exact for token ids and float32 logprobs alike), read with a single blocking copy."""
    groups = [p.tensors() for p in parts]
    tensors = [t for g in groups for t in g]
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).tolist() if tensors else []
    values: list[list[float]] = []
    at = 0
    for t in tensors:
        values.append(flat[at : at + t.numel()])
        at += t.numel()
    results = []
    for p, g in zip(parts, groups, strict=True):
        results.append(p.read(values[: len(g)]))
        values = values[len(g) :]
    return results
