"""Two tenants on one endpoint, one far over its token quota (issue 42, acceptance 1).

    .venv/bin/python benchmarks/tenant_quotas.py          # ~3 min on 2 cores

One engine (`sluice serve`, the default model), two gateway replicas that follow each other on the peer port,
an API keys file with two tenants: `team-a` limited to A_TOKENS_PER_MINUTE tokens a minute, `team-b` unlimited.
Rounds alternate two phases of PHASE_S seconds each:
- alone: team-b's B_WORKERS clients send streaming chats (B_TOKENS tokens) back to back through replica 1;
- with: the same, while team-a's A_WORKERS clients (a process of their own, as another tenant's clients would be)
  send through both replicas in turn, over quota. `--team-a retry-after` (default): they wait what Retry-After
  says after a 429, as the OpenAI SDKs do; `--team-a hammer`: they ignore it and send again after A_PAUSE_S (a
  misbehaving client, the worst case for team-b; on 2 cores its 429s cost the machine CPU that team-b's
  engine would use).
Reported: team-b's output tokens/s, TTFT p50 and latency p50 per phase (median over the rounds) and their ratio
(target: within 10%); team-a's answers and 429s, and what it was admitted per minute on the two replicas
together against its limit; the tokens the gateways counted against the engine's own totals.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_common import SERVED_NAME, Proc, load_average, pct, scrape, start_engine, write_backends  # noqa: E402
from server_process import free_port  # noqa: E402

from sluice_engine.bench.machine import cpu_name  # noqa: E402

ROUNDS, PHASE_S = 3, 20.0
B_WORKERS, B_TOKENS = 4, 32
A_WORKERS, A_TOKENS, A_PAUSE_S = 4, 16, 0.05
A_TOKENS_PER_MINUTE = 200
KEYS = f"""
tenants:
  team-a:
    keys: [sk-team-a]
    limits: {{tokensPerMinute: {A_TOKENS_PER_MINUTE}}}
  team-b:
    keys: [sk-team-b]
"""


def chat(i: int, max_tokens: int) -> dict:
    return {"model": SERVED_NAME, "messages": [{"role": "user", "content": f"Story {i}: a lighthouse keeper."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}


async def one(client: httpx.AsyncClient, url: str, key: str, i: int, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    ttft, chunks = None, 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=chat(i, max_tokens),
                             headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "retry_after": float(r.headers.get("Retry-After", 1))}
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
    return {"status": 200, "ttft": ttft, "total": time.perf_counter() - t0, "tokens": chunks}


async def worker(client, urls: list[str], key: str, until: float, out: list, max_tokens: int, base: int,
                 mode: str = "") -> None:
    i = base
    while time.perf_counter() < until:
        r = await one(client, urls[i % len(urls)], key, i, max_tokens)
        out.append(r)
        i += 1
        if r["status"] == 429:
            wait = A_PAUSE_S if mode == "hammer" else r["retry_after"]
            await asyncio.sleep(min(wait, until - time.perf_counter()))


async def tenant_a(urls: list[str], until: float, mode: str, base: int) -> dict:
    out: list[dict] = []
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None)) as client:
        await asyncio.gather(*(worker(client, urls, "sk-team-a", until, out, A_TOKENS, base + 1000 * w, mode)
                               for w in range(A_WORKERS)))
    return {"ok": sum(r["status"] == 200 for r in out), "limited": sum(r["status"] == 429 for r in out),
            "other": sum(r["status"] not in (200, 429) for r in out)}


def tenant_a_process(urls: list[str], until_wall: float, mode: str, base: int, result) -> None:
    until = time.perf_counter() + (until_wall - time.time())
    result.update(asyncio.run(tenant_a(urls, until, mode, base)))
    result["cpu"] = time.process_time()  # this process's own CPU seconds (user + system)


async def phase(gw_urls: list[str], with_a: bool, base: int, mode: str) -> tuple[dict, dict]:
    until = time.perf_counter() + PHASE_S
    b_out: list[dict] = []
    a = {"ok": 0, "limited": 0, "other": 0}
    proc = None
    if with_a:
        manager_result = multiprocessing.Manager().dict()
        proc = multiprocessing.Process(target=tenant_a_process, args=(gw_urls, time.time() + PHASE_S, mode,
                                                                      base + 500, manager_result))
        proc.start()
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client, gw_urls[:1], "sk-team-b", until, b_out, B_TOKENS, base + 1000 * w)
                               for w in range(B_WORKERS)))
        elapsed = time.perf_counter() - t0
    if proc is not None:
        proc.join(120)
        a = dict(manager_result)
    ok = [r for r in b_out if r["status"] == 200]
    b = {"tok_s": sum(r["tokens"] for r in ok) / elapsed, "ttft_p50": pct([r["ttft"] for r in ok], 50),
         "total_p50": pct([r["total"] for r in ok], 50), "n": len(ok), "errors": len(b_out) - len(ok)}
    return b, a


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of a process and its live descendants (the engine's core process is a child)."""
    total = 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                total += cpu_seconds(int(child))
    except (OSError, IndexError, ValueError):
        pass
    return total


def tenant_tokens(url: str, tenant: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("sluice_gateway_tenant_tokens_total{") and f'tenant="{tenant}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def main() -> None:
    from sluice_engine.model_fetch import resolve_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--team-a", choices=("retry-after", "hammer"), default="retry-after")
    mode = parser.parse_args().team_a

    model_dir = str(resolve_model(None))
    print(f"CPU: {cpu_name()}; load average {load_average()}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        engine = start_engine(model_dir, tmp_path, "engine")
        engine.wait_ready()
        keys, backends = tmp_path / "keys.yaml", tmp_path / "backends.json"
        keys.write_text(KEYS)
        write_backends(backends, [engine.url])
        ports, peer_ports = [free_port(), free_port()], [free_port(), free_port()]
        gws = []
        for i in range(2):
            gws.append(Proc(["gateway", "--host", "127.0.0.1", "--port", str(ports[i]), "--scaler-port",
                             str(free_port()), "--peer-port", str(peer_ports[i]), "--peer",
                             f"http://127.0.0.1:{peer_ports[1 - i]}", "--peer-interval", "0.5", "--backends-file",
                             str(backends), "--api-keys-file", str(keys), "--log-level", "warning"],
                            tmp_path / f"gateway{i}.log", ports[i]))
        try:
            for g in gws:
                g.wait_ready(30)
            urls = [g.url for g in gws]
            engine_before = scrape(engine.url)
            asyncio.run(phase(urls, False, 0, mode))  # warm-up, not counted
            results: dict[str, list[dict]] = {"alone": [], "with": []}
            a_totals = {"ok": 0, "limited": 0, "other": 0}
            a_start = time.monotonic()
            a_tokens_before = sum(tenant_tokens(u, "team-a") for u in urls)
            cpu: dict[str, dict[str, float]] = {"alone": {}, "with": {}}
            for r in range(ROUNDS):
                for name in ("alone", "with"):
                    before = {"engine": cpu_seconds(engine.proc.pid), "gateways": sum(cpu_seconds(g.proc.pid)
                                                                                      for g in gws)}
                    b, a = asyncio.run(phase(urls, name == "with", 10_000 * (r + 1) + (name == "with") * 5000, mode))
                    results[name].append(b)
                    spent = cpu[name]
                    spent["engine"] = spent.get("engine", 0) + cpu_seconds(engine.proc.pid) - before["engine"]
                    spent["gateways"] = spent.get("gateways", 0) + sum(cpu_seconds(g.proc.pid) for g in gws) \
                        - before["gateways"]
                    spent["team-a client"] = spent.get("team-a client", 0) + a.get("cpu", 0.0)
                    for k in a_totals:
                        a_totals[k] += a[k]
                    print(f"  round {r + 1} {name:5s}: team-b {b['tok_s']:.1f} tok/s, TTFT p50 {b['ttft_p50']:.3f}s, "
                          f"latency p50 {b['total_p50']:.2f}s ({b['n']} answers, {b['errors']} errors)"
                          + (f"; team-a {a['ok']} answered, {a['limited']} 429" if name == "with" else ""),
                          flush=True)
            a_minutes = (time.monotonic() - a_start) / 60
            a_tokens = sum(tenant_tokens(u, "team-a") for u in urls) - a_tokens_before
            engine_after = scrape(engine.url)
            served = sum(engine_after.get(k, 0) - engine_before.get(k, 0)
                         for k in ("sluice_prompt_tokens_total", "sluice_generation_tokens_total"))
            counted = sum(tenant_tokens(u, t) for u in urls for t in ("team-a", "team-b"))
        finally:
            for g in gws:
                g.stop()
            engine.stop()
    print(f"\nCPU: {cpu_name()}; {ROUNDS} rounds of {PHASE_S:.0f}s per phase; team-b {B_WORKERS} clients, "
          f"{B_TOKENS} tokens; team-a {A_WORKERS} clients over 2 gateway replicas, {mode}")
    print("| team-b | alone (median) | with team-a over quota (median) | ratio |")
    print("|---|---:|---:|---:|")
    for key, label, fmt in (("tok_s", "output tok/s", "{:.1f}"), ("ttft_p50", "TTFT p50 (s)", "{:.3f}"),
                            ("total_p50", "latency p50 (s)", "{:.2f}")):
        alone = statistics.median(x[key] for x in results["alone"])
        withs = statistics.median(x[key] for x in results["with"])
        print(f"| {label} | {fmt.format(alone)} | {fmt.format(withs)} | {withs / alone:.3f} |")
    print(f"team-a: {a_totals['ok']} answered, {a_totals['limited']} refused with 429, {a_totals['other']} other; "
          f"admitted {a_tokens:.0f} tokens in {a_minutes:.1f} min = {a_tokens / a_minutes:.0f}/min over both replicas "
          f"(limit {A_TOKENS_PER_MINUTE}/min; the warm-up and 'alone' phases are in those minutes)")
    for name, spent in cpu.items():
        print(f"CPU seconds over the {name!r} phases ({ROUNDS * PHASE_S:.0f} s): "
              + ", ".join(f"{k} {v:.1f}" for k, v in spent.items()))
    print(f"tokens counted by the gateways {counted:.0f}, served by the engine {served:.0f} "
          f"({(counted - served) / served * 100:+.2f}%)")


if __name__ == "__main__":
    main()
