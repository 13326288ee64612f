"""The sampler's traffic between host and device, kept to what a step must pay for.

Up: everything the step's sampling needs from the host (per-row parameters, token histories, index
lists) goes in one copy per dtype, from pinned memory and non-blocking, so the host never waits for
the forward still queued on the device. Down: everything the host needs back (tokens, accepted
lengths, logprobs) comes in ONE copy per step, `fetch` (or `start_fetch` in the thread that queues the
step's device work, and `.result()` where the values are used).

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
    return start_fetch(parts).result()


class PendingFetch:
    """A step's device-to-host transfer under way: started by the thread that issues the step's device work,
    waited for (`result`) by the one that uses the values, so the device work queued in between is not
    waited for (async scheduling: the next step's forward is queued before this step's tokens are read)."""

    def __init__(self, parts: Sequence[DeviceResult]):
        self.parts = list(parts)
        self.groups = [p.tensors() for p in self.parts]
        tensors = [t for g in self.groups for t in g]
        self.sizes = [t.numel() for t in tensors]
        self._event = None
        self._host: torch.Tensor | None = None
        if not tensors:
            return
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
        if flat.device.type == "cuda":
            self._host = torch.empty(flat.shape, dtype=torch.float64, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = flat

    def result(self) -> list[object]:
        if self._event is not None:
            self._event.synchronize()
        flat = self._host.tolist() if self._host is not None else []
        values: list[list[float]] = []
        at = 0
        for n in self.sizes:
            values.append(flat[at : at + n])
            at += n
        results = []
        for p, g in zip(self.parts, self.groups, strict=True):
            results.append(p.read(values[: len(g)]))
            values = values[len(g) :]
        return results


def start_fetch(parts: Sequence[DeviceResult]) -> PendingFetch:
    """Start the step's one device-to-host transfer; `.result()` waits for it and reads the parts."""
    return PendingFetch(parts)
