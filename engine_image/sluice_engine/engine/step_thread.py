"""The thread that queues the device's work, one step after another (async scheduling).

A step's device work (inputs, forward, sampling) runs here, in submission order, while the engine's thread
schedules the next step and applies the previous one's outputs. On a GPU the work here mostly queues kernels
and the device runs them in the same order; on a CPU this thread runs the forward itself, and torch releases the
GIL while it computes. Either way the order is the device's order: a step reads the KV cache and the sampled
tokens the steps before it wrote.

A daemon thread: an engine that dies with work queued here must not keep its process alive. It ends when its
StepThread is garbage-collected (it holds no reference to it), so an engine that is shut down may still be
stepped (tests do) and one that is dropped leaves no thread behind.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

Job = tuple[Future, Callable[..., Any], tuple] | None


class StepThread:
    def __init__(self, name: str = "sluice-step"):
        self._jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._thread = threading.Thread(target=_run, args=(self._jobs,), name=name, daemon=True)
        self._thread.start()
        weakref.finalize(self, self._jobs.put, None)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        fut: Future = Future()
        self._jobs.put((fut, fn, args))
        return fut


def _run(jobs: queue.SimpleQueue[Job]) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        fut, fn, args = job
        del job
        if not fut.set_running_or_notify_cancel():
            continue
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - the engine's thread raises it where it waits
            fut.set_exception(e)
        del fut, fn, args  # hold nothing of the engine between jobs


def wants_async_scheduling(cfg) -> bool:
    """--async-scheduling, or by default where the forward runs on a GPU. On CPU the forward is the host's own work:
    there is no device to hide the host's work behind, the two threads share the cores and the GIL, and a request
    that arrives during a step waits one step more (docs/BENCHMARKS.md#async-scheduling)."""
    if cfg.async_scheduling is not None:
        return cfg.async_scheduling
    import torch

    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
