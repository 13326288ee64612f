"""Issue 25's responsiveness figure: how long `GET /health` takes while the engine is busy. Today the engine
thread shares the GIL with the HTTP server (tokenization, detokenization, stop strings, response building);
an engine core in its own process should keep the HTTP loop free. This prints the "before" and will print the
"after" with the same command.

    .venv/bin/python benchmarks/health_under_load.py                       # concurrency 64, ~2 min on 2 cores
    .venv/bin/python benchmarks/health_under_load.py --concurrency 8 --requests 32

One `sluice serve` (the bundled model, default flags), `--concurrency` streaming chat requests kept in flight
(`--requests` in all, `--max-tokens` each, ignore_eos), and one prober asking `/health` every `--interval`
seconds on its own connection the whole time. Prints the probe latencies (median, p90, p99, max) idle and
under load, and the load's output tokens per second, with the CPU named.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

from server_process import Server, free_port

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a refrigerator works.",
           "List ten uses for a paperclip.", "Describe the water cycle to a child.",
           "What makes a good cup of coffee?", "Summarise the plot of a heist film you invent."]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(name: str, ms: list[float]) -> str:
    return (f"{name:<12} n={len(ms):<5} median {statistics.median(ms):7.1f} ms   p90 {_percentile(ms, 0.9):7.1f} ms"
            f"   p99 {_percentile(ms, 0.99):7.1f} ms   max {max(ms):7.1f} ms")


async def _probe(client, url: str, interval: float, stop: asyncio.Event) -> list[float]:
    out = []
    while not stop.is_set():
        t = time.perf_counter()
        r = await client.get(url + "/health", timeout=30)
        out.append((time.perf_counter() - t) * 1e3)
        assert r.status_code == 200, r.text
        await asyncio.sleep(interval)
    return out


async def _one(client, url: str, model: str, i: int, max_tokens: int) -> int:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0}
    tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                tokens += bool(json.loads(line[6:])["choices"][0]["delta"].get("content"))
    return tokens


async def _run(url: str, model: str, a: argparse.Namespace) -> None:
    import httpx

    limits = httpx.Limits(max_connections=a.concurrency + 4)
    async with httpx.AsyncClient(limits=limits) as load, httpx.AsyncClient() as prober:
        stop = asyncio.Event()
        idle_task = asyncio.create_task(_probe(prober, url, a.interval, stop))
        await asyncio.sleep(a.idle_seconds)
        stop.set()
        idle = await idle_task

        stop = asyncio.Event()
        busy_task = asyncio.create_task(_probe(prober, url, a.interval, stop))
        gate = asyncio.Semaphore(a.concurrency)

        async def bounded(i: int) -> int:
            async with gate:
                return await _one(load, url, model, i, a.max_tokens)

        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(bounded(i) for i in range(a.requests))))
        elapsed = time.perf_counter() - started
        stop.set()
        busy = await busy_task
    print(_summary("idle", idle))
    print(_summary(f"load c{a.concurrency}", busy))
    print(f"load: {a.requests} requests x {a.max_tokens} tokens, {tokens / elapsed:.1f} output tok/s, {elapsed:.1f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--interval", type=float, default=0.05, help="seconds between probes")
    p.add_argument("--idle-seconds", type=float, default=5.0)
    p.add_argument("--serve-args", default="", help="extra `sluice serve` flags, e.g. '--quantization none'")
    p.add_argument("--log", default=str(ROOT / "bench-results" / "health-under-load.log"))
    a = p.parse_args()

    from sluice_engine.bench.machine import cpu_name

    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores")
    port = free_port()
    Path(a.log).parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "sluice_engine.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--max-num-seqs", str(max(a.concurrency, 1)), "--log-level", "warning", *a.serve_args.split()]
    server = Server("sluice", cmd, dict(os.environ), Path(a.log), f"http://127.0.0.1:{port}", "/ready")
    try:
        server.wait_ready(600)
        import httpx

        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        asyncio.run(_run(server.url, model, a))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
