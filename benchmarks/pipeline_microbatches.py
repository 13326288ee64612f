"""What pipeline micro-batches buy: offline generation throughput of the bundled model with one
process (PP 1), two pipeline stages stepping one micro-batch at a time (PP 2, serial), and two stages
with one micro-batch per stage in flight (PP 2, the default: virtual engines).

    .venv/bin/python benchmarks/pipeline_microbatches.py --batch 16 --repeats 3     # ~3 min on 2 cores

B requests (fixed prompts) decode 32 tokens each, greedy; every configuration must produce the same
tokens. Reports tokens/s (median of the repeats) and the ratios. On a CPU the stages share the
machine's cores (each rank takes cores / ranks threads), so PP 2 serial leaves one rank's cores idle
while the other works; micro-batches fill them. On GPUs each stage has its own devices.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time

from sluice_engine.bench.machine import cpu_name, load_average
from sluice_engine.distributed.parallel_state import destroy_distributed
from sluice_engine.entrypoints.llm import LLM
from sluice_engine.executor import executor as executor_mod
from sluice_engine.sampling_params import SamplingParams


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(pp: int, serial: bool, batch: int, repeats: int) -> tuple[list[float], list[list[int]]]:
    real = executor_mod.Executor.max_in_flight
    if serial:  # one step in flight (and so one virtual engine): stages take turns
        executor_mod.Executor.max_in_flight = property(lambda self: 1)
    try:
        llm = LLM(None, kv_cache_memory=256 << 20, pipeline_parallel_size=pp, master_port=free_port())
        prompts = [f"Story number {i}: once upon a time, in a land far away, there lived" for i in range(batch)]
        params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up
        rates, tokens = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = llm.generate(prompts, params)
            rates.append(batch * 32 / (time.perf_counter() - t0))
            tokens = [o.token_ids for o in out]
        llm.engine.shutdown()
        destroy_distributed()
        return rates, tokens
    finally:
        executor_mod.Executor.max_in_flight = real


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    print(f"CPU: {cpu_name()}; load average before: {load_average()}")
    configs = {"PP 1": (1, False), "PP 2 serial": (2, True), "PP 2 micro-batches": (2, False)}
    results, reference = {}, None
    for name, (pp, serial) in configs.items():
        rates, tokens = run(pp, serial, args.batch, args.repeats)
        if reference is None:
            reference = tokens
        assert tokens == reference, f"{name}: tokens differ from PP 1"
        results[name] = statistics.median(rates)
        print(f"{name:20s} {results[name]:7.1f} tok/s  (repeats: {', '.join(f'{r:.1f}' for r in rates)})")
    base = results["PP 1"]
    serial = results["PP 2 serial"]
    micro = results["PP 2 micro-batches"]
    print(f"PP 2 serial / PP 1: {serial / base:.2f}x   PP 2 micro-batches / PP 1: {micro / base:.2f}x   "
          f"micro-batches / serial: {micro / serial:.2f}x   (batch {args.batch}, tokens identical)")
    print(f"load average after: {load_average()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_name(), "batch": args.batch, "tok_s": results}, f, indent=2)


if __name__ == "__main__":
    main()
