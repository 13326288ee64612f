"""Issue 16's serving comparison, in one sitting: sluice serving the bundled model's shipped Q4_1 GGUF, llama.cpp's
llama-server on the very same file, and sluice on the fp32 weights (--quantization none), loaded by one
client (`sluice bench --compare`) with the same prompts at concurrency 1, 8 and 32; and (unless --no-fast) sluice
on the same Q4_1 blocks with `--numerics fast` (the GEMM rounds once per block: faster, not llama.cpp's bits). The bench table has each
server's resident memory (VmRSS at the end of each run) beside its throughput and latencies.

    bash scripts/get-llama-server.sh                       # once: builds .tools/bin/llama-server
    .venv/bin/python benchmarks/quant_serving.py           # ~6 min on 2 cores
    .venv/bin/python benchmarks/quant_serving.py --concurrency 1 --num-requests 16

Every server gets the same threads (--threads, default the machine's cores): llama-server `--threads`,
sluice `OMP_NUM_THREADS`. llama-server runs with `--no-repack`: on CPUs with AMX its AMX matmul, built by
GCC 12, crashes on block-quantized weights (scripts/get-llama-server.sh says why); without repacking it
runs its AVX-512/AVX2 dot products over the file's blocks. Its `--parallel` slots are the top concurrency,
each with the context the bench needs. All three stay up for the whole sitting; one idles while another is
measured. Conversational workload, completions endpoint, greedy, ignore_eos; goodput SLO TTFT <= 2 s,
TPOT <= 500 ms.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from server_process import compare_servers

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--port", type=int, default=18300, help="first of four ports")
    p.add_argument("--llama-server", default=str(ROOT / ".tools/bin/llama-server"))
    p.add_argument("--json", help="the bench's JSON results")
    p.add_argument("--plot-dir")
    p.add_argument("--no-fast", dest="fast", action="store_false",
                   help="leave out sluice q4_1 with --numerics fast (one float rounding per block: not llama.cpp's bits)")
    p.add_argument("--log-dir", default="bench-results/quant-serving-logs")
    a = p.parse_args()

    from sluice_engine.bench.machine import cpu_name
    from sluice_engine.model_fetch import gguf_source

    gguf = gguf_source(None)
    if gguf is None:
        raise SystemExit("the bundled model's GGUF is not here: run `sluice serve` once (it fetches it)")
    if not Path(a.llama_server).exists():
        raise SystemExit(f"{a.llama_server} not found: bash scripts/get-llama-server.sh")
    top = max(int(c) for c in a.concurrency.split(","))
    logs = Path(a.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    sluice = [sys.executable, "-m", "sluice_engine.entrypoints.cli", "serve", "--host", "127.0.0.1", "--log-level", "warning"]
    servers = {
        "sluice-q4_1": ([*sluice, "--port", str(a.port), "--quantization", "q4_1"], env, "/ready"),
        "llama-q4_1": ([a.llama_server, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(a.port + 1),
                        "--threads", str(a.threads), "--parallel", str(top), "--ctx-size", str(2048 * top),
                        "--no-repack", "--no-webui"], env, "/health"),
        "sluice-fp32": ([*sluice, "--port", str(a.port + 2), "--quantization", "none"], env, "/ready"),
    }
    if a.fast:
        servers["sluice-q4_1-fast"] = ([*sluice, "--port", str(a.port + 3), "--quantization", "q4_1", "--numerics",
                                        "fast"], env, "/ready")
    print(f"CPU: {cpu_name()}, {a.threads} threads per server; GGUF {gguf}")
    bench = ["--max-concurrency", a.concurrency, "--num-requests", str(a.num_requests), "--seed", str(a.seed),
             "--slo-ttft-ms", "2000", "--slo-tpot-ms", "500", "--no-progress"]
    if a.json:
        bench += ["--json", a.json]
    if a.plot_dir:
        bench += ["--plot-dir", a.plot_dir]
    sys.exit(compare_servers(servers, a.port, logs, bench, env))

if __name__ == "__main__":
    main()
