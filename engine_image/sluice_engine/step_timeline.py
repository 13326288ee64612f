"""Where a step's time goes, for benchmarks (benchmarks/async_scheduling.py): spans of the host's work
(scheduling, input preparation, applying outputs) and of the forward, from whichever thread runs them, and how
much of the host's work ran while a forward was computing (hidden behind it, with async scheduling).

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
        self.spans: dict[str, list[tuple[float, float]]] = {k: [] for k in (*HOST_KINDS, *DEVICE_KINDS, "sample")}

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

    def report(self, steps: int) -> dict[str, float]:
        """Per step, in ms: each kind's time, the host's work (schedule + prepare + outputs), and the share of
        the host's work that ran while a forward computed."""
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
