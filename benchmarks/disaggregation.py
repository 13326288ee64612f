"""Issue 28's disaggregation check, in one sitting: a mixed workload of long prompts and short chats at a fixed
request rate (Poisson arrivals, the same schedule for both layouts) served by two colocated engines (requests
alternate between them) and by one prefill + one decode engine, the same cores in total: each engine pinned to
its own core (taskset), one thread each. The client sends every request to the decode engine, as clients of a
disaggregated endpoint do: the decode engine sends prompts of --prefill-min-prompt-tokens or more to the prefill
engine first (`--prefill-url`, the operator's wiring), which pushes their KV blocks back; short chats are
prefilled where they are decoded.

The client streams every answer; TTFT is from sending (the first hop) to the first streamed token, TPOT the
mean gap between the later tokens. Reported: TTFT p50 of all requests, TPOT p50/p99 of the short chats (what
long prefills stall in a colocated engine), and the long prompts' TTFT (what disaggregation adds: the hop and
the transfer).

    .venv/bin/python benchmarks/disaggregation.py                    # ~6 min on 2 cores
    .venv/bin/python benchmarks/disaggregation.py --duration 300 --rate 1.5 --long-tokens 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

import httpx
from server_process import Server, free_port

WORDS = ("river stone maple cloud lantern harbor meadow copper violet summit orchard falcon ember willow glacier "
         "prairie thistle canyon beacon").split()


def text(seed: int, tokens: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(WORDS)}{rng.randrange(100)}" for _ in range(tokens // 3))


async def one(client: httpx.AsyncClient, hops: list[tuple[str, dict]], t0: float) -> dict:
    """The request's hops in order (the last is streamed to the client); its TTFT and token times."""
    for url, body in hops[:-1]:
        r = await client.post(url, json=body, timeout=600)
        r.raise_for_status()
    url, body = hops[-1]
    times = []
    async with client.stream("POST", url, json={**body, "stream": True}, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0].get("text"):
                    times.append(time.perf_counter())
    ttft = times[0] - t0 if times else float("nan")
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")
    return {"ttft": ttft, "tpot": tpot}


async def run(schedule, route) -> list[dict]:
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=512)) as client:
        start = time.perf_counter()
        tasks = []
        for at, kind, prompt, max_tokens in schedule:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            tasks.append((kind, asyncio.create_task(one(client, route(kind, prompt, max_tokens),
                                                        time.perf_counter()))))
        return [{"kind": kind, **(await t)} for kind, t in tasks]


def start(name: str, core: int, port: int, extra: list[str], log_dir: Path) -> Server:
    cmd = ["taskset", "-c", str(core), sys.executable, "-m", "sluice_engine.entrypoints.cli", "serve", "--host",
           "127.0.0.1", "--port", str(port), "--served-model-name", "m", "--log-level", "warning",
           "--max-model-len", "4096", *extra]
    return Server(name, cmd, {**os.environ, "OMP_NUM_THREADS": "1"}, log_dir / f"{name}.log",
                  f"http://127.0.0.1:{port}", "/ready")


def summary(results: list[dict]) -> dict:
    def pct(xs, q):
        xs = sorted(x for x in xs if x == x)
        return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] * 1e3 if xs else float("nan")

    short = [r for r in results if r["kind"] == "short"]
    long_ = [r for r in results if r["kind"] == "long"]
    return {"ttft_p50_ms": pct([r["ttft"] for r in results], 0.5),
            "short_tpot_p50_ms": pct([r["tpot"] for r in short], 0.5),
            "short_tpot_p99_ms": pct([r["tpot"] for r in short], 0.99),
            "short_ttft_p50_ms": pct([r["ttft"] for r in short], 0.5),
            "long_ttft_p50_ms": pct([r["ttft"] for r in long_], 0.5),
            "requests": len(results)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=120, help="seconds of arrivals")
    p.add_argument("--rate", type=float, default=1.0, help="requests per second")
    p.add_argument("--long-share", type=float, default=0.15)
    p.add_argument("--long-tokens", type=int, default=1000)
    p.add_argument("--short-tokens", type=int, default=60)
    p.add_argument("--long-max-tokens", type=int, default=16)
    p.add_argument("--short-max-tokens", type=int, default=32)
    p.add_argument("--prefill-min-prompt-tokens", type=int, default=256,
                   help="the decode engine's threshold for the prefill hop")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="bench-results/disaggregation-logs")
    p.add_argument("--json")
    a = p.parse_args()
    logs = Path(a.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    schedule, at, i = [], 0.0, 0
    while at < a.duration:
        kind = "long" if rng.random() < a.long_share else "short"
        n = a.long_tokens if kind == "long" else a.short_tokens
        schedule.append((at, kind, text(a.seed * 100003 + i, n), a.long_max_tokens if kind == "long" else
                         a.short_max_tokens))
        at += rng.expovariate(a.rate)
        i += 1
    base = {"temperature": 0, "ignore_eos": True, "model": "m"}
    from sluice_engine.bench.machine import cpu_name

    print(f"# {cpu_name()}, {os.cpu_count()} cores; {len(schedule)} requests over {a.duration:.0f} s at "
          f"{a.rate}/s, {a.long_share:.0%} long ({a.long_tokens} prompt tokens, {a.long_max_tokens} out), short "
          f"{a.short_tokens} prompt tokens, {a.short_max_tokens} out; one core and one thread per engine", flush=True)
    results = {}

    # Colocated: two engines, requests alternating.
    ports = [free_port(), free_port()]
    servers = [start(f"colocated-{k}", k, port, [], logs) for k, port in enumerate(ports)]
    try:
        for s in servers:
            s.wait_ready(300)
        turn = iter(range(10**9))

        def colocated(kind, prompt, max_tokens):
            port = ports[next(turn) % 2]
            return [(f"http://127.0.0.1:{port}/v1/completions", {**base, "prompt": prompt, "max_tokens": max_tokens})]

        results["colocated, 2 engines"] = summary(asyncio.run(run(schedule, colocated)))
    finally:
        for s in servers:
            s.stop()

    # Disaggregated: prefill on core 0, decode on core 1.
    pport, dport, kvport = free_port(), free_port(), free_port()
    # The endpoint's KV key, as the operator mounts it into both pools: transfers are sealed with it (issue 39).
    key_file = Path(logs) / "kv-secret"
    key_file.write_text(os.urandom(32).hex())
    key = ["--kv-secret-file", str(key_file)]
    servers = [start("prefill", 0, pport, ["--kv-role", "prefill", *key], logs),
               start("decode", 1, dport, [*key, "--kv-role", "decode", "--kv-host", "127.0.0.1", "--kv-port", str(kvport),
                                           "--kv-offload-bytes", "1GiB", "--prefill-url", f"http://127.0.0.1:{pport}",
                                           "--prefill-min-prompt-tokens", str(a.prefill_min_prompt_tokens)], logs)]
    try:
        for s in servers:
            s.wait_ready(300)

        def disaggregated(kind, prompt, max_tokens):
            return [(f"http://127.0.0.1:{dport}/v1/completions", {**base, "prompt": prompt, "max_tokens": max_tokens})]

        results["1 prefill + 1 decode"] = summary(asyncio.run(run(schedule, disaggregated)))
        pushes = httpx.get(f"http://127.0.0.1:{pport}/metrics", timeout=10).text
        hits = httpx.get(f"http://127.0.0.1:{dport}/metrics", timeout=10).text
        pushed = [ln for ln in pushes.splitlines() if ln.startswith("sluice_kv_pushes_total")]
        loaded = [ln for ln in hits.splitlines() if ln.startswith(("sluice_kv_offload_hits_total",
                                                                   "sluice_kv_prefill_hops_total"))]
        print("prefill pushes:", "; ".join(pushed), "| decode:", "; ".join(loaded))
    finally:
        for s in servers:
            s.stop()

    cols = ["ttft_p50_ms", "short_tpot_p50_ms", "short_tpot_p99_ms", "short_ttft_p50_ms", "long_ttft_p50_ms"]
    print(f"{'layout':<22} " + " ".join(f"{c:>18}" for c in cols))
    for name, r in results.items():
        print(f"{name:<22} " + " ".join(f"{r[c]:18.1f}" for c in cols))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
