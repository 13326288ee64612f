"""A decoder layer's small ops on a CUDA GPU: the fused Triton kernels (sluice_engine.layer_ops, TritonLayerOps)
against the torch path they replace (TorchLayerOps), per op and for one layer's whole set. Prints a markdown table.

    .venv/bin/python benchmarks/fused_kernels.py                 # CUDA only; elsewhere it says so and exits 0
    .venv/bin/python benchmarks/fused_kernels.py --batches 1 16 64 256 --json out.json

Workload (fixed seed 0): Llama-3.1-8B's shapes in bf16 -- hidden 4096, 32 query / 8 KV heads of 128, MLP 14336,
llama3-scaled rotary (theta 500000) at random positions below 8192 -- at batch (tokens per step) 1 and 64:

- add_rms_norm: residual + x, then RMSNorm of the sum (both outputs), [B, 4096];
- rotary: Q and K heads of a fused QKV output [B, 6144] rotated (the Triton kernel in place);
- silu_and_mul: silu(gate) * up from [B, 28672];
- layer: what one decode layer runs of them: add_rms_norm, rotary, add_rms_norm, silu_and_mul.

Reported per row: median time in microseconds two ways -- eager (triton.testing.do_bench: CUDA events around each
call, L2 flushed; includes the gaps while the CPU launches the next kernel, which is how the engine runs today)
and replayed from a CUDA graph (launch cost gone: what remains is the kernels' own time) -- the GPU kernels one
call launches (torch.profiler), and the max abs difference between the two outputs relative to the largest
reference value, so a wrong kernel cannot post a number (bf16: <= 1e-2 expected). No figures are claimed here:
run it on the GPU you care about. The kernels' correctness on CPU: tests/engine/test_layer_ops_triton.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import torch

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 4096, 32, 8, 128, 14336
ROPE = (500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192})
EPS = 1e-5
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64], help="tokens per step")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="no GPU: each fused op once in Triton's interpreter (fp32) against the torch ops; no timing")
    return p.parse_args()


class LayerInputs:
    """One layer's activations at batch b: what each op reads, fresh per call where an op writes in place."""

    def __init__(self, b: int, dtype: torch.dtype, gen: torch.Generator, device: str = "cuda"):
        from sluice_engine.layer_ops.rotary import RotaryEmbedding

        def randn(*shape):
            return torch.randn(*shape, generator=gen).to(device, dtype)

        self.x, self.residual, self.attn_out = randn(b, HIDDEN), randn(b, HIDDEN), randn(b, HIDDEN)
        self.weight = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(device, dtype)
        self.qkv = randn(b, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
        self.gate_up = randn(b, 2 * INTER)
        rope = RotaryEmbedding(HEAD_DIM, 8192, ROPE[0], ROPE[1]).to(device)
        self.cos_sin = rope(torch.randint(0, 8192, (b,), generator=gen).to(device))

    def qk(self) -> torch.Tensor:
        return self.qkv[:, : (HEADS + KV_HEADS) * HEAD_DIM].view(-1, HEADS + KV_HEADS, HEAD_DIM)


def op_calls(ops, inp: LayerInputs) -> dict[str, Callable[[], torch.Tensor]]:
    """Each op as a no-argument call returning its (main) output. The rotary calls rotate a copy-free view of
    the fused QKV (in place for Triton: rotating again each repetition changes values, not cost)."""

    def add_rms_norm():
        return ops.fused_add_rms_norm(inp.x, inp.residual, inp.weight, EPS)[0]

    def rotary():
        return ops.rotary(inp.qk(), inp.cos_sin)

    def silu_and_mul():
        return ops.silu_and_mul(inp.gate_up)

    def layer():
        h, res = ops.fused_add_rms_norm(inp.x, inp.residual, inp.weight, EPS)
        ops.rotary(inp.qk(), inp.cos_sin)
        h, res = ops.fused_add_rms_norm(inp.attn_out, res, inp.weight, EPS)
        return ops.silu_and_mul(inp.gate_up)

    return {"add_rms_norm": add_rms_norm, "rotary": rotary, "silu_and_mul": silu_and_mul, "layer": layer}


def eager_us(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3


def graph_us(fn, reps: int = 200) -> float | None:
    """Mean time of one call replayed from a CUDA graph (None if the call cannot be captured)."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):  # warm-up on a side stream, as capture requires
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / reps
    except RuntimeError as e:
        print(f"  (CUDA graph capture failed: {e})", file=sys.stderr)
        return None


def kernels_launched(fn) -> int | None:
    """GPU kernels (and memsets/copies) one call launches, from torch.profiler's device-side events."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)
    except RuntimeError as e:
        print(f"  (profiler failed: {e})", file=sys.stderr)
        return None


def run_batch(b: int, dtype: torch.dtype, torch_ops, triton_ops) -> list[dict]:
    # Two copies of the same inputs: the Triton rotary writes in place, the torch one does not.
    inp_ref = LayerInputs(b, dtype, torch.Generator().manual_seed(0))
    inp_fused = LayerInputs(b, dtype, torch.Generator().manual_seed(0))
    ref_calls, fused_calls = op_calls(torch_ops, inp_ref), op_calls(triton_ops, inp_fused)
    rows = []
    for name in ref_calls:
        ref, fused = ref_calls[name], fused_calls[name]
        want, got = ref().float(), fused().float()  # first calls: both see the same fresh inputs
        rel_err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
        row = {"op": name, "batch": b, "rel_err": rel_err,
               "unfused_us": eager_us(ref), "fused_us": eager_us(fused),
               "unfused_graph_us": graph_us(ref), "fused_graph_us": graph_us(fused),
               "unfused_kernels": kernels_launched(ref), "fused_kernels": kernels_launched(fused)}
        rows.append(row)
    return rows


def _fmt(v, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def cpu_smoke() -> int:
    """Each op once in Triton's interpreter, fp32, batch 2, against the torch ops: the script's control flow and
    the kernels' agreement, with no timing (the interpreter is not a GPU)."""
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
    from sluice_engine.layer_ops.torch_ops import TorchLayerOps
    from sluice_engine.layer_ops.triton_ops import TritonLayerOps

    ref = op_calls(TorchLayerOps(), LayerInputs(2, torch.float32, torch.Generator().manual_seed(0), "cpu"))
    fused = op_calls(TritonLayerOps(), LayerInputs(2, torch.float32, torch.Generator().manual_seed(0), "cpu"))
    worst = 0.0
    for name in ref:
        want, got = ref[name]().float(), fused[name]().float()
        err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
        worst = max(worst, err)
        print(f"interpreter: {name} batch 2 fp32: rel err {err:.1e}")
    print("OK" if worst <= 1e-5 else "FAILED")
    return 0 if worst <= 1e-5 else 1


def main() -> int:
    args = parse_args()
    if args.cpu_smoke:
        return cpu_smoke()
    if not torch.cuda.is_available():
        print("benchmarks/fused_kernels.py needs CUDA: no GPU here, nothing measured (--cpu-smoke checks the "
              "kernels in Triton's interpreter; tests/engine/test_layer_ops_triton.py too)", file=sys.stderr)
        return 2
    import triton

    from sluice_engine.layer_ops.torch_ops import TorchLayerOps
    from sluice_engine.layer_ops.triton_ops import TritonLayerOps

    props = torch.cuda.get_device_properties(0)
    print(f"GPU: {props.name}; torch {torch.__version__}; triton {triton.__version__}; {args.dtype}", flush=True)
    dtype = DTYPES[args.dtype]
    torch_ops, triton_ops = TorchLayerOps(), TritonLayerOps()
    rows = []
    print("\n| op | batch | unfused µs | fused µs | × | unfused µs (graph) | fused µs (graph) | × (graph) "
          "| kernels unfused → fused | rel err |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for b in args.batches:
        for r in run_batch(b, dtype, torch_ops, triton_ops):
            rows.append(r)
            graph_x = (r["unfused_graph_us"] / r["fused_graph_us"]
                       if r["unfused_graph_us"] and r["fused_graph_us"] else None)
            flag = "" if r["rel_err"] <= 1e-2 else " MISMATCH"
            print(f"| {r['op']} | {b} | {r['unfused_us']:.1f} | {r['fused_us']:.1f} | "
                  f"{r['unfused_us'] / r['fused_us']:.2f} | {_fmt(r['unfused_graph_us'], '.2f')} | "
                  f"{_fmt(r['fused_graph_us'], '.2f')} | {_fmt(graph_x, '.2f')} | "
                  f"{_fmt(r['unfused_kernels'], 'd')} → {_fmt(r['fused_kernels'], 'd')} | {r['rel_err']:.1e}{flag} |",
                  flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": props.name, "dtype": args.dtype, "rows": rows}, f, indent=1)
    return 1 if any(r["rel_err"] > 1e-2 for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
