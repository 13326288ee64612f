"""Weight-only quantized GEMM on a CUDA GPU: the Triton FP8 (e4m3, per-channel scales) and AWQ (4-bit, group 128)
kernels of sluice_engine.quant beside bf16 torch.matmul on the same shapes. Prints a markdown table.

    .venv/bin/python benchmarks/quant_gpu.py                  # CUDA only; elsewhere it says so and exits 2
    .venv/bin/python benchmarks/quant_gpu.py --cpu-smoke      # no GPU: the kernels once in Triton's interpreter
    .venv/bin/python benchmarks/quant_gpu.py --json out.json

Workload (fixed seed 0): the linear layers of Llama-3.1-8B, y[M, N] = x[M, K] @ W^T with
(K, N) in (4096, 4096) o_proj, (4096, 14336) gate/up, (14336, 4096) down, (4096, 6144) fused qkv, at
M = 1, 16 (decode batches), 256 and 4096 (prefill). Activations bf16, random weights.

- bf16: torch.matmul(x, W^T) with W [N, K] bf16 (cuBLAS).
- fp8: weights e4m3 [N, K] with one fp32 scale per output channel, bf16 activations (W8A16).
- awq: AWQ GEMM layout (qweight [K, N/8], scales [K/G, N] fp16, qzeros [K/G, N/8]), G = 128; the kernel casts
  the dequantized tile to the activation dtype, so the activations here are fp16 (AWQ checkpoints' dtype).
- fp8-scaled-mm (sm90+): the same FP8 weights on cuBLASLt's FP8 tensor cores, activations quantized per token
  (quant/gemm_paths.py: W8A8, checked against the quantized activations' exact product).
- awq-dequant: the AWQ weights dequantized (the reference's torch ops) then a cuBLAS GEMM, per call.
The engine picks among its paths per shape at start-up (quant/gemm_paths.py); these rows show the same choice.

Reported per row: median kernel time (replayed from a CUDA graph, L2 flushed: gpu_timing.py), TFLOP/s
(2 M N K / time), the weight bytes read per call, effective weight bandwidth (weight bytes / time: the number
that matters at small M, where a GEMM is bound by reading W) and the speed-up over bf16. Every row first
checks the kernel against dequantize-then-matmul (max error relative to the output's largest value), so a
wrong kernel cannot post a number. No figures are claimed here: run it on the GPU you care about.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_timing import graph_us  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (4096, 6144)]  # (K, N)
MS = [1, 16, 64, 256, 4096]
GROUP = 128


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ms", type=int, nargs="+", default=MS, help="token counts (GEMM rows)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="no GPU: both kernels at --ms on a small shape in Triton's interpreter (fp16), no timing")
    return p.parse_args()


def _bench(fn) -> float:
    """ms of one call replayed from a CUDA graph, L2 flushed (gpu_timing.graph_us): at decode-sized M an eager
    call's time is its host launch, not the kernel (the H200's first run: 0.08 ms for an fp8 launch whose kernel
    takes a fraction of that)."""
    return graph_us(fn) * 1e-3


def _bench_eager(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100)  # ms, median


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()


def run_shape(k: int, n: int, ms: list[int], gen: torch.Generator) -> list[dict]:
    from sluice_engine.quant import awq, fp8, gemm_paths
    from sluice_engine.quant.triton_gemm import awq_linear, fp8_linear

    dev = torch.device("cuda")
    scaled_mm = torch.cuda.get_device_capability(dev) >= (9, 0)
    w = torch.randn(n, k, generator=gen) * 0.02
    w_bf16 = w.to(dev, torch.bfloat16)
    wq, scale = fp8.quantize_fp8(w, per_channel=True)
    wq, scale = wq.to(dev), scale.to(dev)
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(0, 16, (k // GROUP, n), generator=gen)
    s = (torch.rand(k // GROUP, n, generator=gen) * 0.002 + 1e-4).half()
    aw = awq.AwqWeights(awq.pack_awq(q), s, awq.pack_awq(z)).to(dev)
    w_fp8_dense = fp8.dequantize_fp8(wq, scale)  # [N, K] fp32, the references
    w_awq_dense = aw.dequantize()  # [K, N] fp32
    weight_bytes = {"bf16": n * k * 2, "fp8": n * k + n * 4,
                    "awq": aw.qweight.numel() * 4 + aw.scales.numel() * 2 + aw.qzeros.numel() * 4}
    weight_bytes["fp8-scaled-mm"], weight_bytes["awq-dequant"] = weight_bytes["fp8"], weight_bytes["awq"]
    rows = []
    for m in ms:
        x = torch.randn(m, k, generator=gen).to(dev, torch.bfloat16)
        xh = x.half()
        checks = {"fp8": _rel_err(fp8_linear(x, wq, scale), x.float() @ w_fp8_dense.T),
                  "awq": _rel_err(awq_linear(xh, aw.qweight, aw.scales, aw.qzeros), xh.float() @ w_awq_dense)}
        if scaled_mm:  # against the product of the per-token quantized activations it computes
            xq, sa = gemm_paths.quantize_rows_e4m3(x)
            checks["fp8-scaled-mm"] = _rel_err(gemm_paths.fp8_scaled_mm(x, wq, scale), (xq.float() * sa) @ w_fp8_dense.T)
        checks["awq-dequant"] = _rel_err(gemm_paths.dequant_linear(aw, xh), xh.float() @ w_awq_dense)
        for name, err in checks.items():
            if err > 3e-2:
                raise SystemExit(f"{name} kernel is wrong at M={m} K={k} N={n}: relative error {err:.3g}")
        times = {"bf16": _bench(lambda x=x: torch.matmul(x, w_bf16.T)),
                 "fp8": _bench(lambda x=x: fp8_linear(x, wq, scale)),
                 "awq": _bench(lambda xh=xh: awq_linear(xh, aw.qweight, aw.scales, aw.qzeros)),
                 "awq-dequant": _bench(lambda xh=xh: gemm_paths.dequant_linear(aw, xh))}
        if scaled_mm:
            times["fp8-scaled-mm"] = _bench(lambda x=x: gemm_paths.fp8_scaled_mm(x, wq, scale))
        eager = {"fp8": _bench_eager(lambda x=x: fp8_linear(x, wq, scale))} if m == ms[0] else {}
        for name, ms_ in times.items():
            rows.append({"M": m, "K": k, "N": n, "kernel": name, "ms": ms_, "eager_ms": eager.get(name),
                         "tflops": 2 * m * n * k / (ms_ * 1e-3) / 1e12,
                         "weight_gbps": weight_bytes[name] / (ms_ * 1e-3) / 1e9,
                         "speedup_vs_bf16": times["bf16"] / ms_, "rel_err": checks.get(name, 0.0)})
    return rows


def cpu_smoke(ms: list[int]) -> int:
    """The FP8 and AWQ kernels once per M on K=256, N=128 in Triton's interpreter, fp16 activations (its bf16
    arithmetic is wrong), against dequantize-then-matmul: the script's control flow, no timing."""
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
    from sluice_engine.quant import awq, fp8, gemm_paths
    from sluice_engine.quant.triton_gemm import awq_linear, fp8_linear

    gen = torch.Generator().manual_seed(0)
    k, n = 256, 128
    wq, scale = fp8.quantize_fp8(torch.randn(n, k, generator=gen) * 0.02, per_channel=True)
    q, z = torch.randint(0, 16, (k, n), generator=gen), torch.randint(0, 16, (k // GROUP, n), generator=gen)
    s = (torch.rand(k // GROUP, n, generator=gen) * 0.002 + 1e-4).half()
    aw = awq.AwqWeights(awq.pack_awq(q), s, awq.pack_awq(z))
    worst = 0.0
    for m in ms:
        x = torch.randn(m, k, generator=gen).half()
        errs = {"fp8": _rel_err(fp8_linear(x, wq, scale), x.float() @ fp8.dequantize_fp8(wq, scale).T),
                "awq": _rel_err(awq_linear(x, aw.qweight, aw.scales, aw.qzeros), x.float() @ aw.dequantize()),
                "awq-dequant": _rel_err(gemm_paths.dequant_linear(aw, x), x.float() @ aw.dequantize())}
        xb = x.to(torch.bfloat16)  # torch._scaled_mm runs on CPU too (bf16 out)
        xq, sa = gemm_paths.quantize_rows_e4m3(xb)
        errs["fp8-scaled-mm"] = _rel_err(gemm_paths.fp8_scaled_mm(xb, wq, scale),
                                         (xq.float() * sa) @ fp8.dequantize_fp8(wq, scale).T)
        for name, err in errs.items():
            # bf16 output for the FP8 x FP8 path (~2^-8 relative), fp16 for the rest
            worst = max(worst, err / (1e-2 if name == "fp8-scaled-mm" else 3e-3))
            print(f"interpreter: {name} M={m} K={k} N={n} {'bf16' if name == 'fp8-scaled-mm' else 'fp16'}: "
                  f"rel err {err:.1e}")
    print("OK" if worst <= 1 else "FAILED")
    return 0 if worst <= 1 else 1


def main() -> int:
    args = parse_args()
    if args.cpu_smoke:
        return cpu_smoke(args.ms)
    if not torch.cuda.is_available():
        print("benchmarks/quant_gpu.py needs a CUDA GPU: nothing measured (--cpu-smoke checks the kernels in "
              "Triton's interpreter; tests/engine/test_quant_triton.py too)", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    print(f"GPU: {props.name}, {props.total_memory / 2**30:.0f} GiB; torch {torch.__version__}; "
          f"capability {props.major}.{props.minor}", flush=True)
    if (props.major, props.minor) < (8, 9):
        print("note: FP8 e4m3 conversions need sm89+ (L4, H100, H200); the fp8 rows may fail on this GPU")
    gen = torch.Generator().manual_seed(0)
    rows = []
    print("\n| M | K | N | kernel | ms | TFLOP/s | weight GB/s | x bf16 | rel err |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for k, n in SHAPES:
        for r in run_shape(k, n, args.ms, gen):
            rows.append(r)
            print(f"| {r['M']} | {r['K']} | {r['N']} | {r['kernel']} | {r['ms']:.4f} | {r['tflops']:.1f} | "
                  f"{r['weight_gbps']:.0f} | {r['speedup_vs_bf16']:.2f} | {r['rel_err']:.1e} |", flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": props.name, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
