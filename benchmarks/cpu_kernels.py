"""The engine's C++ CPU kernels against the torch paths they replace, on SmolLM2-135M's shapes.

    .venv/bin/python benchmarks/cpu_kernels.py            # ~1 min on 2 cores
    MKL_ENABLE_INSTRUCTIONS=AVX2 .venv/bin/python benchmarks/cpu_kernels.py --extra-cflags=-mno-avx512f
                                                          # an AVX2 machine, emulated on an AVX-512 one

GEMM: the 30 decoder layers' four matmuls (qkv 576->960, o 576->576, gate_up 576->3072, down
1536->576) and the output layer (576->49152) at M rows, F.linear (MKL) vs PackedLinear (gemm.cpp),
random weights of the model's shapes, median of 7 rounds. Attention: one layer's decode attention at
batch B with contexts of 100-330 tokens in shuffled blocks, the torch reference (gather + SDPA) vs the
cpu backend's kernel, median of 60 calls. Both kernels' outputs are checked against torch's.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F

from sluice_engine import cpu_kernels
from sluice_engine.attention.backend import select_backend
from sluice_engine.bench.machine import cpu_name
from sluice_engine.cpu_kernels.linear import PackedLinear
from sluice_engine.forward_context import AttentionMetadata

LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out)
LAYERS = 30
VOCAB = 49152


def _median_ms(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _torch_layers(weights, xs) -> None:
    for layer in weights:
        for w in layer:
            F.linear(xs[w.shape[1]], w)


def _kernel_layers(packed, xs) -> None:
    for layer in packed:
        for p in layer:
            p(xs[p.in_features])


def gemm(rows: list[int], rounds: int) -> None:
    lib = cpu_kernels.load()
    if lib is None or not lib.sluice_gemm_available():
        print("GEMM: not available here (needs a C++ compiler and AVX-512)")
        return
    g = torch.Generator().manual_seed(0)
    weights = [[torch.randn(o, i, generator=g) * 0.02 for i, o in LAYER_SHAPES] for _ in range(LAYERS)]
    packed = [[PackedLinear(w, None, lib) for w in layer] for layer in weights]
    head = torch.randn(VOCAB, 576, generator=g) * 0.02
    packed_head = PackedLinear(head, None, lib)
    print("| rows | layers F.linear ms | layers C++ GEMM ms | speed-up | output layer F.linear ms | C++ GEMM ms | speed-up |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for m in rows:
        xs = {i: torch.randn(m, i, generator=g) for i, _ in LAYER_SHAPES}
        for w, p in zip(weights[0], packed[0], strict=True):
            torch.testing.assert_close(p(xs[w.shape[1]]), F.linear(xs[w.shape[1]], w), atol=1e-4, rtol=1e-4)

        a = _median_ms(partial(_torch_layers, weights, xs), rounds)
        b = _median_ms(partial(_kernel_layers, packed, xs), rounds)
        c = _median_ms(partial(F.linear, xs[576], head), rounds)
        d = _median_ms(partial(packed_head, xs[576]), rounds)
        print(f"| {m} | {a:.1f} | {b:.1f} | {a / b:.2f}x | {c:.2f} | {d:.2f} | {c / d:.2f}x |")


def attention(batches: list[int], calls: int) -> None:
    cpu = select_backend("auto", torch.device("cpu"))
    if cpu.name != "cpu":
        print("attention: the cpu backend is not available here")
        return
    ref = select_backend("torch", torch.device("cpu"))
    hq, hkv, d, bs = 9, 3, 64, 16
    print("\n| batch | contexts | torch (gather + SDPA) us/layer | C++ kernel us/layer | speed-up |")
    print("|---:|---|---:|---:|---:|")
    for b in batches:
        rng = random.Random(b)
        lens = [rng.randint(100, 330) for _ in range(b)]
        num_blocks = sum(-(-n // bs) for n in lens) + 1
        cache = torch.randn(2, num_blocks, bs, hkv, d)
        free = list(range(1, num_blocks))
        rng.shuffle(free)
        tables = [[free.pop() for _ in range(-(-n // bs))] for n in lens]
        slots = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens, strict=True)]
        meta = AttentionMetadata.build([1] * b, lens, tables, slots, bs, torch.device("cpu"))
        q = torch.randn(b, hq, d)
        want = ref.attend(q, None, None, cache, meta, d**-0.5)
        meta.per_step.clear()
        torch.testing.assert_close(cpu.attend(q, None, None, cache, meta, d**-0.5), want, atol=1e-5, rtol=1e-5)
        t_ref = _median_ms(partial(ref.attend, q, None, None, cache, meta, d**-0.5), calls) * 1e3
        t_cpu = _median_ms(partial(cpu.attend, q, None, None, cache, meta, d**-0.5), calls) * 1e3
        print(f"| {b} | {min(lens)}-{max(lens)} tokens | {t_ref:.0f} | {t_cpu:.0f} | {t_ref / t_cpu:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,8,16,32,64,256,2048")
    ap.add_argument("--batches", default="1,8,16,32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--isa", default=None, choices=list(cpu_kernels.ISAS),
                    help="the kernel level to run (as SLUICE_CPU_ISA; default: this CPU's best), e.g. avx2 for the "
                         "AVX2 path on an AVX-512 CPU; pair it with MKL_ENABLE_INSTRUCTIONS=AVX2 in the environment "
                         "so that F.linear is held to the same instruction set")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.isa:
        os.environ["SLUICE_CPU_ISA"] = args.isa
    print(f"kernel level {cpu_kernels.selected_isa()}; MKL_ENABLE_INSTRUCTIONS="
          f"{os.environ.get('MKL_ENABLE_INSTRUCTIONS', '(unset)')}")
    print(f"machine: {cpu_name()}, {args.threads} torch threads, torch {torch.__version__}\n")
    lib = cpu_kernels.load()
    if lib is not None:
        print(f"GEMM panel width {lib.sluice_gemm_panel_width()} (32: AVX-512 path, 16: AVX2/AArch64 path)\n")
    gemm([int(r) for r in args.rows.split(",")], args.rounds)
    attention([int(b) for b in args.batches.split(",")], 60)


if __name__ == "__main__":
    main()
