"""Measuring memory: the peak a block of work allocates (PeakMeter: CUDA's allocator counters, or on CPU the
live tensors torch ops return), a model's bytes, and the dummy step of a given shape that the target's and the
draft's profiles run (worker/memory_profile.py plans the KV cache from what they measure)."""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..core.sched_output import ScheduledRequest, SchedulerOutput


# -- the meter -----------------------------------------------------------------------------------
class PeakMeter:
    """The peak of bytes allocated inside the `with` block above the level at its start.

    CUDA: the caching allocator's counters (exact, kernels' scratch included). CPU has no such
    counters: the peak of live tensors that torch ops returned inside the block (every activation,
    logits and sampler tensor; a fused kernel's internal scratch is not seen)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = 0
        self._base = 0
        self._cpu: _LiveTensorBytes | None = None

    def __enter__(self) -> PeakMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._cpu = _LiveTensorBytes()
            self._cpu.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._cpu is None:
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            self._cpu.__exit__(*exc)
            self.peak = self._cpu.peak


class _LiveTensorBytes(TorchDispatchMode):
    """Counts the storages that ops allocate while the mode is on, until each is freed.

    An output sharing a storage with an input (a view, an in-place op) allocates nothing. A storage's
    Python object lives exactly as long as the storage (torch keeps it while C++ holds it), so a
    weak reference to it says when the memory is freed, whichever view held it last."""

    def __init__(self):
        super().__init__()
        self._live: dict[int, int] = {}  # storage address -> bytes
        self.now = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or key in inputs or key in self._live:
                continue
            self._live[key] = size
            self.now += size
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self._freed, key)
        return out

    def _freed(self, key: int) -> None:
        self.now -= self._live.pop(key, 0)


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers (tied tensors once)."""
    storages = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


# -- the dummy step ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DummyStep:
    sched: SchedulerOutput
    num_blocks: int  # of the scratch cache its block tables point into


def dummy_step(num_tokens: int, num_seqs: int, block_size: int, max_seq_len: int, *, every_row: bool) -> DummyStep:
    """`num_tokens` new tokens from position 0, spread evenly over `num_seqs` sequences of at most
    `max_seq_len` tokens (the scheduler fills no more). Every block table is the same few blocks: the
    scratch cache holds garbage, only the shapes matter.
    every_row: logits for every row (prompt logprobs); else for the last row of each sequence."""
    num_seqs = max(1, min(num_seqs, num_tokens))
    num_tokens = min(num_tokens, num_seqs * max_seq_len)
    base, extra = divmod(num_tokens, num_seqs)
    blocks = list(range(-(-(base + (extra > 0)) // block_size)))
    scheduled = [ScheduledRequest(f"memory-profile-{i}", [0] * (base + (i < extra)), 0, blocks,
                                  prompt_logprobs=every_row) for i in range(num_seqs)]
    return DummyStep(SchedulerOutput(scheduled), len(blocks))
