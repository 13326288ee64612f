"""When the engine's step now running started: what the watchdog (`--step-timeout`) reads. Plain Python, no
torch: the API process holds one too.

In one process a float attribute does (a store is atomic for readers in other threads); across processes the
core writes it into a small shared file the API process maps (MappedStepClock), with no message per step.
"""

from __future__ import annotations

import mmap
import struct

IDLE_TICK_S = 0.5  # an idle loop (and the API's reader of the core) wakes this often
CLOCK_BYTES = 8  # one double: the monotonic start of the step now running, NaN for none


class StepClock:
    def __init__(self) -> None:
        self.started: float | None = None


class MappedStepClock(StepClock):
    """The step clock in a shared 8-byte file (mmap). One aligned 8-byte store: a reader sees the old value or
    the new one."""

    def __init__(self, path: str):
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), CLOCK_BYTES)
        self._view = memoryview(self._map).cast("d")

    @property
    def started(self) -> float | None:  # type: ignore[override]
        v = self._view[0]
        return None if v != v else v  # NaN: no step

    @started.setter
    def started(self, t: float | None) -> None:
        self._view[0] = float("nan") if t is None else t

    @staticmethod
    def create(path: str) -> None:
        with open(path, "wb") as f:
            f.write(struct.pack("d", float("nan")))
