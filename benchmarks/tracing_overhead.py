"""Issue 42's tracing check, side by side in one sitting: the engine with tracing off (the default) against the
same engine with --otlp-traces-endpoint at sample ratio 1.0 (every request traced and exported to an OTLP/HTTP
collector on 127.0.0.1: tests/support/otlp_collector.py), under the same load, in alternating rounds.

Workload (fixed): completions of fixed prompts (seed 0), max_tokens 32 with ignore_eos (every request makes 32
tokens), each request with a sampled W3C traceparent (as the gateway sends), at concurrency 8; a round is
--num-requests requests. Reported: each variant's median output tokens/s over the rounds, and on/off.

    .venv/bin/python benchmarks/tracing_overhead.py                # ~2 min on 2 cores
    .venv/bin/python benchmarks/tracing_overhead.py --rounds 6 --num-requests 32

Both servers stay up for the whole sitting (the idle one waits while the other is measured); they get the same
threads (OMP_NUM_THREADS, default the machine's cores).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))

PROMPTS = ["The history of the printing press", "A recipe for bread:", "Explain how a bicycle stays upright.",
           "Once upon a time in a small village,", "The three laws of motion are", "def fibonacci(n):",
           "A short poem about the sea:", "The capital cities of Europe include"]


def start(port: int, flags: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sluice_engine.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", *flags]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server at {url} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(url)


async def one_round(url: str, n: int, concurrency: int, max_tokens: int, rng: random.Random) -> float:
    """Output tokens per second of n requests at this concurrency."""
    import aiohttp

    prompts = [rng.choice(PROMPTS) for _ in range(n)]
    sem = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(session: aiohttp.ClientSession, prompt: str) -> None:
        nonlocal tokens
        headers = {"traceparent": f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01"}
        body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        async with sem, session.post(f"{url}/v1/completions", json=body, headers=headers) as r:
            r.raise_for_status()
            tokens += (await r.json())["usage"]["completion_tokens"]

    async with aiohttp.ClientSession() as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(session, p) for p in prompts))
        return tokens / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4, help="rounds per variant, alternating off/on")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--port", type=int, default=18480, help="the first of the two servers' ports")
    p.add_argument("--log-dir", default=str(ROOT / "bench-results" / "tracing-overhead-logs"))
    a = p.parse_args()

    from otlp_collector import OTLPCollector

    from sluice_engine.bench.machine import cpu_name

    logs = Path(a.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    common = ["--served-model-name", "bench", "--kv-cache-memory", "512M"]
    with OTLPCollector() as collector:
        variants = {"off": (a.port, common), "on": (a.port + 1, [*common, "--otlp-traces-endpoint", collector.endpoint,
                                                                 "--trace-sample-ratio", "1.0"])}
        procs = {name: start(port, flags, env, logs / f"{name}.log") for name, (port, flags) in variants.items()}
        try:
            for name, (port, _) in variants.items():
                wait_ready(f"http://127.0.0.1:{port}", procs[name])
            print(f"CPU: {cpu_name()}, {a.threads} threads per server; {a.num_requests} requests x {a.max_tokens} "
                  f"tokens at concurrency {a.concurrency}, {a.rounds} rounds each, alternating", flush=True)
            results: dict[str, list[float]] = {"off": [], "on": []}
            for port, _ in variants.values():  # one warm-up round each, not counted
                asyncio.run(one_round(f"http://127.0.0.1:{port}", a.concurrency, a.concurrency, 8, random.Random(1)))
            for r in range(a.rounds):
                order = ["off", "on"] if r % 2 == 0 else ["on", "off"]
                for name in order:
                    port = variants[name][0]
                    tps = asyncio.run(one_round(f"http://127.0.0.1:{port}", a.num_requests, a.concurrency,
                                                a.max_tokens, random.Random(r)))
                    results[name].append(tps)
                    print(f"  round {r + 1} {name:>3}: {tps:7.1f} output tok/s", flush=True)
            time.sleep(1.0)  # the last batch leaves (every 5 s by default; flushed at shutdown otherwise)
        finally:
            for proc in procs.values():
                proc.terminate()
            for proc in procs.values():
                proc.wait(timeout=30)
        off, on = statistics.median(results["off"]), statistics.median(results["on"])
        traces = len({s.trace_id for s in collector.spans if s.name == "llm_request"})
        print(f"median output tok/s: tracing off {off:.1f}, tracing on {on:.1f}; on/off = {on / off:.3f}")
        print(f"spread (min-max): off {min(results['off']):.1f}-{max(results['off']):.1f}, "
              f"on {min(results['on']):.1f}-{max(results['on']):.1f}; the collector got {traces} request traces "
              f"({len(collector.spans)} spans)")


if __name__ == "__main__":
    main()
