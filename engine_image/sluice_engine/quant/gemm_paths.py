"""Which GEMM runs a quantized linear layer, per shape (issue 43): the Triton weight-only kernels (triton_gemm.py),
FP8 on cuBLASLt's FP8 tensor cores (`scaled_mm`: activations quantized to e4m3 per token, `torch._scaled_mm`), or
the weights dequantized and a 16-bit cuBLAS GEMM (`dequant`). Chosen per (format, M bucket, N, K) at start-up by
timing each path on the device (`measure_model`, called by the model runner on CUDA), and logged as a table; a
shape nobody measured (the CPU, Triton's interpreter) takes the Triton kernel.

Why not one path: weight-only kernels win at decode-sized M, where a step reads the weights (FP8 and 4-bit read a
half and a quarter of bf16's bytes), and lose at prefill-sized M, where a step is tensor-core work: there FP8 x FP8
runs at twice bf16's rate, and a 4-bit weight is better dequantized once per call than per tile. Where the crossover
lies depends on the card and the shape; the first H200 run had FP8 W8A16 at 0.26-0.84x bf16 and AWQ at 0.02-0.04x
at M 1 and 16 (docs/BENCHMARKS.md), so it is measured, not guessed.

Numerics: `scaled_mm` quantizes activations (per token: amax / 448), as vLLM does for FP8 checkpoints with dynamic
activation scales; the other two keep them in 16 bits (W8A16 / W4A16). The choice depends only on the shape and the
device, never on the batch's contents, so a step's outputs do not depend on what else is batched beyond M's bucket.
The M buckets are fixed (M_BUCKETS), so a CUDA graph captured at a batch size replays the path measured for it.
SLUICE_QUANT_GEMM=<path> forces one path wherever it applies (tests, benchmarks).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

E4M3_MAX = 448.0
M_BUCKETS = (1, 16, 64, 256, 1024, 4096)
PATHS = {"fp8": ("triton", "scaled_mm", "dequant"), "awq": ("triton", "dequant"), "gptq": ("triton", "dequant")}
FORMAT_OF = {"Fp8Weights": "fp8", "AwqWeights": "awq", "GptqWeights": "gptq"}
# The dequant path is offered to prompt-sized M only: its torch dequantization copies small index tensors to the
# device (not capturable), and a decode batch's M (up to the largest CUDA graph) must take the same path eager and
# replayed. Where dequantizing pays (a GEMM's cost well above one pass over the weights) M is large anyway.
DEQUANT_MIN_M = 257


def m_bucket(m: int) -> int:
    """The measured M a call of M rows takes the path of: the smallest bucket holding it (the last beyond)."""
    return next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])


class GemmTable:
    """(format, M bucket, N, K) -> path, filled by measure_model; `forced` overrides every choice it can."""

    def __init__(self) -> None:
        self.choice: dict[tuple[str, int, int, int], str] = {}
        self.forced: str | None = os.environ.get("SLUICE_QUANT_GEMM") or None

    def pick(self, fmt: str, x: torch.Tensor, n: int, k: int) -> str:
        path = self.forced or self.choice.get((fmt, m_bucket(x.numel() // k), n, k), "triton")
        if path == "scaled_mm" and not scaled_mm_applies(fmt, x, n, k):
            return "triton"
        if path == "dequant" and (x.numel() // k < DEQUANT_MIN_M and not self.forced
                                  or x.is_cuda and torch.cuda.is_current_stream_capturing()):
            return "triton"
        return path


TABLE = GemmTable()  # one per process: the choice depends on the shape and the device only


def scaled_mm_applies(fmt: str, x: torch.Tensor, n: int, k: int) -> bool:
    """FP8 weights, bf16 activations (cuBLASLt's row-wise scaled FP8 GEMM writes bf16), N and K multiples of 16,
    and on CUDA a Hopper or newer (row-wise scales need sm90)."""
    if fmt != "fp8" or x.dtype != torch.bfloat16 or n % 16 or k % 16:
        return False
    return x.device.type != "cuda" or torch.cuda.get_device_capability(x.device) >= (9, 0)


def quantize_rows_e4m3(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scale [M, 1]) with x ~= q * scale, each row's amax mapped to 448."""
    scale = (x2.abs().amax(dim=1, keepdim=True).to(torch.float32) / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (x2.to(torch.float32) / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (bf16) @ (weight [N, K] e4m3 * weight_scale)^T on FP8 tensor cores, x quantized per row."""
    n, k = weight.shape
    lead = x.shape[:-1]
    xq, scale_a = quantize_rows_e4m3(x.reshape(-1, k))
    scale_b = weight_scale.to(torch.float32).reshape(1, -1).expand(1, n).contiguous()  # per tensor: one per column
    y = torch._scaled_mm(xq, weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, n)


def dequant_linear(weights, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T with W dequantized (the weights class's reference, fp32) to x's dtype first: one pass over the weights
    per call, then a dense GEMM."""
    w = weights.dequantize().to(x.dtype)
    if type(weights).__name__ in ("AwqWeights", "GptqWeights"):  # their reference is W^T [K, N]
        y = x @ w
        return y + bias if bias is not None else y
    return F.linear(x, w, bias)


def cuda_ms(fn: Callable[[], object], reps: int = 10) -> float:
    """Median milliseconds of fn on the current CUDA stream (after two warm-up calls)."""
    fn()
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def measure_model(model: torch.nn.Module, max_m: int, dtype: torch.dtype, device: torch.device,
                  timer: Callable[[Callable[[], object]], float] = cuda_ms, table: GemmTable = TABLE) -> list[dict]:
    """Times every applicable path of each distinct (format, N, K) among the model's QuantLinear layers at each M
    bucket up to max_m (random activations), fills `table` with the fastest, and logs the table. Returns its rows."""
    from .linear import QuantLinear

    if table.forced:  # the user chose (SLUICE_QUANT_GEMM): nothing to measure
        log.info("quantized GEMMs: every shape takes %s where it applies (SLUICE_QUANT_GEMM)", table.forced)
        return []
    layers: dict[tuple[str, int, int], QuantLinear] = {}
    for mod in model.modules():
        if isinstance(mod, QuantLinear) and type(mod.weights).__name__ in FORMAT_OF:
            layers.setdefault((FORMAT_OF[type(mod.weights).__name__], mod.out_features, mod.in_features), mod)
    rows = []
    g = torch.Generator(device=device).manual_seed(0)
    for (fmt, n, k), layer in sorted(layers.items()):
        for m in (b for b in M_BUCKETS if b <= max(1, m_bucket(max_m))):
            x = torch.randn(m, k, generator=g, device=device, dtype=dtype)
            times = {}
            try:
                for path in PATHS[fmt]:
                    if path == "dequant" and m < DEQUANT_MIN_M:
                        continue
                    table.forced = path
                    if table.pick(fmt, x, n, k) != path:
                        continue  # does not apply here (scaled_mm off Hopper, or not bf16)
                    times[path] = timer(lambda x=x, layer=layer: layer(x))
            finally:
                table.forced = None
            best = min(times, key=times.get)
            table.choice[(fmt, m, n, k)] = best
            rows.append({"format": fmt, "m": m, "n": n, "k": k, "ms": times, "path": best})
    if rows:
        log.info("quantized GEMM paths by shape, measured on %s:\n%s", device, format_table(rows))
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [f"{'format':<6} {'M':>5} {'N':>6} {'K':>6}  path        " + "  ".join(f"{p:>10}" for p in PATHS["fp8"])]
    for r in rows:
        ms = "  ".join(f"{r['ms'][p]:9.3f}m" if p in r["ms"] else f"{'-':>10}" for p in PATHS["fp8"])
        lines.append(f"{r['format']:<6} {r['m']:>5} {r['n']:>6} {r['k']:>6}  {r['path']:<10}  {ms}")
    return "\n".join(lines)
