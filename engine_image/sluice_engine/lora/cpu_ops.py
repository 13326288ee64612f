"""LoRA's low-rank delta through the C++ CPU kernel (cpu_kernels/lora.cpp): one call per LoRA layer for all of a
step's adapter tokens, whatever their runs and slots, instead of the torch path's several ops per projection and
slot group (lora/ops.py), whose dispatch dominated the CPU's steps.

The kernel takes the tokens sorted by slot (`rows_by_slot`, set by the model runner as `LoRASegments.by_slot`),
A as the layer keeps it ([slots, projections x rank, in]) and each projection's B transposed ([slots, rank, out]:
the layer keeps that copy on CPU, `LoRALinear.bt`), and adds into the base layer's output in place. fp32 only: the
runner sets `by_slot` only for an fp32 model on CPU with the kernels built, else the torch path runs."""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from .ops import rows_per_slot


@functools.cache
def cpu_kernel():
    """sluice_lora_f32 from the CPU kernels' library, or None where they are not built (the torch path runs)."""
    from ..cpu_kernels import load

    lib = load()
    return None if lib is None else lib.sluice_lora_f32


# Below this many multiply-adds a call runs on one thread when the OpenMP threads sleep between parallel regions
# (OMP_WAIT_POLICY=passive, the setting for shared or CPU-quota'd nodes): waking them costs ~100 us, what one
# thread takes for ~2M multiply-adds here (a decode step's fused QKV at rank 16 on 32 tokens is 1.4M). With
# spinning threads (libgomp's default) the fork costs a few us and the kernel's own threshold applies.
PASSIVE_SERIAL_MACS = 4_000_000


@functools.cache
def _threads_sleep() -> bool:
    return os.environ.get("OMP_WAIT_POLICY", "").strip().lower() == "passive"


def rows_by_slot(num_tokens: list[int], slots: list[int]) -> tuple[list[int], list[int]]:
    """The step's adapter tokens (rows of the batch) sorted by slot, and each one's slot; the base's left out. Per
    request in batch order, its token count and slot (0 = the base)."""
    by = rows_per_slot(num_tokens, slots)
    rows = [r for slot in sorted(by) for r in by[slot]]
    return rows, [slot for slot in sorted(by) for _ in by[slot]]


class LayerArgs:
    """A LoRA layer's fixed arguments to the kernel (its B pointers, widths and offsets), built once: the slot
    buffers are allocated with the layer and only written in place."""

    def __init__(self, a: torch.Tensor, bt: list[torch.Tensor], slices: list[tuple[str, int, int]]):
        n = len(bt)
        self.a = a
        self.bt = bt  # kept alive with the pointers to them
        self.pointers = (ctypes.c_void_p * n)(*(b.data_ptr() for b in bt))
        self.outs = (ctypes.c_int * n)(*(w for _, _, w in slices))
        self.offsets = (ctypes.c_int * n)(*(off for _, off, _ in slices))
        self.width = sum(w for _, _, w in slices)


def lora_cpu_(args: LayerArgs, x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
              rank: int, kernel=None, threads=None) -> None:
    """y[t, offset_j:offset_j + out_j] += B_j[slot(t)] A_j[slot(t)] x[t] for the tokens in `rows`, in place.
    x [T, in] and y [T, width] fp32 with unit column stride; rows/slots int64, contiguous. `kernel`: a given
    library's sluice_lora_f32 (tests run each ISA's), else this CPU's."""
    a = args.a
    if threads is None:
        threads = torch.get_num_threads()
        if threads > 1 and _threads_sleep():
            macs = rows.shape[0] * rank * (len(args.bt) * x.shape[1] + args.width)
            threads = 1 if macs < PASSIVE_SERIAL_MACS else threads
    (kernel or cpu_kernel())(x.data_ptr(), x.stride(0), x.shape[1], a.data_ptr(), len(args.bt), rank, args.pointers,
                 args.outs, args.offsets, rows.data_ptr(), slots.data_ptr(), rows.shape[0], y.data_ptr(), y.stride(0),
                 threads)
