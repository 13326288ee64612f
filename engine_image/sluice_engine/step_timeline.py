"""Where a step's time goes, for benchmarks (benchmarks/async_scheduling.py): spans of the host's work
(scheduling, input preparation, applying outputs) and of the forward, from whichever thread runs them, how much
of the host's work ran while a forward was computing, and (async scheduling) how long the step thread waited for
the engine's thread: between its jobs (the next step not queued yet) and before sampling (the outputs of the step
before not applied yet). That wait is the host's work left on the step's critical path; steps run one at a
time have all of it there.

Off unless a benchmark sets one on the engine (LLMEngine.timeline): then each span costs two clock reads and a
list append (atomic under the GIL, so the step thread and the engine's thread may both record).
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, contextmanager, nullcontext

HOST_KINDS = ("schedule", "prepare", "outputs")
DEVICE_KINDS = ("forward",)


class StepTimeline:
    def __init__(self) -> None:
        self.spans: dict[str, list[tuple[float, float]]] = {
            k: [] for k in (*HOST_KINDS, *DEVICE_KINDS, "sample", "device_wait")}
        self._job_end: float | None = None

    def job_started(self) -> None:
        """The step thread starts a step: the time since its last one ended it waited for the next."""
        now = time.perf_counter()
        if self._job_end is not None:
            self.spans["device_wait"].append((self._job_end, now))

    def job_ended(self) -> None:
        self._job_end = time.perf_counter()

    @contextmanager
    def span(self, kind: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.spans[kind].append((t0, time.perf_counter()))

    def clear(self) -> None:
        for v in self.spans.values():
            v.clear()
        self._job_end = None

    def report(self, steps: int) -> dict[str, float]:
        """Per step, in ms: each kind's time, the host's work (schedule + prepare + outputs), the share of the
        host's work that ran while a forward computed, and the host's work on the critical path: with a step
        thread, the time it waited for the engine's thread (device_wait); else all of it (and the sampling)."""
        steps = max(steps, 1)
        out = {f"{k}_ms": 1e3 * sum(b - a for a, b in v) / steps for k, v in self.spans.items()}
        forward = _merged(self.spans["forward"])
        host_total = hidden = 0.0
        for k in HOST_KINDS:
            for a, b in self.spans[k]:
                host_total += b - a
                hidden += _overlap(a, b, forward)
        out["host_ms"] = 1e3 * host_total / steps
        out["hidden_share"] = hidden / host_total if host_total else 0.0
        threaded = bool(self.spans["device_wait"])
        out["critical_ms"] = out["device_wait_ms"] if threaded else out["host_ms"] + out["sample_ms"]
        return out


def span(timeline: StepTimeline | None, kind: str) -> AbstractContextManager:
    return nullcontext() if timeline is None else timeline.span(kind)


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap(a: float, b: float, merged: list[tuple[float, float]]) -> float:
    import bisect

    i = max(bisect.bisect_right(merged, (a, float("inf"))) - 1, 0)
    total = 0.0
    while i < len(merged) and merged[i][0] < b:
        lo, hi = max(a, merged[i][0]), min(b, merged[i][1])
        if hi > lo:
            total += hi - lo
        i += 1
    return total
