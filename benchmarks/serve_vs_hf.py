"""Output tokens/s of `sluice serve` vs HF transformers `generate` with static batching.

Same model weights (fp32), same machine, same torch thread count, one run. Prints a markdown table for
docs/BENCHMARKS.md and, with --profile, where one batch-16 decode step of the engine spends its time.

    .venv/bin/python benchmarks/serve_vs_hf.py --profile                # default workload, ~7 min on 2 cores
    .venv/bin/python benchmarks/serve_vs_hf.py --repeats 3 --profile    # median of 3 (~18 min): for the docs
    .venv/bin/python benchmarks/serve_vs_hf.py --num-requests 16 --num-requests-c1 1 --max-output 64  # quick

The machine this was written on is a noisy shared VM: the same run varies by up to ~30%, so each row
reports how much CPU other processes took meanwhile, and --repeats N keeps each row's median run.

Workload (fixed seed, spelled out below): for each concurrency level C a seeded list of requests; each
request is a window of `prompt_len` token ids cut at a random offset from a freshly shuffled stream of
varied natural-text paragraphs (CORPUS), with its own `max_tokens`. Greedy decoding with ignore_eos, so
both systems generate exactly `max_tokens` tokens per request.

- sluice: `sluice serve` subprocess (or --url). Streaming POST /v1/completions with the prompt as token
  ids. C client workers each take the next request (like vLLM's bench serve --max-concurrency C).
  Output tok/s = generated tokens / wall time of the run. TTFT and TPOT per request from the stream.
- HF: `AutoModelForCausalLM.from_pretrained(dir, dtype=torch.float32)` and `generate`. C = 1: each
  request alone with its own max_new_tokens. C > 1: static batching: consecutive groups of C requests,
  left-padded into one `generate` call that runs to the group's largest max_tokens (min_new_tokens ==
  max_new_tokens so EOS never ends a row early); only each request's requested tokens count as output.
  TTFT/TPOT are what a streaming client would see (from a streamer's per-step timestamps), measured
  from the start of the request's `generate` call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sluice_engine.bench.corpus import CORPUS  # the paragraphs prompts are cut from
from sluice_engine.bench.machine import CpuMeter, cpu_name  # other processes' CPU share; the CPU model

# -- workload ------------------------------------------------------------------------------------
SEED = 0
NUM_REQUESTS = 32  # per concurrency level > 1 (2 static batches of 16)
NUM_REQUESTS_C1 = 4  # at concurrency 1: one token/step, so these dominate the runtime
CONCURRENCY = (1, 16)
# Prompt length: lognormal, median 100 tokens, clipped to [32, 256].
PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_MIN, PROMPT_MAX = 100, 0.5, 32, 256
# Output length (max_tokens, generated exactly): lognormal, median 64 tokens (mean ~85), clipped to
# [16, 256] -- the long tail of a chat workload, which is what static batching pays for.
OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_MIN, OUTPUT_MAX = 64, 0.8, 16, 256
THREADS = 2  # torch intra-op threads, both systems

SLUICE, HF = "sluice serve", "HF transformers generate"


@dataclass(slots=True)
class BenchRequest:
    index: int
    prompt_ids: list[int]
    max_tokens: int


@dataclass(slots=True)
class RequestResult:
    index: int  # position in the workload (results are kept in completion order)
    prompt_tokens: int
    output_tokens: int  # useful (requested) tokens this request received
    ttft_s: float | None
    tpot_s: float | None  # mean time per output token after the first
    latency_s: float


@dataclass(slots=True)
class RunResult:
    system: str
    concurrency: int
    num_requests: int
    output_tokens: int
    wall_s: float
    computed_tokens: int  # tokens the system generated, padding rows of static batches included
    cached_prompt_tokens: int = 0
    other_cpu_pct: float | None = None  # CPU the rest of the machine used during the run (contention)
    repeat: int = 0
    requests: list[RequestResult] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s


def lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma))))


def make_workload(encode, seed: int, concurrency: int, n: int, max_output: int, repeat: int = 0) -> list[BenchRequest]:
    """Lengths are deterministic per (seed, concurrency); prompt text per (seed, concurrency, repeat).
    Every prompt starts with a header naming (level, repeat, index), so no two prompts share their first
    KV block and sluice's prefix cache never hits (HF has none); repeats keep the lengths; sluice and HF
    get the same list."""
    lengths = random.Random(f"serve_vs_hf-{seed}-{concurrency}")
    text = random.Random(f"serve_vs_hf-{seed}-{concurrency}-{repeat}")
    paragraphs = [encode(p) for p in CORPUS]
    sep = encode("\n\n")
    reqs = []
    for i in range(n):
        plen = lognormal_int(lengths, PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_MIN, PROMPT_MAX)
        olen = lognormal_int(lengths, OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_MIN, max(OUTPUT_MIN, max_output))
        order = paragraphs[:]
        text.shuffle(order)
        stream: list[int] = []
        for p in order:
            stream += p + sep
        head = encode(f"Excerpt {concurrency}.{repeat}.{i}:\n")
        start = text.randrange(len(stream) - plen)
        reqs.append(BenchRequest(i, head + stream[start : start + plen - len(head)], olen))
    return reqs


# -- sluice serve --------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, threads: int, extra: list[str], log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "sluice_engine.entrypoints.cli", "serve", "--model", str(model_dir), "--port", str(port),
           "--log-level", "warning", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    print(f"starting: {shlex.join(cmd)}  (log: {log_path})", flush=True)
    with open(log_path, "w") as logf:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(url: str, proc: subprocess.Popen | None, timeout: float, log_path: Path | None) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log_path.read_text()[-3000:] if log_path else ""
            raise RuntimeError(f"sluice serve exited with {proc.returncode} before ready:\n{tail}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}/ready did not answer 200 within {timeout:.0f}s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def _one_request(client, url: str, req: BenchRequest) -> tuple[RequestResult, int]:
    body = {"prompt": req.prompt_ids, "max_tokens": req.max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times: list[float] = []
    usage = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"request {req.index}: HTTP {resp.status_code}: {(await resp.aread())[:500]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"request {req.index}: {chunk['error']}")
            if chunk.get("choices"):
                times.append(time.perf_counter())  # one chunk per generated token
            if chunk.get("usage"):
                usage = chunk["usage"]
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else len(times)
    if n != req.max_tokens:
        raise RuntimeError(f"request {req.index}: asked for {req.max_tokens} tokens, got {n}")
    cached = (usage or {}).get("prompt_tokens_details", {}).get("cached_tokens", 0) or 0
    ttft = times[0] - t0 if times else None
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    return RequestResult(req.index, len(req.prompt_ids), n, ttft, tpot, end - t0), cached


async def _run_sluice_level(url: str, reqs: list[BenchRequest], concurrency: int) -> RunResult:
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    results: list[tuple[RequestResult, int]] = []
    it = iter(reqs)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:

        async def worker() -> None:
            for req in it:  # shared iterator: each worker takes the next request when it is free
                results.append(await _one_request(client, url, req))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    out = sum(r.output_tokens for r, _ in results)
    return RunResult(SLUICE, concurrency, len(reqs), out, wall, out,
                     cached_prompt_tokens=sum(c for _, c in results), requests=[r for r, _ in results])


WARMUP = BenchRequest(-1, list(range(1000, 1040)), 8)


def sluice_warmup(url: str) -> None:
    asyncio.run(_run_sluice_level(url, [WARMUP, WARMUP], 2))


def sluice_level(url: str, reqs: list[BenchRequest], concurrency: int, meter: CpuMeter | None) -> RunResult:
    """meter: None for a server started elsewhere (--url), whose CPU use would count as contention."""
    print(f"sluice serve: concurrency {concurrency}, {len(reqs)} requests ...", flush=True)
    if meter is not None:
        meter.start()
    run = asyncio.run(_run_sluice_level(url, reqs, concurrency))
    run.other_cpu_pct = meter.other_pct() if meter is not None else None
    print(f"  {run.output_tokens} tokens in {run.wall_s:.1f}s = {run.tok_s:.1f} tok/s"
          f"{_contention(run.other_cpu_pct)}", flush=True)
    return run


def _contention(pct: float | None) -> str:
    return "" if pct is None else f" (other processes used {pct:.0f}% of the machine's CPU meanwhile)"


# -- HF transformers -----------------------------------------------------------------------------
class _StepClock:
    """A generate() streamer that only records when each decoding step's tokens exist."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # the first put is the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _hf_generate(model, batch: list[BenchRequest], pad_id: int):
    import torch

    width = max(len(r.prompt_ids) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):  # left padding
        ids[row, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
        mask[row, width - len(r.prompt_ids) :] = 1
    steps = max(r.max_tokens for r in batch)
    clock = _StepClock()
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                         do_sample=False, pad_token_id=pad_id, streamer=clock)
    end = time.perf_counter()
    generated = out.shape[1] - width
    if generated != steps or len(clock.times) != steps:
        raise RuntimeError(f"HF generate made {generated} tokens ({len(clock.times)} steps), expected {steps}")
    results = []
    for r in batch:
        n = r.max_tokens
        tpot = (clock.times[n - 1] - clock.times[0]) / (n - 1) if n > 1 else None
        results.append(RequestResult(r.index, len(r.prompt_ids), n, clock.times[0] - t0, tpot, end - t0))
    return results, steps * len(batch)


class HFRunner:
    def __init__(self, model_dir: Path, threads: int):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        from sluice_engine.models.gguf_checkpoint import hf_dense_dir

        self.model = AutoModelForCausalLM.from_pretrained(str(hf_dense_dir(model_dir)), dtype=torch.float32).eval()
        pad_id = self.model.generation_config.pad_token_id
        if pad_id is None:
            pad_id = self.model.config.eos_token_id
        self.pad_id = int(pad_id[0] if isinstance(pad_id, list) else pad_id)
        with torch.inference_mode():
            _hf_generate(self.model, [WARMUP, WARMUP], self.pad_id)

    def level(self, reqs: list[BenchRequest], concurrency: int, meter: CpuMeter) -> RunResult:
        import torch

        kind = "batch 1" if concurrency == 1 else f"static batches of {concurrency}"
        print(f"HF generate: {kind}, {len(reqs)} requests ...", flush=True)
        results: list[RequestResult] = []
        computed = 0
        meter.start()
        t0 = time.perf_counter()
        with torch.inference_mode():
            for i in range(0, len(reqs), concurrency):
                res, comp = _hf_generate(self.model, reqs[i : i + concurrency], self.pad_id)
                results += res
                computed += comp
        wall = time.perf_counter() - t0
        out = sum(r.output_tokens for r in results)
        run = RunResult(HF, concurrency, len(reqs), out, wall, computed,
                        other_cpu_pct=meter.other_pct(), requests=results)
        print(f"  {out} tokens ({computed} computed) in {wall:.1f}s = {run.tok_s:.1f} tok/s"
              f"{_contention(run.other_cpu_pct)}", flush=True)
        return run


# -- profile -------------------------------------------------------------------------------------
def profile_engine(model_dir: Path, reqs: list[BenchRequest], batch: int, steps: int, threads: int) -> dict:
    """One in-process engine, `batch` requests: step through the prefill, then time and profile decode
    steps at a full batch. Returns the numbers printed."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from sluice_engine.entrypoints.llm import LLM
    from sluice_engine.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model=str(model_dir))
    eng = llm.engine
    timed, warm = 10, 2
    budget = warm + timed + steps + 4  # nobody finishes while we measure: the batch stays full
    for i, r in enumerate(reqs[:batch]):
        eng.add_request(f"prof-{i}", r.prompt_ids, SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True))
    n = min(batch, len(reqs))
    started: set[str] = set()
    t0 = time.perf_counter()
    prefill_steps = 0
    while len(started) < n:
        started.update(o.request_id for o in eng.step())
        prefill_steps += 1
    prefill_s = time.perf_counter() - t0
    prompt_tokens = sum(len(r.prompt_ids) for r in reqs[:n])

    def full_step() -> None:
        if len(eng.step()) != n:
            raise RuntimeError(f"a decode step produced fewer than {n} tokens: the batch was not full")
    for _ in range(warm):
        eng.step()
    meter = CpuMeter([os.getpid()])
    meter.start()
    t0 = time.perf_counter()
    for _ in range(timed):
        full_step()
    step_ms = (time.perf_counter() - t0) / timed * 1e3
    other = meter.other_pct()

    # Label the phases of a step (instance attributes shadow the methods; engine code is untouched).
    runner = eng.runner
    phases = {
        "phase: scheduler.schedule": (eng.scheduler, "schedule"),
        "phase: runner.execute (all)": (runner, "execute"),
        "phase: model.forward": (runner.model, "forward"),
        "phase: model.compute_logits": (runner.model, "compute_logits"),
        "phase: sampler": (runner, "sampler"),
        "phase: engine._process (detokenize, stops)": (eng, "_process"),
        # The C++ CPU kernels are ctypes calls, invisible to the op table: label them too.
        f"phase: attention ({runner.backend.name} backend, all layers)": (type(runner.backend), "attend"),
    }
    from sluice_engine.cpu_kernels.linear import PackedLinear

    if any(isinstance(m, PackedLinear) for m in runner.model.modules()):
        phases["phase: C++ GEMM (PackedLinear: every linear layer and the output layer)"] = (PackedLinear, "forward")

    def labelled(label, fn):
        def call(*a, **k):
            with record_function(label):
                return fn(*a, **k)
        return call

    for label, (obj, name) in phases.items():
        setattr(obj, name, labelled(label, getattr(obj, name)))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function("phase: engine.step (total)"):
                full_step()
    ka = prof.key_averages()
    by_key = {e.key: e for e in ka}
    total_us = by_key["phase: engine.step (total)"].cpu_time_total / steps
    print(f"\n## Profile: one decode step at batch {n} (in-process engine, {threads} threads)\n")
    print(f"prefill of {n} prompts ({prompt_tokens} tokens): {prefill_steps} steps, {prefill_s:.2f}s "
          f"= {prompt_tokens / prefill_s:.0f} prompt tok/s")
    # Bytes a decode step reads: every weight but an embedding table the output layer does not use
    # (untied models); a tied output layer reads the table itself, and so does the C++ path's packed one.
    model = runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if isinstance(model.embed_tokens, torch.nn.Embedding) and model.lm_head is not None:
        weight_bytes -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    print(f"decode step at batch {n}, unprofiled mean of {timed}: {step_ms:.1f} ms "
          f"= {n / step_ms * 1e3:.1f} tok/s ceiling for this batch; weights {weight_bytes / 1e6:.0f} MB "
          f"read once per step = {weight_bytes / step_ms / 1e6:.2f} GB/s{_contention(other)}")
    print(f"\nprofiled steps: {steps}, mean {total_us / 1e3:.1f} ms/step (profiler overhead included)\n")
    print("| phase | ms/step | % of step |")
    print("|---|---:|---:|")
    phase_rows = []
    for label in ["phase: engine.step (total)", *phases]:
        e = by_key.get(label)
        if e is None:
            continue
        ms = e.cpu_time_total / steps / 1e3
        phase_rows.append({"phase": label.removeprefix("phase: "), "ms_per_step": ms})
        print(f"| {label.removeprefix('phase: ')} | {ms:.1f} | {100 * e.cpu_time_total / steps / total_us:.0f}% |")
    print(f"\nTop ops by self CPU time ({steps} steps):\n")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=48))
    ops = sorted((e for e in ka if not e.key.startswith("phase: ")), key=lambda e: e.self_cpu_time_total,
                 reverse=True)[:15]
    return {
        "batch": n, "prefill_s": prefill_s, "prefill_prompt_tokens": prompt_tokens, "decode_step_ms": step_ms,
        "weight_bytes": weight_bytes, "other_cpu_pct": other, "phases": phase_rows,
        "top_ops": [{"op": e.key, "calls": e.count, "self_cpu_ms_per_step": e.self_cpu_time_total / steps / 1e3}
                    for e in ops],
    }


# -- report --------------------------------------------------------------------------------------
def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(run: RunResult) -> dict:
    ttft = [r.ttft_s for r in run.requests if r.ttft_s is not None]
    tpot = [r.tpot_s for r in run.requests if r.tpot_s is not None]
    return {
        "system": run.system, "concurrency": run.concurrency, "requests": run.num_requests,
        "output_tokens": run.output_tokens, "computed_tokens": run.computed_tokens, "wall_s": run.wall_s,
        "output_tok_s": run.tok_s, "cached_prompt_tokens": run.cached_prompt_tokens,
        "ttft_mean_s": statistics.fmean(ttft) if ttft else None, "ttft_median_s": _pct(ttft, 0.5),
        "ttft_p99_s": _pct(ttft, 0.99), "tpot_median_s": _pct(tpot, 0.5), "other_cpu_pct": run.other_cpu_pct,
    }


def median_run(runs: list[RunResult], system: str, concurrency: int) -> RunResult | None:
    """The run of median output tok/s among the repeats of one system at one level."""
    xs = sorted((r for r in runs if r.system == system and r.concurrency == concurrency), key=lambda r: r.tok_s)
    return xs[(len(xs) - 1) // 2] if xs else None


def print_table(runs: list[RunResult]) -> None:
    print("| system | concurrency | requests | output tokens | wall s | output tok/s | mean TTFT ms "
          "| median TTFT ms | p99 TTFT ms | median TPOT ms | other procs' CPU |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for run in runs:
        s = summarize(run)
        conc = f"{run.concurrency} (static batch)" if run.system == HF and run.concurrency > 1 else str(run.concurrency)
        print(f"| {run.system} | {conc} | {s['requests']} | {s['output_tokens']} | {s['wall_s']:.1f} "
              f"| {s['output_tok_s']:.1f} | {_ms(s['ttft_mean_s'])} | {_ms(s['ttft_median_s'])} "
              f"| {_ms(s['ttft_p99_s'])} | {_ms(s['tpot_median_s'])} "
              f"| {'-' if run.other_cpu_pct is None else f'{run.other_cpu_pct:.0f}%'} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model dir (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--url", default=None, help="use this running sluice server instead of starting one")
    ap.add_argument("--num-requests", type=int, default=NUM_REQUESTS, help="requests per run at concurrency > 1")
    ap.add_argument("--num-requests-c1", type=int, default=NUM_REQUESTS_C1, help="requests per run at concurrency 1")
    ap.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)),
                    help="comma-separated concurrency levels (HF: static batch size)")
    ap.add_argument("--max-output", type=int, default=OUTPUT_MAX, help="clip of the output-length distribution")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--threads", type=int, default=THREADS, help="torch threads for HF and the server")
    ap.add_argument("--systems", default="sluice,hf", help="comma-separated: sluice, hf (default both); none: only --profile")
    ap.add_argument("--server-args", default="", help="extra flags for `sluice serve`, e.g. '--max-num-seqs 32'")
    ap.add_argument("--repeats", type=int, default=1,
                    help="repeat every run; the table shows each row's median run (the machine is noisy)")
    ap.add_argument("--profile", action="store_true", help="then profile one batch-16 decode step of the engine")
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--json", default=None, help="write raw results here")
    args = ap.parse_args(argv)

    from tokenizers import Tokenizer

    from sluice_engine.model_fetch import resolve_model

    model_dir = resolve_model(args.model)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    systems = {s.strip() for s in args.systems.split(",")}
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    workloads = {c: make_workload(encode, args.seed, c, args.num_requests_c1 if c == 1 else args.num_requests,
                                  args.max_output) for c in levels}
    import torch
    import transformers

    print(f"model: {model_dir} (fp32, CPU)\nmachine: {cpu_name()}, {os.cpu_count()} CPUs; torch {torch.__version__}, "
          f"transformers {transformers.__version__}, {args.threads} threads; seed {args.seed}")
    for c, reqs in workloads.items():
        p = [len(r.prompt_ids) for r in reqs]
        o = [r.max_tokens for r in reqs]
        print(f"concurrency {c}: {len(reqs)} requests, prompt tokens mean {statistics.fmean(p):.0f} "
              f"[{min(p)}-{max(p)}], output tokens mean {statistics.fmean(o):.0f} [{min(o)}-{max(o)}], "
              f"total output {sum(o)}")
    print(flush=True)

    runs: list[RunResult] = []
    t_start = time.perf_counter()
    proc = log_path = url = None
    try:
        if "sluice" in systems:
            url = args.url
            if url is None:
                log_path = Path(tempfile.gettempdir()) / f"serve_vs_hf-sluice-{os.getpid()}.log"
                proc, url = start_server(model_dir, args.threads, shlex.split(args.server_args), log_path)
            url = url.rstrip("/")
            wait_ready(url, proc, 600, log_path)
            sluice_warmup(url)
        hf = HFRunner(model_dir, args.threads) if "hf" in systems else None
        meter = CpuMeter([os.getpid()] + ([proc.pid] if proc is not None else []))
        # Interleaved by level, so each ratio compares runs made minutes apart, not a whole run apart.
        # The idle server blocks on its queue and takes no CPU while HF runs.
        for rep in range(args.repeats):
            for c, reqs in workloads.items():
                if rep:
                    reqs = make_workload(encode, args.seed, c, len(reqs), args.max_output, repeat=rep)
                level_runs = []
                if url is not None:
                    level_runs.append(sluice_level(url, reqs, c, meter if proc is not None else None))
                if hf is not None:
                    level_runs.append(hf.level(reqs, c, meter))
                for run in level_runs:
                    run.repeat = rep
                runs += level_runs
    finally:
        if proc is not None:
            stop_server(proc)
    del hf
    elapsed = time.perf_counter() - t_start

    cmd = shlex.join([".venv/bin/python", "benchmarks/serve_vs_hf.py", *(sys.argv[1:] if argv is None else argv)])
    print(f"\n## sluice serve vs HF transformers generate ({model_dir.name}, fp32, CPU)\n")
    print(f"command: `{cmd}` ({elapsed:.0f}s of runs)\n")
    shown = [r for r in (median_run(runs, sys_, c) for c in levels for sys_ in (SLUICE, HF)) if r is not None]
    print_table(shown)
    print()
    if args.repeats > 1:
        print(f"- each row is the median-throughput run of {args.repeats} repeats; output tok/s of all repeats:")
        for r in shown:
            all_ = [f"{x.tok_s:.1f}" for x in runs if x.system == r.system and x.concurrency == r.concurrency]
            print(f"  - {r.system}, concurrency {r.concurrency}: {', '.join(all_)}")
    for c in levels:
        s = median_run(runs, SLUICE, c)
        h = median_run(runs, HF, c)
        if s and h:
            useful = f"; HF static batching computed {h.computed_tokens} tokens, " \
                     f"{100 * h.output_tokens / h.computed_tokens:.0f}% of them requested" if c > 1 else ""
            print(f"- concurrency {c}: sluice / HF = {s.tok_s / h.tok_s:.2f}x output tok/s{useful}")
    busy = [r.other_cpu_pct for r in shown if r.other_cpu_pct is not None and r.other_cpu_pct > 5]
    if busy:
        print(f"- WARNING: other processes used up to {max(busy):.0f}% of the machine's CPU during the runs "
              "shown; these numbers are skewed by contention (rerun on a quiet machine, or use --repeats)")
    cached = sum(r.cached_prompt_tokens for r in runs)
    if any(r.system == SLUICE for r in runs):
        print(f"- prompt tokens served from sluice's prefix cache: {cached}")

    prof = None
    if args.profile:
        prof_reqs = workloads.get(16) or make_workload(encode, args.seed, 16, 16, args.max_output)
        prof = profile_engine(model_dir, prof_reqs, 16, args.profile_steps, args.threads)
        ceiling = prof["batch"] / prof["decode_step_ms"] * 1e3
        s16 = median_run(runs, SLUICE, 16)
        if s16 is not None:
            ptoks = sum(r.prompt_tokens for r in s16.requests)
            rate = prof["prefill_prompt_tokens"] / prof["prefill_s"]
            print(f"\nsluice serve at concurrency 16: {s16.tok_s:.1f} tok/s = {100 * s16.tok_s / ceiling:.0f}% of the "
                  f"decode-only ceiling above ({ceiling:.1f} tok/s). The rest: prefill ({ptoks} prompt tokens at "
                  f"~{rate:.0f} tok/s is ~{ptoks / rate:.0f}s of the {s16.wall_s:.0f}s run, stalling the batch), "
                  "the tail with fewer than 16 requests left, and HTTP/streaming overhead")

    if args.json:
        data = {
            "command": cmd, "model": str(model_dir), "cpu": cpu_name(), "threads": args.threads, "seed": args.seed,
            "summary": [summarize(r) for r in runs], "runs": [asdict(r) for r in runs],
            "workloads": {str(c): [{"prompt_tokens": len(r.prompt_ids), "max_tokens": r.max_tokens} for r in reqs]
                          for c, reqs in workloads.items()},
            "profile": prof,
        }
        Path(args.json).write_text(json.dumps(data, indent=1))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
