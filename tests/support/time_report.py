"""Where CI's time goes, file by file: a pytest plugin (loaded from tests/conftest.py) that sums each test file's
wall time (setup, call and teardown of its tests) and the whole machine's busy share while that file ran, from
/proc/stat, and prints the files that took longest at the end of the run.

Why: CI has 90 minutes on 2 cores and the suite takes most of them. `--durations` names single tests; which
files cost the most, and whether the machine was busy or waiting meanwhile (a file that waits on timers could
run beside another; one that keeps both cores busy could not), is what decides where to cut or what to run
side by side. Reading /proc/stat costs microseconds; where it is not there (not Linux) the busy column is empty.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest

SHOWN = 40


def cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies of the whole machine since boot; None where /proc/stat is not there."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total


@dataclass
class FileTime:
    seconds: float = 0.0
    tests: int = 0
    busy: int = 0
    total: int = 0


class TimeReport:
    def __init__(self) -> None:
        self.files: dict[str, FileTime] = {}
        self.started = time.monotonic()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        before, t0 = cpu_jiffies(), time.monotonic()
        yield
        after, t1 = cpu_jiffies(), time.monotonic()
        f = self.files.setdefault(item.location[0], FileTime())
        f.seconds += t1 - t0
        f.tests += 1
        if before and after:
            f.busy += after[0] - before[0]
            f.total += after[1] - before[1]

    @pytest.hookimpl(trylast=True)  # after --durations, so both show at the end of a CI log
    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.files:
            return
        tr = terminalreporter
        ran = sum(f.seconds for f in self.files.values())
        busy = sum(f.busy for f in self.files.values())
        total = sum(f.total for f in self.files.values())
        share = f", machine busy {100 * busy / total:.0f}%" if total else ""
        tr.write_sep("=", f"slowest {SHOWN} test files ({ran:.0f} s in tests of {time.monotonic() - self.started:.0f} s"
                          f"{share})")
        for name, f in sorted(self.files.items(), key=lambda kv: -kv[1].seconds)[:SHOWN]:
            busy_pct = f"{100 * f.busy / f.total:5.0f}%" if f.total else "     -"
            tr.write_line(f"{f.seconds:8.1f}s {busy_pct} busy {f.tests:4d} tests  {name}")

