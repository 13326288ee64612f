"""Priorities and fairness through the endpoint picker under saturation (issue 41, acceptance 3).

    .venv/bin/python benchmarks/picker_priority.py          # ~4 min on 2 cores

One engine (`sluice serve --scheduling-policy priority --max-num-seqs SEQS`), Sluice's picker in front of it
(`sluice gateway --endpoint-picker --picker-max-inflight INFLIGHT --objective critical=10 --objective
standard=0 --objective batch=-1`), e2e/extproc_gateway as the GIE data plane. All requests are streaming chats
with the objective in `x-gateway-inference-objective` and the tenant in `x-gateway-inference-fairness-id`.

Phases:
1. unloaded: CRITICAL_N critical requests one at a time; their TTFT is the reference.
2. saturated: BATCH_WORKERS clients send `batch` (sheddable) requests and STANDARD_WORKERS `standard` ones back
   to back (long answers: LOW_TOKENS tokens), while critical requests arrive every CRITICAL_GAP seconds.
   Reported: critical TTFT p50/p99 against phase 1's (target: p99 within 2x), batch requests shed (429),
   standard requests that waited in the picker's flow queue and their TTFT.
3. fairness: at one priority, tenant `big` keeps BIG_WORKERS requests going, tenant `small` SMALL_WORKERS;
   reported: each tenant's completed requests and TTFT p50/p99 (no starvation: small's TTFT stays near big's
   even though big sends far more).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_common import SERVED_NAME, Proc, load_average, pct, start_engine  # noqa: E402
from server_process import free_port  # noqa: E402

from sluice_engine.bench.machine import cpu_name  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SEQS, INFLIGHT = 4, 6
LOW_TOKENS, CRITICAL_TOKENS = 48, 8
CRITICAL_N, CRITICAL_GAP = 12, 1.5
BATCH_WORKERS, STANDARD_WORKERS = 6, 6
BIG_WORKERS, SMALL_WORKERS = 8, 2
PHASE_S = 30.0


def prompt(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Request {i}: write a short story about a lighthouse keeper."}]


async def one(client: httpx.AsyncClient, url: str, objective: str, tenant: str, i: int, max_tokens: int) -> dict:
    body = {"model": SERVED_NAME, "messages": prompt(i), "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    headers = {"x-gateway-inference-objective": objective, "x-gateway-inference-fairness-id": tenant}
    t0 = time.perf_counter()
    ttft = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "objective": objective, "tenant": tenant}
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: {") and '"content":"' in line.replace(" ", ""):
                ttft = time.perf_counter() - t0
    return {"status": 200, "ttft": ttft, "total": time.perf_counter() - t0, "objective": objective,
            "tenant": tenant}


async def loop_worker(client, url, objective, tenant, until: float, out: list, max_tokens: int, base: int) -> None:
    i = base
    while time.perf_counter() < until:
        r = await one(client, url, objective, tenant, i, max_tokens)
        out.append(r)
        i += 1
        if r["status"] == 429:
            await asyncio.sleep(0.5)  # a shed client backs off, as Retry-After asks


def stats(rows: list[dict]) -> str:
    t = [r["ttft"] for r in rows if r.get("ttft") is not None]
    if not t:
        return "none answered"
    return f"n {len(t)}, TTFT p50 {statistics.median(t):.2f} s, p99 {pct(t, 99):.2f} s"


async def run(url: str) -> dict:
    out: dict = {}
    async with httpx.AsyncClient(timeout=600) as client:
        await one(client, url, "critical", "warm", 0, CRITICAL_TOKENS)  # warm-up
        unloaded = [await one(client, url, "critical", "ops", i, CRITICAL_TOKENS) for i in range(CRITICAL_N)]
        out["unloaded"] = unloaded
        # -- saturated -------------------------------------------------------------------------------------
        until = time.perf_counter() + PHASE_S
        low: list[dict] = []
        workers = [asyncio.create_task(loop_worker(client, url, "batch", "batch", until, low, LOW_TOKENS, 1000 * k))
                   for k in range(BATCH_WORKERS)]
        workers += [asyncio.create_task(loop_worker(client, url, "standard", "web", until, low, LOW_TOKENS,
                                                    1000 * (k + 10))) for k in range(STANDARD_WORKERS)]
        await asyncio.sleep(4)  # saturation first
        critical = []
        for i in range(CRITICAL_N):
            critical.append(asyncio.create_task(one(client, url, "critical", "ops", 500 + i, CRITICAL_TOKENS)))
            await asyncio.sleep(CRITICAL_GAP)
        out["critical"] = await asyncio.gather(*critical)
        await asyncio.gather(*workers)
        out["low"] = low
        # -- fairness --------------------------------------------------------------------------------------
        until = time.perf_counter() + PHASE_S
        fair: list[dict] = []
        tasks = [asyncio.create_task(loop_worker(client, url, "standard", "big", until, fair, LOW_TOKENS, 100 * k))
                 for k in range(BIG_WORKERS)]
        tasks += [asyncio.create_task(loop_worker(client, url, "standard", "small", until, fair, LOW_TOKENS,
                                                  100 * (k + 50))) for k in range(SMALL_WORKERS)]
        await asyncio.gather(*tasks)
        out["fair"] = fair
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from sluice_engine.model_fetch import resolve_model

    log_dir = Path(tempfile.mkdtemp(prefix="picker_priority-"))
    gw_bin = subprocess.run(["bash", str(ROOT / "scripts" / "get-extproc-gateway.sh")], capture_output=True,
                            text=True, check=True).stdout.strip().splitlines()[-1]
    engine = start_engine(str(resolve_model(None)), log_dir, "engine",
                          ["--scheduling-policy", "priority", "--max-num-seqs", str(SEQS), "--kv-cache-memory", "256MiB"])
    procs = [engine]
    try:
        engine.wait_ready()
        picker_port, http_port = free_port(), free_port()
        picker = Proc(["gateway", "--host", "127.0.0.1", "--port", str(http_port), "--scaler-port", str(free_port()),
                       "--peer-port", str(free_port()), "--endpoint-picker", "--picker-port", str(picker_port),
                       "--picker-max-inflight", str(INFLIGHT), "--objective", "critical=10", "--objective",
                       "standard=0", "--objective", "batch=-1", "--backend", f"{SERVED_NAME}={engine.url}",
                       "--log-level", "warning"], log_dir / "picker.log", http_port)
        procs.append(picker)
        picker.wait_ready(60)
        gw_port = free_port()
        with open(log_dir / "extproc-gateway.log", "w") as log:
            gw = subprocess.Popen([gw_bin, "--listen", f"127.0.0.1:{gw_port}", "--epp", f"127.0.0.1:{picker_port}"],
                                  stdout=log, stderr=subprocess.STDOUT)
        time.sleep(1)
        load0 = load_average()
        res = asyncio.run(run(f"http://127.0.0.1:{gw_port}"))
        gw.terminate()
    finally:
        for p in reversed(procs):
            p.stop()
    base = [r["ttft"] for r in res["unloaded"]]
    crit = [r["ttft"] for r in res["critical"] if r.get("ttft") is not None]
    batch = [r for r in res["low"] if r["objective"] == "batch"]
    standard = [r for r in res["low"] if r["objective"] == "standard"]
    print(f"\nCPU {cpu_name()}, load {load0} -> {load_average()}; engine --max-num-seqs {SEQS}, picker "
          f"--picker-max-inflight {INFLIGHT}; logs {log_dir}\n")
    print(f"- critical, unloaded: {stats(res['unloaded'])}")
    print(f"- critical, saturated: {stats(res['critical'])}; p99 ratio {pct(crit, 99) / pct(base, 99):.2f}x, "
          f"p50 ratio {statistics.median(crit) / statistics.median(base):.2f}x; "
          f"{sum(r['status'] != 200 for r in res['critical'])} not answered")
    print(f"- batch (sheddable): {len(batch)} sent, {sum(r['status'] == 429 for r in batch)} shed with 429, "
          f"answered: {stats([r for r in batch if r['status'] == 200])}")
    print(f"- standard: {len(standard)} sent, {sum(r['status'] != 200 for r in standard)} not answered; "
          f"{stats(standard)}")
    for tenant in ("big", "small"):
        rows = [r for r in res["fair"] if r["tenant"] == tenant]
        workers = BIG_WORKERS if tenant == "big" else SMALL_WORKERS
        print(f"- fairness, tenant {tenant} ({workers} clients): {sum(r['status'] == 200 for r in rows)} answered, "
              f"{stats(rows)}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
