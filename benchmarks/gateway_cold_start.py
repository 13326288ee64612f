"""First-token latency from zero replicas through `sluice gateway`: with a warm standby vs without a warm pool.

    .venv/bin/python benchmarks/gateway_cold_start.py                # 3 runs per mode, ~3 min on 2 cores
    .venv/bin/python benchmarks/gateway_cold_start.py --repeats 1    # quick

Each run: the endpoint's serving set is empty (scaled to zero). At t0 the client sends one streaming chat
request (a short question, greedy, max_tokens 16) and, at the same moment, the benchmark starts a serving
engine and lists it in the gateway's backends file: what KEDA's push plus the EndpointSlice would do. TTFT
is measured at the client from t0 to the first content token.

- no warm pool: the request is held until the new engine has loaded the model and answers /ready, so
  TTFT includes the whole engine start (Python + torch import, weights, KV cache allocation).
- warm pool: a standby engine (started and loaded before the run, outside the serving set) answers at
  once; the serving engine starts beside it. Reported too: when the first request went to the serving
  engine afterwards (traffic moving back), and the standby's TTFT without a co-starting engine beside it
  on the same cores ("warm pool, alone"): on a cluster the new replica starts on another GPU.

What a cluster adds and this does not measure: KEDA's reaction to the push, pod scheduling, image pull,
and model download (the operator's model cache makes that a local read).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from gateway_common import (
    ENDPOINT,
    load_average,
    start_engine,
    start_gateway,
    stream_chat,
    summary,
    write_backends,
)

MAX_TOKENS = 16


def question(mode: str, i: int) -> list[dict]:
    # A different opening per run, so no run hits the standby's prefix cache from an earlier one.
    return [{"role": "user", "content": f"[{mode} run {i}] In one sentence, why is the sky blue?"}]


async def one_run(gw_url: str, backends: Path, model_dir: str, log_dir: Path, mode: str, i: int,
                  standby: list[str]) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        request = asyncio.create_task(stream_chat(client, gw_url, question(mode, i), MAX_TOKENS, t0))
        engine = None
        if mode != "warm pool, alone":
            engine = start_engine(model_dir, log_dir, f"serving-{mode.replace(' ', '_')}-{i}", quiet=True)
            write_backends(backends, [engine.url], standby)
        result = await request
        result["switch_back"] = None
        if engine is not None and standby:
            # Traffic moves back: the first request after the serving engine is ready goes there.
            await asyncio.to_thread(engine.wait_ready)
            while True:
                r = await stream_chat(client, gw_url, question(mode + " after", i), 1)
                if r["role"] == "serving":
                    result["switch_back"] = time.perf_counter() - t0
                    break
                await asyncio.sleep(0.05)
        if engine is not None:
            engine.stop()
        write_backends(backends, [], standby)  # back to zero
        await asyncio.sleep(1.0)  # the gateway re-reads the file
    return result


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=None, help="model dir (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--json", default=None, help="write the raw results here")
    args = ap.parse_args()
    from sluice_engine.model_fetch import resolve_model

    model_dir = str(args.model or resolve_model(None))
    log_dir = Path(tempfile.mkdtemp(prefix="gateway_cold_start-"))
    backends = log_dir / "backends.json"
    write_backends(backends, [])
    print(f"logs in {log_dir}; load average before: {load_average()}", flush=True)
    gw = start_gateway(log_dir, ["--backends-file", str(backends), "--hold-timeout", "600"])
    results: dict[str, list[dict]] = {}
    try:
        for mode in ("no warm pool",):
            results[mode] = []
            for i in range(args.repeats):
                r = await one_run(gw.url, backends, model_dir, log_dir, mode, i, [])
                print(f"{mode} #{i}: TTFT {r['ttft']:.2f}s (load avg {load_average()})", flush=True)
                results[mode].append(r)
        standby = start_engine(model_dir, log_dir, "standby")
        print(f"  standby ready after {standby.wait_ready():.1f}s", flush=True)
        write_backends(backends, [], [standby.url])
        await asyncio.sleep(1.0)
        try:
            for mode in ("warm pool", "warm pool, alone"):
                results[mode] = []
                for i in range(args.repeats):
                    r = await one_run(gw.url, backends, model_dir, log_dir, mode, i, [standby.url])
                    assert r["role"] == "standby", r
                    print(f"{mode} #{i}: TTFT {r['ttft']:.2f}s"
                          + (f", serving took over at {r['switch_back']:.1f}s" if r["switch_back"] else "")
                          + f" (load avg {load_average()})", flush=True)
                    results[mode].append(r)
        finally:
            standby.stop()
    finally:
        gw.stop()

    print(f"\nGateway endpoint {ENDPOINT}, {args.repeats} runs per mode, max_tokens {MAX_TOKENS}:\n")
    print("| mode | TTFT from zero (median) | min | max | serving replica took over after (median) |")
    print("|---|---:|---:|---:|---:|")
    for mode, rs in results.items():
        ttfts = [r["ttft"] for r in rs]
        sb = [r["switch_back"] for r in rs if r["switch_back"]]
        print(f"| {mode} | {statistics.median(ttfts):.2f} s | {min(ttfts):.2f} s | {max(ttfts):.2f} s | "
              f"{f'{statistics.median(sb):.1f} s' if sb else '-'} |")
    for mode, rs in results.items():
        print(f"{mode}: TTFT {summary([r['ttft'] for r in rs])}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
