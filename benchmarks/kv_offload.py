"""Issue 28's offload-tier check, in one sitting: time to first token for a workload of long shared prefixes (a
chat or agent fleet's system prompts) served in rotation by an engine whose KV cache holds only a few of them,
with the offload tier (--kv-offload-bytes) and without it (every rotation recomputes its prefix). Both engines are
loaded once and take the rotation alternately, request by request; TTFT is the time of a request with one output
token (the engine idle otherwise), so it is the prompt's prefill: recomputed, or loaded from the tier.

    .venv/bin/python benchmarks/kv_offload.py                        # the bundled model on CPU, its default path
    .venv/bin/python benchmarks/kv_offload.py --prefix-tokens 2000 --prefixes 8 --rounds 4
    python benchmarks/kv_offload.py --model /dev/shm/llama8b --token-ids --prefix-tokens 4000 \
        --kv-cache-memory 1600MiB --kv-offload-bytes 6GiB      # a GPU, a random model (benchmarks/gpu_check.sh)

--token-ids: prompts of random token ids instead of words, for a model whose tokenizer knows no words (the
random models of benchmarks/random_model.py would read every word as the one unknown token, so every prefix
would be the same prefix, served from the cache).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

from sluice_engine.entrypoints.llm import LLM
from sluice_engine.sampling_params import SamplingParams

WORDS = ("river stone maple cloud lantern harbor meadow copper violet summit orchard falcon ember willow "
         "glacier prairie thistle canyon beacon").split()


def prefix(i: int, tokens: int) -> str:
    """A distinct system prompt of about `tokens` tokens (two per word)."""
    return f"System prompt {i}. " + " ".join(f"{WORDS[(i * 7 + j) % len(WORDS)]}{j % 13}" for j in range(tokens // 2))


def prefix_ids(i: int, tokens: int, vocab: int) -> list[int]:
    """A distinct prefix of exactly `tokens` random token ids (seeded by i), avoiding the special ids 0-2."""
    g = random.Random(i)
    return [g.randrange(3, vocab) for _ in range(tokens)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--prefix-tokens", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3, help="rotations over the prefixes; the first is not counted")
    p.add_argument("--kv-cache-memory", default="48MiB", help="the device pool: a few prefixes' worth")
    p.add_argument("--kv-offload-bytes", default="1GiB")
    p.add_argument("--token-ids", action="store_true", help="prompts of random token ids (a random model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--json")
    a = p.parse_args()
    from sluice_engine.config import parse_size

    common = dict(kv_cache_memory=parse_size(a.kv_cache_memory), max_model_len=a.prefix_tokens + 256,
                  device=a.device)
    engines = {"offload tier": LLM(a.model, kv_offload_bytes=parse_size(a.kv_offload_bytes), **common),
               "recompute": LLM(a.model, **common)}
    params = SamplingParams(max_tokens=1, temperature=0)
    vocab = engines["recompute"].engine.runner.model_config.vocab_size
    ttft: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list[list[int]]] = {name: [] for name in engines}
    for r in range(a.rounds):
        for i in range(a.prefixes):
            if a.token_ids:  # the prefix, then a question of its own (16 ids)
                prompt = prefix_ids(i, a.prefix_tokens, vocab) + prefix_ids(10**6 + 100 * r + i, 16, vocab)
            else:
                prompt = f"{prefix(i, a.prefix_tokens)}\nUser {r}-{i}: summarise the above in one word."
            for name, llm in engines.items():
                t = time.perf_counter()
                out = llm.generate([prompt], params)[0]
                if r:
                    ttft[name].append(time.perf_counter() - t)
                    tokens[name].append(out.token_ids)
    from sluice_engine.bench.machine import cpu_name

    kv = engines["offload tier"].engine.kv
    blocks = engines["offload tier"].engine.kv.num_blocks
    print(f"# {cpu_name()}, {os.cpu_count()} cores; {a.prefixes} prefixes x ~{a.prefix_tokens} tokens in rotation, "
          f"{a.rounds - 1} counted rounds; device pool {blocks} blocks ({blocks * 16} tokens)")
    print(f"{'engine':<14} {'TTFT p50 ms':>12} {'p90 ms':>8} {'prefix hits (tokens)':>21}")
    rows = {}
    for name, llm in engines.items():
        xs = sorted(ttft[name])
        p50, p90 = statistics.median(xs) * 1e3, xs[int(0.9 * (len(xs) - 1))] * 1e3
        rows[name] = {"ttft_p50_ms": p50, "ttft_p90_ms": p90, "prefix_hits": llm.engine.kv.prefix_hits}
        print(f"{name:<14} {p50:12.1f} {p90:8.1f} {llm.engine.kv.prefix_hits:21d}")
    tier = engines["offload tier"].engine.runner.kv_tier
    print(f"tier: {kv.offload.stored} blocks stored, {kv.offload.loaded} loaded ({kv.offload_hits} tokens), "
          f"{tier.store_seconds * 1e3 / max(kv.offload.stored, 1):.3f} ms/block to store, "
          f"{tier.load_seconds * 1e3 / max(kv.offload.loaded, 1):.3f} ms/block to load")
    speedup = rows["recompute"]["ttft_p50_ms"] / rows["offload tier"]["ttft_p50_ms"]
    same = tokens["offload tier"] == tokens["recompute"]
    print(f"TTFT p50 recompute / tier: {speedup:.2f}x; first tokens identical: {same}")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "speedup": speedup, "same_tokens": same}, indent=1))


if __name__ == "__main__":
    main()
