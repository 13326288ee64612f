"""One run: warm-up requests (not measured), then the workload against one server at one load point."""

from __future__ import annotations

import asyncio
import math
import os
import time
from dataclasses import dataclass, field

from .arrivals import arrival_times
from .client import RequestOptions, Target, fetch_model, send
from .machine import CpuMeter, is_loopback, listener_pids, server_memory_mib, with_descendants
from .metrics import RequestRecord
from .workloads import BenchRequest


@dataclass(slots=True)
class LoadPoint:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None

    def label(self) -> str:
        parts = []
        if not math.isinf(self.request_rate):
            parts.append(f"rate {self.request_rate:g}/s")
        if self.max_concurrency is not None:
            parts.append(f"concurrency {self.max_concurrency}")
        return ", ".join(parts) or "all at once"


@dataclass(slots=True)
class RunResult:
    target: str
    url: str
    model: str
    point: LoadPoint
    duration_s: float
    records: list[RequestRecord]
    peak_concurrency: int
    other_cpu_pct: float | None  # other processes' share of the machine's CPU (machine.py)
    summary: dict = field(default_factory=dict)
    # A loopback server's resident memory at the end of the run and its peak so far, MiB (machine.py).
    server_rss_mib: float | None = None
    server_peak_rss_mib: float | None = None


def _session(limit: int, opts: RequestOptions):
    import aiohttp

    # NOTE: a fresh connection per request. Reusing one after a stream ended at [DONE] races with servers
    # that close it afterwards (llama-server): the next request then fails or hangs. On loopback a
    # connection costs well under a millisecond, next to TTFTs of tens of milliseconds and up.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=opts.timeout_s), read_bufsize=2**20)


async def resolve_model(target: Target, opts: RequestOptions) -> str:
    import aiohttp

    if target.model:
        return target.model
    async with _session(1, opts) as session:
        try:
            return await fetch_model(session, target, opts)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise ValueError(f"{target.name}: cannot reach {target.url}/v1/models: {e}") from None


async def _run(target: Target, model: str, requests: list[BenchRequest], warmups: list[BenchRequest],
               point: LoadPoint, opts: RequestOptions, seed: int, progress: bool, meter: CpuMeter | None
               ) -> tuple[list[RequestRecord], float, int]:
    from tqdm import tqdm

    limit = point.max_concurrency or 0  # aiohttp: 0 = no connection limit
    async with _session(limit, opts) as session:
        if warmups:
            done = await asyncio.gather(*(send(session, target.url, model, w, opts, time.perf_counter())
                                          for w in warmups))
            bad = [r for r in done if not r.success]
            if bad:  # a server that is down or refuses the request shape: say so, not a traceback
                raise ValueError(f"{target.name}: warm-up request failed: {bad[0].error}")

        offsets = arrival_times(len(requests), point.request_rate, point.burstiness, seed)
        gate = asyncio.Semaphore(point.max_concurrency) if point.max_concurrency else None
        in_flight = peak = 0
        bar = tqdm(total=len(requests), desc=f"{target.name} [{point.label()}]", unit="req", disable=not progress,
                   dynamic_ncols=True)

        async def one(req: BenchRequest) -> RequestRecord:
            nonlocal in_flight, peak
            if gate is not None:
                await gate.acquire()
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return await send(session, target.url, model, req, opts, start)
            finally:
                in_flight -= 1
                if gate is not None:
                    gate.release()
                bar.update(1)

        if meter is not None:
            meter.start()
        start = time.perf_counter()
        tasks = []
        for req, offset in zip(requests, offsets, strict=True):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return list(records), duration, peak


def run_point(target: Target, model: str, requests: list[BenchRequest], warmups: list[BenchRequest],
              point: LoadPoint, opts: RequestOptions, seed: int = 0, progress: bool = True) -> RunResult:
    # A loopback server whose process cannot be found would count as contention: report none then.
    server_pids = with_descendants(listener_pids(target.url))  # the engine core and its ranks are the server's
    meter = CpuMeter([os.getpid(), *server_pids]) if server_pids or not is_loopback(target.url) else None
    records, duration, peak = asyncio.run(_run(target, model, requests, warmups, point, opts, seed, progress,
                                               meter))
    other = meter.other_pct() if meter is not None else None
    memory = server_memory_mib(server_pids)
    return RunResult(target.name, target.url, model, point, duration, records, peak, other,
                     server_rss_mib=memory[0] if memory else None, server_peak_rss_mib=memory[1] if memory else None)
