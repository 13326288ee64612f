"""Decode step time with the CPU attention's length grouping on and off (torch backend).

    .venv/bin/python benchmarks/decode_grouping.py --batch 32        # ~2 min on 2 cores

B requests with prompts of uniform random length (30-400 tokens) decode 40 tokens each. The padded
short-query path either pads every sequence to the batch's longest context (grouping off) or splits
the batch into groups of similar length (on, the default: GROUP_COST_ROWS). Rounds alternate off/on;
each round re-runs the same prompts (served from the prefix cache after the first) and reports the
median decode-step time; the tokens of each on round must equal the off round before it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from sluice_engine.attention import torch_paged
from sluice_engine.entrypoints.llm import LLM
from sluice_engine.sampling_params import SamplingParams

OFF = 10**12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="off/on pairs")
    args = ap.parse_args()
    default_cost = torch_paged.GROUP_COST_ROWS
    llm = LLM(None, kv_cache_memory=512 << 20, attention_backend="torch")  # the grouping is the torch path's
    eng = llm.engine
    rng = random.Random(0)
    base = llm.tokenizer.encode("The history of the city goes back many centuries, and its people " * 40)
    prompts = [[1000 + i] + base[: rng.randint(30, 400)] for i in range(args.batch)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    results: dict[str, list[float]] = {"off": [], "on": []}
    previous: dict[str, list[int]] = {}
    for r in range(2 * args.rounds + 1):
        mode = "off" if r % 2 else "on"
        torch_paged.GROUP_COST_ROWS = OFF if mode == "off" else default_cost
        for i, p in enumerate(prompts):
            eng.add_request(f"{r}-{i}", p, params)
        steps, tokens = [], {}
        while eng.has_unfinished():
            decoding = all(q.num_computed_tokens >= q.num_prompt_tokens for q in eng.scheduler.running) \
                and not eng.scheduler.waiting
            t = time.perf_counter()
            for o in eng.step():
                tokens.setdefault(o.request_id.split("-")[1], []).extend(o.new_token_ids)
            if decoding:
                steps.append(time.perf_counter() - t)
        if r == 0:
            continue  # warm-up: fills the prefix cache, so every measured round prefills the same way
        results[mode].append(statistics.median(steps) * 1e3)
        if mode == "on":
            assert tokens == previous, "grouping changed the greedy tokens"
        previous = tokens
    off, on = statistics.median(results["off"]), statistics.median(results["on"])
    print(f"batch {args.batch}, decode step median: grouping off {off:.1f} ms, on {on:.1f} ms "
          f"({off / on:.2f}x); rounds off {[round(x, 1) for x in results['off']]}, "
          f"on {[round(x, 1) for x in results['on']]}")


if __name__ == "__main__":
    main()
