"""CUDA graphs of decode steps (issue 15) on a GPU: the same greedy tokens and logprobs as --enforce-eager,
every pure-decode step replayed, and the decode step time with and without graphs.

    .venv/bin/python benchmarks/cuda_graphs_check.py                 # bundled model, float32, ~2 min
    .venv/bin/python benchmarks/cuda_graphs_check.py --dtype bfloat16

Two engines on one GPU (graphs, then --enforce-eager), one after the other, each running the same
workload per batch size: B prompts of the bundled chat template (fixed list), max_tokens --tokens, greedy,
logprobs 3. Step time: the median wall time of steps in which every request decodes (torch.cuda
synchronized each step by the sampler's host read). Exits 1 when tokens differ or a logprob differs by
more than --tol (split-KV counts differ between the two paths: float rounding only).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from sluice_engine.config import EngineConfig
from sluice_engine.engine.llm_engine import LLMEngine
from sluice_engine.sampling_params import SamplingParams

TOPICS = ["the sea", "a mountain", "rain", "bread", "a clock", "the moon", "a river", "winter"]


def run(engine: LLMEngine, batch: int, tokens: int) -> tuple[dict, list[float], int]:
    """Outputs by request, decode step times, and how many steps replayed a graph."""
    replays = 0
    graphs = engine.runner.graphs
    if graphs is not None:
        inner = graphs.replay

        def counted(n):
            nonlocal replays
            replays += 1
            return inner(n)

        graphs.replay = counted
    params = SamplingParams(max_tokens=tokens, temperature=0, logprobs=3, ignore_eos=True)
    outs: dict[str, tuple[list[int], list]] = {}
    for i in range(batch):
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": f"Write about {TOPICS[i % 8]} ({i})."}])
        engine.add_request(f"{batch}-{i}", prompt, params)
        outs[f"{batch}-{i}"] = ([], [])
    times = []
    while engine.has_unfinished():
        decoding = all(r.num_computed_tokens == r.num_tokens - 1 for r in engine.scheduler.running)
        decoding = decoding and not engine.scheduler.waiting
        start = time.perf_counter()
        for out in engine.step():
            outs[out.request_id][0].extend(out.new_token_ids)
            outs[out.request_id][1].extend(out.logprobs)
        if decoding:
            times.append(time.perf_counter() - start)
    if graphs is not None:
        graphs.replay = inner
    return outs, times, replays


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batches", default="1,3,8,20,64", help="comma-separated batch sizes")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--tol", type=float, default=1e-3)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")]
    results = {}
    for eager in (False, True):
        engine = LLMEngine(EngineConfig(device="cuda", dtype=args.dtype, enforce_eager=eager,
                                        max_num_seqs=max(batches), kv_cache_memory=2 << 30))
        assert (engine.runner.graphs is None) == eager, "graphs were not captured"
        results[eager] = {b: run(engine, b, args.tokens) for b in batches}
        del engine
        torch.cuda.empty_cache()
    ok = True
    print(f"{'batch':>5} {'eager ms':>9} {'graphs ms':>9} {'speed-up':>8} {'replayed':>9}  tokens  max |dlogprob|")
    for b in batches:
        g_out, g_times, replays = results[False][b]
        e_out, e_times, _ = results[True][b]
        same = all(g_out[r][0] == e_out[r][0] for r in e_out)
        diff = max((abs(g[0] - e[0]) for r in e_out for g, e in zip(g_out[r][1], e_out[r][1], strict=False)),
                   default=0.0)
        ok &= same and diff <= args.tol and replays >= len(g_times)
        ge, gg = statistics.median(e_times) * 1e3, statistics.median(g_times) * 1e3
        print(f"{b:>5} {ge:>9.2f} {gg:>9.2f} {ge / gg:>7.2f}x {replays:>4}/{len(g_times):<4}  "
              f"{'same' if same else 'DIFFER'}  {diff:.2e}")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
