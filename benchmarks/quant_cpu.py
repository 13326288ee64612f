"""Decode speed and memory of the bundled SmolLM2-135M on CPU: --quantization none (fp32 weights,
dequantized from the GGUF at conversion; PackedLinear) vs q4_1 (the GGUF's own Q4_1 blocks, and its
Q8_0 tied output layer; cpu_kernels/quant_gemm.cpp), in one sitting.

    PYTHONPATH=engine_image .venv/bin/python benchmarks/quant_cpu.py            # ~2 min on 2 cores
    PYTHONPATH=engine_image .venv/bin/python benchmarks/quant_cpu.py --kernels  # the GEMMs alone, ~30 s

--kernels: the 30 decoder layers' four matmuls (576->960, 576->576, 576->3072, 1536->576) at M rows,
PackedLinear (fp32, gemm.cpp) vs GgufBlockLinear (q4_1, quant_gemm.cpp), random weights of the model's
shapes, best of 5 rounds (same process, interleaved per row count).

Workload: B identical-length prompts of 32 tokens (fixed ids, seed 0), greedy, ignore_eos, 65 new tokens
each, B in (1, 8), through `LLM.generate` (the engine's own loop: scheduler, runner, sampler).
Decode tok/s = B * 64 / (time of the 65-token run - time of the 1-token run): the prefill and first
token cancel out. Best of 3 rounds in each of 2 processes per setting, the settings' processes
interleaved (none, q4_1, none, q4_1): the machine's 2 cores are shared, and OpenMP barriers with a
descheduled thread turn a busy neighbour into 10x slower steps, so the best round is the machine's figure. RSS: the process's resident memory after loading (and its peak,
VmHWM, which includes the fp32 weights read before quantizing). Each setting runs in its own process
so one's memory does not show in the other's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

PROMPT_TOKENS, NEW_TOKENS, ROUNDS = 32, 65, 3


def _status_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def run_one(quantization: str, batches: list[int]) -> dict:
    import torch

    from sluice_engine.entrypoints.llm import LLM
    from sluice_engine.sampling_params import SamplingParams

    torch.manual_seed(0)
    t0 = time.perf_counter()
    llm = LLM(device="cpu", quantization=quantization, kv_cache_memory=64 << 20)
    load_s = time.perf_counter() - t0
    import gc

    gc.collect()
    out = {"quantization": quantization, "load_s": load_s, "rss_mib": _status_kib("VmRSS") / 1024,
           "peak_rss_mib": _status_kib("VmHWM") / 1024,
           "weight_mib": sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters()) / 2**20}
    g = torch.Generator().manual_seed(0)
    for b in batches:
        prompts = [torch.randint(100, 40000, (PROMPT_TOKENS,), generator=g).tolist() for _ in range(b)]

        def timed(n: int, b: int = b, prompts: list = prompts) -> float:
            # Prefix caching would make a repeated prompt's prefill free in the second run only: vary one token.
            ps = [[r, *p[1:]] for r, p in zip(torch.randint(100, 40000, (b,)).tolist(), prompts, strict=True)]
            t = time.perf_counter()
            res = llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
            assert all(len(c.token_ids) == n for c in res)
            return time.perf_counter() - t

        timed(4)  # warm-up
        rates = [b * (NEW_TOKENS - 1) / (timed(NEW_TOKENS) - timed(1)) for _ in range(ROUNDS)]
        out[f"decode_tok_s_b{b}"] = max(rates)
    return out


def kernels(rows: list[int]) -> None:
    import torch

    from sluice_engine import cpu_kernels
    from sluice_engine.cpu_kernels.linear import PackedLinear
    from sluice_engine.cpu_kernels.quant import GgufBlockLinear, quantize_weight

    lib = cpu_kernels.load()
    g = torch.Generator().manual_seed(0)
    fp32, q4_1 = [], []
    for k, n in [(576, 960), (576, 576), (576, 3072), (1536, 576)]:
        w = torch.randn(n, k, generator=g) * 0.05
        fp32.append(PackedLinear(w, None, lib))
        q4_1.append(GgufBlockLinear(quantize_weight(w, "q4_1"), "q4_1", k, None, lib))

    def best_ms(layers, xs) -> float:
        def once() -> float:
            t = time.perf_counter()
            for _ in range(30):
                for layer in layers:
                    layer(xs[layer.in_features])
            return time.perf_counter() - t

        once()
        return min(once() for _ in range(5)) * 1e3

    print(f"{'rows':>5}{'fp32 ms':>10}{'q4_1 ms':>10}{'fp32/q4_1':>11}")
    for m in rows:
        xs = {576: torch.randn(m, 576, generator=g), 1536: torch.randn(m, 1536, generator=g)}
        a, b = best_ms(fp32, xs), best_ms(q4_1, xs)
        print(f"{m:>5}{a:>10.1f}{b:>10.1f}{a / b:>10.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default="none,q4_1")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--kernels", action="store_true", help="time the GEMMs alone at several row counts")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one setting, print JSON
    a = p.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    if a.kernels:
        import torch

        from sluice_engine import cpu_kernels
        from sluice_engine.bench.machine import cpu_name

        isa = {2: "AVX-512 VNNI", 1: "AVX2", 0: "plain loops"}[cpu_kernels.load().sluice_quant_isa()]
        print(f"CPU: {cpu_name()}, torch threads {torch.get_num_threads()}, quant kernel path: {isa}")
        kernels([1, 4, 8, 9, 16, 64, 512])
        return
    if a.one:
        print(json.dumps(run_one(a.one, batches)))
        return
    import torch

    from sluice_engine.bench.machine import cpu_name

    print(f"CPU: {cpu_name()}, torch threads {torch.get_num_threads()}, model: bundled SmolLM2-135M-Instruct")
    settings = a.settings.split(",")
    best: dict[str, dict] = {}
    for _ in range(2):
        for q in settings:
            proc = subprocess.run([sys.executable, __file__, "--one", q, "--batches", a.batches],
                                  capture_output=True, text=True, check=True)
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            if q in best:
                for b in batches:
                    r[f"decode_tok_s_b{b}"] = max(r[f"decode_tok_s_b{b}"], best[q][f"decode_tok_s_b{b}"])
            best[q] = r
    rows = [best[q] for q in settings]
    head = (f"{'quantization':<13}{'weights MiB':>12}{'RSS MiB':>9}{'peak RSS':>10}{'load s':>8}"
            + "".join(f"{'decode tok/s b' + str(b):>19}" for b in batches))
    print(head)
    for r in rows:
        print(f"{r['quantization']:<13}{r['weight_mib']:>12.0f}{r['rss_mib']:>9.0f}{r['peak_rss_mib']:>10.0f}"
              f"{r['load_s']:>8.1f}" + "".join(f"{r[f'decode_tok_s_b{b}']:>19.1f}" for b in batches))
    base = rows[0]
    for r in rows[1:]:
        print(f"{r['quantization']} / {base['quantization']}: "
              + ", ".join(f"b{b} x{r[f'decode_tok_s_b{b}'] / base[f'decode_tok_s_b{b}']:.2f}" for b in batches)
              + f", RSS x{r['rss_mib'] / base['rss_mib']:.2f}")


if __name__ == "__main__":
    main()
