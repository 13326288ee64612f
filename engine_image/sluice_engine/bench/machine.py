"""What else the machine was doing during a run, and the memory of the servers it measured.

On a shared box other processes' CPU skews every figure (on 2 cores, OpenMP threads that lose their core
stall each other), so each run reports the share of the machine's CPU taken by processes other than the
bench itself and the servers it measures. Servers on loopback are found by their listening port
(/proc/net/tcp*, then the process holding that socket); elsewhere the share is None (Linux only).
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from urllib.parse import urlsplit

LOOPBACK = ("127.0.0.1", "localhost", "::1", "0.0.0.0")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f[9])
    return inodes


def is_loopback(url: str) -> bool:
    return urlsplit(url).hostname in LOOPBACK


def listener_pids(url: str) -> list[int]:
    """Processes listening on the URL's port when the host is loopback; [] otherwise or when unknown."""
    if not is_loopback(url):
        return []
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    inodes = _listening_inodes(port)
    if not inodes:
        return []
    wanted = {f"socket:[{i}]" for i in inodes}
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in wanted for fd in (proc / "fd").iterdir()):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def with_descendants(pids: list[int]) -> list[int]:
    """`pids` and every process below them: a server is its listening process and what it started (sluice's
    engine-core process and its ranks), so their CPU and memory are the server's, not other load."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(proc.name))
    out, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.append(pid)
            todo.extend(children.get(pid, []))
    return out


def server_memory_mib(pids: list[int]) -> tuple[float, float] | None:
    """(resident, peak resident) memory of the processes `pids` together, in MiB: the sum of their VmRSS
    and of their VmHWM (Linux /proc; None when a process cannot be read). A server that forks workers
    is counted across the processes that hold its listening socket and their descendants (with_descendants)."""
    rss = hwm = 0
    try:
        for pid in sorted(set(pids)):
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                          if ":" in line)
            rss += int(fields["VmRSS"].split()[0])
            hwm += int(fields["VmHWM"].split()[0])
    except (OSError, KeyError, ValueError):
        return None
    return (rss / 1024, hwm / 1024) if pids else None


class CpuMeter:
    """Other processes' share of the machine's CPU between start() and other_pct(): whole-machine busy
    time (/proc/stat) minus the CPU time of `pids` (all their threads)."""

    def __init__(self, pids: list[int]):
        self.pids = sorted(set(pids))
        self.ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._t0: tuple[float, float, float] | None = None

    def _sample(self) -> tuple[float, float, float] | None:
        try:
            vals = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
            busy = vals[0] + vals[1] + vals[2] + vals[5] + vals[6]  # user nice system irq softirq
            ours = 0
            for pid in self.pids:
                f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                ours += int(f[11]) + int(f[12])  # utime stime
        except (OSError, ValueError, IndexError):
            return None
        return busy / self.ticks, ours / self.ticks, time.monotonic()

    def start(self) -> None:
        self._t0 = self._sample()

    def other_pct(self) -> float | None:
        t1 = self._sample()
        if self._t0 is None or t1 is None or t1[2] <= self._t0[2]:
            return None
        other = (t1[0] - self._t0[0]) - (t1[1] - self._t0[1])
        return max(0.0, 100 * other / ((t1[2] - self._t0[2]) * (os.cpu_count() or 1)))
