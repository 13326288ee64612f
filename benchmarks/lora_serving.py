"""Issue 26's LoRA throughput check, in one sitting: output tok/s of the offline engine with every request on the
base model, against the same requests spread round-robin over 1, 4 and 16 adapters (rank 16 on all seven
projections, random weights written here in PEFT's format), and with more adapters than slots (16 adapters, 4
slots: the swapping cost). Every engine is loaded once and run alternately, `--reps` times; medians.

    .venv/bin/python benchmarks/lora_serving.py                 # the bundled model (fp32 HF weights) on CPU
    .venv/bin/python benchmarks/lora_serving.py --model /tmp/llama8b --requests 64 --max-tokens 64   # a GPU
    python benchmarks/lora_serving.py --model /dev/shm/llama8b --token-ids --requests 32 --max-tokens 64 \
        --kv-cache-memory 2G --reps 2        # a GPU, a random model (benchmarks/gpu_check.sh --part features)

On a GPU the CPU paths' variants (the torch path, its product per run) are left out. --token-ids: prompts of
random token ids, for a model whose tokenizer knows no words (benchmarks/random_model.py's).

The base-only figure is measured on the engine with LoRA on (slots allocated, no request on an adapter) and on
one without it, so the cost of the LoRA layers themselves shows too.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from sluice_engine.entrypoints.llm import LLM
from sluice_engine.lora.adapter import PROJECTIONS, projection_shape
from sluice_engine.model_config import ModelConfig
from sluice_engine.model_fetch import resolve_model
from sluice_engine.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,", "Once upon a time",
           "Explain what a KV cache is.", "List three prime numbers:", "def fibonacci(n):", "Translate 'cat' to French:"]


def write_adapter(out: Path, mc: ModelConfig, rank: int, seed: int) -> Path:
    """A PEFT-format LoRA adapter with random weights on every projection of every layer."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS), "bias": "none"}))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(mc.num_layers):
        for proj in PROJECTIONS:
            fan_in, fan_out = projection_shape(mc, proj)
            part = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="an HF directory (default: the bundled model's fp32 weights)")
    p.add_argument("--requests", type=int, default=32, help="all sent at once (concurrency = requests)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", default="auto")
    p.add_argument("--kv-cache-memory", default=None, help="per engine (three are loaded at once), e.g. 2G")
    p.add_argument("--token-ids", action="store_true", help="prompts of random token ids (a random model)")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args()
    from sluice_engine.config import parse_size

    model = str(a.model or resolve_model(None))
    mc = ModelConfig.from_dir(Path(model))
    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    names = [f"a{i}" for i in range(16)]
    mods = [f"{n}={write_adapter(tmp / n, mc, a.rank, i)}" for i, n in enumerate(names)]
    kw = dict(max_num_seqs=a.requests, max_model_len=512, device=a.device,
              kv_cache_memory=parse_size(a.kv_cache_memory) if a.kv_cache_memory else None)
    engines = {
        "no LoRA": LLM(model, **kw),
        "LoRA on, 16 slots": LLM(model, enable_lora=True, lora_modules=mods, max_loras=16, max_lora_rank=a.rank, **kw),
        "LoRA on, 4 slots": LLM(model, enable_lora=True, lora_modules=mods, max_loras=4, max_lora_rank=a.rank, **kw),
    }
    # (requests on, engine, adapters, the CPU path): "" is the default (on CPU in fp32, the C++ kernel,
    # lora/cpu_ops.py); "torch" the torch path's grouped products (lora/ops.py), "per run" its product per run of
    # adapter tokens (round-robin adapters: one per token), to compare the three in one sitting.
    cases = [("base only", "no LoRA", 0, ""), ("base only", "LoRA on, 16 slots", 0, ""),
             ("1 adapter", "LoRA on, 16 slots", 1, ""), ("4 adapters", "LoRA on, 16 slots", 4, ""),
             ("4 adapters", "LoRA on, 16 slots", 4, "torch"), ("4 adapters", "LoRA on, 16 slots", 4, "per run"),
             ("16 adapters", "LoRA on, 16 slots", 16, ""), ("16 adapters", "LoRA on, 4 slots", 16, "")]
    on_cpu = engines["no LoRA"].engine.runner.device.type == "cpu"
    if not on_cpu:
        cases = [c for c in cases if not c[3]]
    from sluice_engine.worker import model_runner

    grouped_above = model_runner.MAX_LORA_RUNS_UNGROUPED
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    if a.token_ids:  # 8-24 random ids each, seeded (ids 0-2 are the random models' special tokens)
        g = random.Random(0)
        prompts = [[g.randrange(3, mc.vocab_size) for _ in range(8 + i % 17)] for i in range(a.requests)]
    else:
        prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(a.requests)]
    times: dict[int, list[float]] = {i: [] for i in range(len(cases))}
    loads0 = {}
    for rep in range(a.reps + 1):  # the first round warms every engine up and is not counted
        for i, (_, engine, k, path) in enumerate(cases):
            llm = engines[engine]
            model_runner.MAX_LORA_RUNS_UNGROUPED = 10**9 if path == "per run" else grouped_above
            model_runner.LORA_CPU_KERNEL = not path
            lora = [names[j % k] for j in range(a.requests)] if k else None
            if rep == 1 and llm.engine.lora_slots is not None:
                loads0.setdefault(engine, llm.engine.lora_slots.loads)
            t = time.perf_counter()
            llm.generate(prompts, params, lora=lora)
            if rep:
                times[i].append(time.perf_counter() - t)
    from sluice_engine.bench.machine import cpu_name

    print(f"# {cpu_name()}, {os.cpu_count()} cores; {model}; {a.requests} requests at once x {a.max_tokens} tokens, "
          f"rank {a.rank}, median of {a.reps}")
    print(f"{'requests on':<14} {'engine':<20} {'CPU path':<9} {'tok/s':>8} {'vs base':>8}")
    base = a.requests * a.max_tokens / statistics.median(times[1])  # base only, LoRA on (case 1 on every device)
    rows = []
    for i, (what, engine, _, path) in enumerate(cases):
        tps = a.requests * a.max_tokens / statistics.median(times[i])
        rows.append({"requests_on": what, "engine": engine, "path": path or "default", "tok_per_s": tps,
                     "vs_base": tps / base})
        print(f"{what:<14} {engine:<20} {path or 'default':<9} {tps:8.1f} {tps / base:7.2f}x")
    swaps = engines["LoRA on, 4 slots"].engine.lora_slots.loads - loads0.get("LoRA on, 4 slots", 0)
    print(f"adapter loads into slots with 16 adapters on 4 slots: {swaps} in {a.reps} runs")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "swaps": swaps}, indent=1))


if __name__ == "__main__":
    main()
