"""Issue 44's second check: Sluice's output tok/s with every answer streamed against the same answers not
streamed, on the same prompts, at a closed loop of 32 (vLLM's client cannot do this: `vllm bench serve` streams
every completions request, and its `--no-stream` only changes how Hugging Face datasets load).

    .venv/bin/python benchmarks/stream_vs_nonstream.py                          # 32 and 256 input, 2 rounds, ~12 min
    .venv/bin/python benchmarks/stream_vs_nonstream.py --input-lens 32 --rounds 3 --json bench-results/stream.json

Each run has a fresh `sluice serve` (the default: the bundled model's Q4_1 blocks; --sluice-args adds flags), so
both modes meet the same prompts with an empty prefix cache, and each server first serves a warm-up of other
prompts. The prompts are token ids (seeded random ids from 100 to 40,000, --input-len each), sent as the OpenAI
`prompt` array: the same tokens for both modes, nothing left to a tokenizer. The client is the `openai` package's
AsyncOpenAI, --concurrency requests in flight (a new one as soon as one ends), --output-len tokens each with
`ignore_eos`, no temperature (the server's default, 1, as vLLM's client). Streamed: `stream_options.include_usage`,
TTFT at the first chunk with text; not streamed: the response's usage. Output tok/s = completion tokens (from
usage) over the run's wall time. Also per run: the engine core's and the API process's CPU seconds, this client's.
The modes alternate which goes first between rounds; the report gives medians and streamed / non-streamed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import sys
import time
from pathlib import Path

from server_process import Server, free_port
from vllm_bench_serve import by_role, process_tree_cpu, stop_tree

ROOT = Path(__file__).resolve().parent.parent


def prompts(seed: int, count: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(count)]


async def one(client, model: str, prompt: list[int], output_len: int, stream: bool) -> tuple[int, float | None]:
    """(completion tokens, seconds to the first text or None) of one request."""
    t0 = time.perf_counter()
    kw = dict(model=model, prompt=prompt, max_tokens=output_len, extra_body={"ignore_eos": True})
    if not stream:
        r = await client.completions.create(**kw)
        return r.usage.completion_tokens, None
    ttft, tokens = None, 0
    async for chunk in await client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if ttft is None and chunk.choices and chunk.choices[0].text:
            ttft = time.perf_counter() - t0
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens, ttft


async def closed_loop(url: str, model: str, batch: list[list[int]], output_len: int, concurrency: int,
                      stream: bool) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=3600, max_retries=0)
    gate = asyncio.Semaphore(concurrency)

    async def gated(p):
        async with gate:
            return await one(client, model, p, output_len, stream)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(gated(p) for p in batch))
    wall = time.perf_counter() - t0
    await client.close()
    tokens = sum(n for n, _ in results)
    ttfts = sorted(t for _, t in results if t is not None)
    return {"output_tokens": tokens, "wall_s": round(wall, 2), "output_tok_s": round(tokens / wall, 1),
            "ttft_p50_ms": round(statistics.median(ttfts) * 1e3, 1) if ttfts else None}


def run(a, input_len: int, rnd: int, stream: bool, logs: Path) -> dict:
    port = free_port()
    srv = Server("sluice", [sys.executable, "-m", "sluice_engine.entrypoints.cli", "serve", "--served-model-name",
                            "smollm2", "--port", str(port), "--log-level", "warning", *a.sluice_args.split()],
                 {**os.environ, "OMP_NUM_THREADS": str(a.threads)}, logs / f"sluice-{input_len}-{rnd}-{stream}.log",
                 f"http://127.0.0.1:{port}", "/ready")
    try:
        srv.wait_ready(600)
        warm = prompts(a.seed + 7919 * (rnd + 1) + input_len, a.concurrency, input_len)
        asyncio.run(closed_loop(srv.url, "smollm2", warm, 16, a.concurrency, stream))
        batch = prompts(a.seed + 1000 * input_len + rnd, a.num_prompts, input_len)  # the same for both modes
        before, c0 = process_tree_cpu(srv.proc.pid), resource.getrusage(resource.RUSAGE_SELF)
        r = asyncio.run(closed_loop(srv.url, "smollm2", batch, a.output_len, a.concurrency, stream))
        after, c1 = process_tree_cpu(srv.proc.pid), resource.getrusage(resource.RUSAGE_SELF)
    finally:
        stop_tree(srv)
    row = {"input_len": input_len, "round": rnd, "stream": stream, **r, "server_cpu_s": by_role(before, after),
           "client_cpu_s": round(c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime, 1)}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input-lens", default="32,256")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--sluice-args", default="", help="extra flags for sluice serve (one string)")
    p.add_argument("--json", help="write every run's figures here")
    p.add_argument("--log-dir", default=str(ROOT / "bench-results" / "stream-vs-nonstream"))
    a = p.parse_args()
    from sluice_engine.bench.machine import cpu_name

    logs = Path(a.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    print(f"CPU: {cpu_name()}, {a.threads} threads, {os.cpu_count()} cores", flush=True)
    rows = []
    for input_len in (int(x) for x in a.input_lens.split(",")):
        for rnd in range(a.rounds):
            for stream in ((True, False) if rnd % 2 == 0 else (False, True)):
                rows.append(run(a, input_len, rnd, stream, logs))
    if a.json:
        Path(a.json).write_text(json.dumps({"cpu": cpu_name(), "args": vars(a), "runs": rows}, indent=1))
    print(f"\nmedians of {a.rounds} round(s); {a.num_prompts} prompts, c{a.concurrency}, {a.output_len} output tokens")
    print("| input | streamed tok/s | non-streamed tok/s | streamed / non-streamed | rounds (s / n) |")
    print("|---:|---:|---:|---:|---|")
    for input_len in dict.fromkeys(r["input_len"] for r in rows):
        s = [r["output_tok_s"] for r in rows if r["input_len"] == input_len and r["stream"]]
        n = [r["output_tok_s"] for r in rows if r["input_len"] == input_len and not r["stream"]]
        pairs = ", ".join(f"{x:.1f} / {y:.1f}" for x, y in zip(s, n, strict=True))
        print(f"| {input_len} | {statistics.median(s):.1f} | {statistics.median(n):.1f} | "
              f"{statistics.median(s) / statistics.median(n):.3f} | {pairs} |")


if __name__ == "__main__":
    main()
