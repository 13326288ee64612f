"""Prefix-aware routing (CHWBL) vs round-robin through `sluice gateway`, two engines, a shared-prefix workload.

    .venv/bin/python benchmarks/gateway_prefix_routing.py            # ~6 min on 2 cores (3 modes)
    .venv/bin/python benchmarks/gateway_prefix_routing.py --groups 4 --per-group 4   # quick

Workload (seed 0): GROUPS system prompts of ~SYSTEM_WORDS seeded words each (~500 tokens), PER_GROUP
different user questions behind each, all requests shuffled and sent by CONCURRENCY client workers as
streaming chat completions (greedy, max_tokens MAX_TOKENS). The shape of an app with a few long
instructions and many users.

Each routing mode gets two fresh engines (cold prefix caches), one torch thread each (the machine has two
cores), and a KV cache (--kv-cache-memory) with room for about 6 of the 8 prefixes: with round-robin both
engines see every prefix and evict reuse; with prefix routing each engine keeps its share (4 of 8, plus
what bounded-load spill-over brings). Modes: `prefix` (CHWBL, load factor 1.25, the default), `prefix@2`
(load factor 2: less spill-over), `round-robin`. `--load-generator sluice-bench` drives the gateway with
`sluice bench --workload shared-prefix` instead (same shape: 8 prefixes of ~500 tokens, 48 requests,
4 in flight, 8 output tokens), so the figures come from the project's load generator. Reported: the prefix-cache hit rate summed over both engines (sluice_prefix_cache_hits /
sluice_prefix_cache_queries from their /metrics: prompt tokens served from cache / looked up), TTFT at
the client, and the wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from gateway_common import SERVED_NAME, load_average, pct, scrape, start_engine, start_gateway, stream_chat

SEED = 0
GROUPS = 8
PER_GROUP = 6
SYSTEM_WORDS = 380
CONCURRENCY = 4
MAX_TOKENS = 8
# ~3600 tokens at 45 KiB/token (SmolLM2: 30 layers x 2 x 3 KV heads x 64 x fp32): room for about 6 of the
# 8 prefixes (~530 tokens each) beside the running requests' own tokens.
KV_CACHE = "160MiB"

WORDS = ("river stone market lantern harvest orbit copper meadow signal archive harbor violet engine garden "
         "ledger canyon thunder quartz pilgrim mosaic compass glacier timber falcon velvet beacon summit "
         "prairie saffron cipher monsoon anchor ember lattice nomad orchard pylon raven sextant tundra "
         "vessel willow zephyr basalt citadel delta fresco gondola hemlock ivory jasmine kestrel").split()
QUESTIONS = ["What is the first step?", "Summarise the rules above.", "Give me one example.",
             "What should I avoid?", "How long does it take?", "Who is this for?", "What does it cost?",
             "Explain it to a child.", "What is the last step?", "List three keywords."]


def workload(groups: int, per_group: int) -> list[list[dict]]:
    rng = random.Random(SEED)
    systems = [f"You are assistant number {g}. Follow these instructions exactly. "
               + " ".join(rng.choice(WORDS) for _ in range(SYSTEM_WORDS)) for g in range(groups)]
    reqs = [[{"role": "system", "content": systems[g]}, {"role": "user", "content": f"{QUESTIONS[q % len(QUESTIONS)]} "
                                                                                   f"(request {g}.{q})"}]
            for g in range(groups) for q in range(per_group)]
    rng.shuffle(reqs)
    return reqs


def cache_counters(url: str) -> tuple[float, float]:
    m = scrape(url)
    return m.get("sluice_prefix_cache_queries_total", 0.0), m.get("sluice_prefix_cache_hits_total", 0.0)


def sluice_bench(url: str, log_dir: Path, routing: str, groups: int, per_group: int, concurrency: int) -> list[dict]:
    """The shared-prefix workload from `sluice bench`; its per-request records."""
    out = log_dir / f"bench-{routing}.json"
    cmd = [sys.executable, "-m", "sluice_engine.entrypoints.cli", "bench", "--base-url", url, "--workload", "shared-prefix",
           "--endpoint-type", "chat", "--prefix-len", "500", "--num-prefixes", str(groups), "--suffix-len", "24",
           "--output-len", str(MAX_TOKENS), "--num-requests", str(groups * per_group),
           "--max-concurrency", str(concurrency), "--seed", str(SEED), "--num-warmups", "0", "--no-progress",
           "--json", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    doc = json.loads(out.read_text())
    runs = doc["runs"] if isinstance(doc, dict) and "runs" in doc else doc
    return [{"ttft": r["ttft_s"], "prompt_tokens": r["prompt_tokens"], "cached_tokens": r["cached_tokens"]}
            for r in runs[0]["requests"] if r["success"]]


async def run_mode(routing: str, model_dir: str, log_dir: Path, reqs: list[list[dict]], concurrency: int,
                   verbose: bool = False, generator: str = "builtin", groups: int = GROUPS,
                   per_group: int = PER_GROUP) -> dict:
    engines = [start_engine(model_dir, log_dir, f"{routing}-{i}", ["--kv-cache-memory", KV_CACHE], threads=1)
               for i in range(2)]
    gw = None
    try:
        for e in engines:
            e.wait_ready()
        mode, _, load_factor = routing.partition("@")
        args = ["--routing", mode] + (["--load-factor", load_factor] if load_factor else [])
        for e in engines:
            args += ["--backend", f"{SERVED_NAME}={e.url}"]
        gw = start_gateway(log_dir, args)
        await asyncio.sleep(0.5)  # first health checks
        queue = list(enumerate(reqs))
        results: list[dict] = [{}] * len(reqs)
        load0 = load_average()
        t0 = time.perf_counter()
        if generator == "sluice-bench":
            results = await asyncio.to_thread(sluice_bench, gw.url, log_dir, routing, groups, per_group, concurrency)
            queue = []
        async with httpx.AsyncClient(timeout=600) as client:
            async def worker() -> None:
                while queue:
                    i, messages = queue.pop(0)
                    start = time.perf_counter() - t0
                    results[i] = await stream_chat(client, gw.url, messages, MAX_TOKENS)
                    results[i]["start"] = start
                    results[i]["group"] = messages[0]["content"].split(".")[0]

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        counters = [cache_counters(e.url) for e in engines]
        served = [scrape(e.url).get("sluice_request_success_total", 0.0) for e in engines]
    finally:
        if gw:
            gw.stop()
        for e in engines:
            e.stop()
    if verbose and generator == "builtin":
        for i, r in enumerate(results):
            print(f"  #{i:2d} start {r['start']:6.1f}s {r['group']:28s} -> {r['backend'][-5:]} "
                  f"cached {r['cached_tokens']:4d}/{r['prompt_tokens']} TTFT {r['ttft']:.2f}s")
    queries, hits = sum(c[0] for c in counters), sum(c[1] for c in counters)
    ttfts = [r["ttft"] for r in results]
    return {"routing": routing, "hit_rate": hits / queries if queries else 0.0, "hits": hits, "queries": queries,
            "ttft_mean": statistics.mean(ttfts), "ttft_median": statistics.median(ttfts), "ttft_p99": pct(ttfts, 99),
            "wall": wall, "requests": len(reqs), "per_engine": served,
            "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in results),
            "load_avg": f"{load0} -> {load_average()}", "generator": generator}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=GROUPS)
    ap.add_argument("--per-group", type=int, default=PER_GROUP)
    ap.add_argument("--concurrency", type=int, default=CONCURRENCY)
    ap.add_argument("--model", default=None, help="model dir (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--json", default=None, help="write the raw results here")
    ap.add_argument("--verbose", action="store_true", help="print every request: backend, cached tokens, TTFT")
    ap.add_argument("--load-generator", choices=["builtin", "sluice-bench"], default="builtin",
                    help="the built-in chat workers, or `sluice bench --workload shared-prefix`")
    ap.add_argument("--routing", nargs="+", default=["prefix", "prefix@2", "round-robin"],
                    help="modes to run; prefix@C: prefix routing with --load-factor C (default 1.25)")
    args = ap.parse_args()
    from sluice_engine.model_fetch import resolve_model

    model_dir = str(args.model or resolve_model(None))
    log_dir = Path(tempfile.mkdtemp(prefix="gateway_prefix_routing-"))
    reqs = workload(args.groups, args.per_group)
    print(f"logs in {log_dir}; {len(reqs)} requests, {args.groups} prefixes, concurrency {args.concurrency}",
          flush=True)
    rows = []
    for routing in args.routing:
        r = await run_mode(routing, model_dir, log_dir, reqs, args.concurrency, args.verbose, args.load_generator,
                           args.groups, args.per_group)
        print(json.dumps(r), flush=True)
        rows.append(r)
    print(f"\n{len(reqs)} requests ({args.groups} system prompts x {args.per_group}, prompt ~"
          f"{rows[0]['prompt_tokens_mean']:.0f} tokens), concurrency {args.concurrency}, 2 engines:\n")
    print("| routing | prefix-cache hit rate | TTFT mean | TTFT median | TTFT p99 | wall | requests per engine |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['routing']} | {100 * r['hit_rate']:.1f}% | {r['ttft_mean']:.2f} s | {r['ttft_median']:.2f} s | "
              f"{r['ttft_p99']:.2f} s | {r['wall']:.1f} s | {' / '.join(f'{n:.0f}' for n in r['per_engine'])} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
