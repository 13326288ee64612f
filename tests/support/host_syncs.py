"""Counting the host's reads of tensor values: each one is a device-to-host sync on a GPU.

CPU tests have no device to wait for, so this counts what WOULD block on CUDA, the same way on both:
- at the dispatcher: ops whose result the host needs before it can go on (`_local_scalar_dense`,
  behind .item(), bool(t), int(t), float(t) and a tensor used as a Python index; ops with
  data-dependent output shapes: nonzero, masked_select, boolean-mask indexing, unique, ...), and
  copies from a non-CPU device to the CPU;
- at the Python level: .tolist(), .numpy(), .cpu() (on a CPU tensor these dispatch nothing, so the
  dispatcher alone would miss them on CPU and see them on CUDA).
A nested count (.tolist() of a CUDA tensor also dispatches its copy) counts once.

On CUDA it also counts blocking uploads (a host-to-device copy without non_blocking from pageable
memory waits for the stream too); on CPU those are invisible.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops that make the host wait for the device: a scalar read, or an output whose size depends on values.
SYNC_OPS = {
    aten._local_scalar_dense,
    aten.nonzero,
    aten.nonzero_static,
    aten.masked_select,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.equal,
}
HOST_READS = ("tolist", "numpy", "cpu")


@dataclass
class SyncLog:
    syncs: list[str] = field(default_factory=list)  # what forced each host read, in order
    blocking_uploads: list[str] = field(default_factory=list)  # CUDA only


def _mask_indexing(packet, args) -> bool:
    """t[mask] and t[mask] = v: the boolean index becomes positions (a nonzero) inside the op, below
    where a dispatch mode sees it."""
    if packet not in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


class _Mode(TorchDispatchMode):
    def __init__(self, log: SyncLog, depth: list[int]):
        super().__init__()
        self.log = log
        self.depth = depth  # > 0 while inside a counted Python-level read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.depth[0]:
            packet = func._overloadpacket
            if packet in SYNC_OPS or _mask_indexing(packet, args) or (
                    packet is aten.repeat_interleave and kwargs.get("output_size") is None
                    and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu"):
                self.log.syncs.append(str(func))
            elif packet in (aten._to_copy, aten.copy_):
                src = args[1] if packet is aten.copy_ else args[0]
                dst = args[0].device if packet is aten.copy_ else kwargs.get("device", src.device)
                if isinstance(src, torch.Tensor) and dst is not None:
                    dst = torch.device(dst)
                    if src.device.type != "cpu" and dst.type == "cpu":
                        self.log.syncs.append(f"{func} {src.device}->cpu")
                    elif (src.device.type == "cpu" and dst.type != "cpu" and not src.is_pinned()
                          and not kwargs.get("non_blocking", packet is aten.copy_ and len(args) > 2 and args[2])):
                        self.log.blocking_uploads.append(f"{func} cpu->{dst}")
        return func(*args, **kwargs)


@contextmanager
def count_host_syncs() -> Iterator[SyncLog]:
    log = SyncLog()
    depth = [0]
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            if not depth[0]:
                log.syncs.append(f"Tensor.{name}")
            depth[0] += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                depth[0] -= 1

        return read

    for name in HOST_READS:
        setattr(torch.Tensor, name, counted(name))
    try:
        with _Mode(log, depth):
            yield log
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
