"""The Triton paged-attention kernels on a CUDA GPU: decode HBM bandwidth and prefill TFLOP/s, beside
torch SDPA on the same shapes. One command, a few minutes; prints markdown tables for docs/BENCHMARKS.md.

    .venv/bin/python benchmarks/attention_kernels.py                 # CUDA: the default grid (~1-2 min)
    .venv/bin/python benchmarks/attention_kernels.py --json out.json
    .venv/bin/python benchmarks/attention_kernels.py --cpu-smoke     # no GPU: tiny correctness run in
                                                                     # Triton's interpreter (~10 s)
    .venv/bin/python benchmarks/attention_kernels.py --prefill-sweep # CUDA: prefill tiles, warps and stages

Workload (fixed seed 0): a Llama-3-8B-like attention layer by default (32 query heads over 8 KV heads,
head_dim 128, bf16, KV block size 16). K/V are random, written once into a paged cache whose blocks are
shuffled, so each sequence's blocks are scattered like a long-running server's. The same numbers are
also kept dense ([B, Hkv, L, D]) for SDPA.

- Decode: batch B x context L, one query token per sequence. Bytes = K and V of every context token
  (B x L x Hkv x D x 2 x itemsize) + Q read + O written; achieved bandwidth = bytes / kernel time, and
  the share of the GPU's peak HBM bandwidth (--peak-tbps; known for H200/H100/A100). The Triton row
  uses the launch the engine would choose (`kernel_buckets.choose_attention_launch`). SDPA reads dense, unpaged K/V with
  enable_gqa: the bar for a kernel that also walks block tables.
- Prefill: B sequences of `new` tokens over `cached` tokens already in the cache (cached 0: a plain
  prompt). FLOPs = 4 x Hq x D x (query, key) pairs under the causal mask. SDPA gets the same dense
  tensors with a bottom-right causal mask (`is_causal` when nothing is cached; K/V repeated per query
  head if this torch's SDPA takes no enable_gqa with that mask).
- Every row also checks the Triton output against SDPA's (max abs error), so a wrong kernel cannot post a
  number.
- `--prefill-sweep` (issue 43: prefill tuned for Hopper): instead of the above, the prefill shapes of SWEEP_SHAPES
  under each of PREFILL_CONFIGS (query rows per tile, warps, pipeline stages; the keys per tile are the launch
  set's one BLOCK_N), the engine's default first: TFLOP/s of each, the best per shape and its gain over the
  default, beside SDPA. What it finds goes into the engine's defaults (or a per-device table); with
  `--cpu-smoke`, each config's tile once in the interpreter against the torch reference.

Timing: `triton.testing.do_bench` (CUDA events, median over ~100 ms of repetitions, L2 flushed between).
Decode rows are also timed replayed from a CUDA graph (`graph_us`), as the engine runs decode: eager, a small
decode launch costs its host-side launch (~0.2 ms of Python and driver work for the split kernel and its merge,
measured on the H200) and the GPU idles meanwhile, so `do_bench` alone measures the host there. The bandwidth
columns use the graph time: the kernel's own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_timing import graph_us  # noqa: E402

PEAK_TBPS = {"H200": 4.8, "H100": 3.35, "H800": 3.35, "A100": 2.0, "L40S": 0.864, "A10": 0.6, "L4": 0.3}
DECODE_BATCHES = [1, 16, 64, 128]
DECODE_CONTEXTS = [1024, 4096, 16384]
# (batch, new tokens, cached tokens)
PREFILL_SHAPES = [(1, 1024, 0), (1, 4096, 0), (4, 2048, 0), (16, 512, 0), (8, 512, 3584), (32, 128, 1920)]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# (query rows per tile, num_warps, num_stages); None: the engine's default launch (PREFILL_BLOCK_M, its warps and
# stages). A Hopper wants 128-row tiles, 8 warps and 3-4 stages (FlashAttention-3's and Triton's tutorial choices).
PREFILL_CONFIGS = [None, (64, 4, 3), (64, 8, 3), (128, 8, 2), (128, 8, 3), (128, 8, 4), (128, 4, 3)]
SWEEP_SHAPES = [(1, 4096, 0), (4, 2048, 0), (1, 16384, 0), (8, 512, 3584)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--peak-tbps", type=float, default=None, help="peak HBM TB/s (default: from the GPU's name)")
    p.add_argument("--decode-batches", type=int, nargs="+", default=DECODE_BATCHES, metavar="B")
    p.add_argument("--decode-contexts", type=int, nargs="+", default=DECODE_CONTEXTS, metavar="L",
                   help="context lengths of the decode grid (default: %(default)s)")
    p.add_argument("--decode-only", action="store_true")
    p.add_argument("--prefill-only", action="store_true")
    p.add_argument("--prefill-sweep", action="store_true",
                   help="only the prefill tile / warps / stages sweep (PREFILL_CONFIGS over SWEEP_SHAPES)")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="no GPU: a tiny decode + prefill in Triton's interpreter against the torch reference")
    return p.parse_args()


# -- shapes to tensors ---------------------------------------------------------------------------
class PagedBatch:
    """B sequences with `cached` + `new` tokens each: dense K/V, the same K/V in a shuffled paged cache,
    and the query rows of the new tokens."""

    def __init__(self, b: int, new: int, cached: int, hq: int, hkv: int, d: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, seed: int = 0):
        g = torch.Generator(device=device).manual_seed(seed)
        seq_len = cached + new
        blocks_per_seq = -(-seq_len // block_size)
        num_blocks = b * blocks_per_seq
        self.k = torch.randn(b, hkv, seq_len, d, generator=g, device=device, dtype=dtype)
        self.v = torch.randn(b, hkv, seq_len, d, generator=g, device=device, dtype=dtype)
        self.q = torch.randn(b, hq, new, d, generator=g, device=device, dtype=dtype)
        perm = torch.randperm(num_blocks, generator=g, device=device)
        self.block_tables = perm.view(b, blocks_per_seq).to(torch.int32)
        self.cache = torch.empty(2, num_blocks, block_size, hkv, d, device=device, dtype=dtype)
        pos = torch.arange(seq_len, device=device)
        slots = (self.block_tables[:, pos // block_size].long() * block_size + pos % block_size).reshape(-1)
        flat = self.cache.view(2, num_blocks * block_size, hkv, d)
        flat[0, slots] = self.k.transpose(1, 2).reshape(-1, hkv, d)
        flat[1, slots] = self.v.transpose(1, 2).reshape(-1, hkv, d)
        self.q_flat = self.q.transpose(1, 2).reshape(b * new, hq, d)
        self.query_start_loc = torch.arange(0, b * new + 1, new, device=device, dtype=torch.int32)
        self.seq_lens = torch.full((b,), seq_len, device=device, dtype=torch.int32)
        self.b, self.new, self.cached, self.seq_len = b, new, cached, seq_len
        self.scale = d**-0.5
        self._expanded: tuple[torch.Tensor, torch.Tensor] | None = None  # K/V repeated per query head

    def triton(self, tk, launch=None, **kw) -> torch.Tensor:
        """launch: a kernel_buckets.AttentionLaunch (None: the wrapper's unsplit default); kw: num_warps, num_stages."""
        out = tk.paged_attention(self.q_flat, self.cache[0], self.cache[1], self.query_start_loc, self.seq_lens,
                                 self.block_tables, self.new, self.scale, launch=launch, **kw)
        return out.view(self.b, self.new, *out.shape[1:]).transpose(1, 2)  # [B, Hq, new, D]

    def sdpa(self) -> torch.Tensor:
        if self.cached == 0 and self.new > 1:
            return F.scaled_dot_product_attention(self.q, self.k, self.v, is_causal=True, scale=self.scale,
                                                  enable_gqa=True)
        if self.new == 1:  # decode: the one query sees every key
            return F.scaled_dot_product_attention(self.q, self.k, self.v, scale=self.scale, enable_gqa=True)
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(self.new, self.seq_len)
        if self._expanded is None:
            try:  # not every torch passes enable_gqa through a CausalBias mask
                return F.scaled_dot_product_attention(self.q, self.k, self.v, attn_mask=mask, scale=self.scale,
                                                      enable_gqa=True)
            except (TypeError, RuntimeError):
                group = self.q.shape[1] // self.k.shape[1]
                self._expanded = (self.k.repeat_interleave(group, 1), self.v.repeat_interleave(group, 1))
        k, v = self._expanded
        return F.scaled_dot_product_attention(self.q, k, v, attn_mask=mask, scale=self.scale)

    def causal_pairs(self) -> int:
        """(query, key) pairs under the causal mask: query i of `new` sees cached + i + 1 keys."""
        return self.b * (self.new * self.cached + self.new * (self.new + 1) // 2)


def bench_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100)


def peak_tbps(args: argparse.Namespace) -> float | None:
    if args.peak_tbps:
        return args.peak_tbps
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TBPS.items() if k in name), None)


# -- the two sections ----------------------------------------------------------------------------
def run_decode(args, tk, device) -> list[dict]:
    from sluice_engine.attention.kernel_buckets import choose_attention_launch

    dtype = DTYPES[args.dtype]
    hq, hkv, d = args.num_heads, args.num_kv_heads, args.head_dim
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    peak = peak_tbps(args)
    rows = []
    for ctx in args.decode_contexts:
        for b in args.decode_batches:
            batch = PagedBatch(b, 1, ctx - 1, hq, hkv, d, args.block_size, dtype, device)
            launch = choose_attention_launch(1, [ctx] * b, hq // hkv, hkv, sms)
            splits = launch.num_splits
            err = (batch.triton(tk, launch).float() - batch.sdpa().float()).abs().max().item()
            t_eager = bench_ms(lambda batch=batch, launch=launch: batch.triton(tk, launch))
            t_triton = graph_us(lambda batch=batch, launch=launch: batch.triton(tk, launch)) * 1e-3
            t_sdpa = graph_us(lambda batch=batch: batch.sdpa()) * 1e-3
            nbytes = (2 * b * ctx * hkv * d + 2 * b * hq * d) * dtype.itemsize
            row = dict(batch=b, context=ctx, splits=splits, triton_us=t_triton * 1e3, triton_eager_us=t_eager * 1e3,
                       sdpa_us=t_sdpa * 1e3, triton_tbps=nbytes / t_triton / 1e9, sdpa_tbps=nbytes / t_sdpa / 1e9,
                       max_abs_err=err)
            if peak:
                row["triton_peak_pct"] = 100 * row["triton_tbps"] / peak
            rows.append(row)
            print(f"decode B={b} L={ctx}: {row['triton_tbps']:.2f} TB/s (SDPA {row['sdpa_tbps']:.2f})",
                  file=sys.stderr, flush=True)
            del batch
            torch.cuda.empty_cache()
    return rows


def run_prefill(args, tk, device) -> list[dict]:
    dtype = DTYPES[args.dtype]
    hq, hkv, d = args.num_heads, args.num_kv_heads, args.head_dim
    rows = []
    for b, new, cached in PREFILL_SHAPES:
        batch = PagedBatch(b, new, cached, hq, hkv, d, args.block_size, dtype, device)
        err = (batch.triton(tk).float() - batch.sdpa().float()).abs().max().item()
        t_triton = bench_ms(lambda batch=batch: batch.triton(tk))
        t_sdpa = bench_ms(lambda batch=batch: batch.sdpa())
        flops = 4 * hq * d * batch.causal_pairs()
        rows.append(dict(batch=b, new=new, cached=cached, triton_ms=t_triton, sdpa_ms=t_sdpa,
                         triton_tflops=flops / t_triton / 1e9, sdpa_tflops=flops / t_sdpa / 1e9, max_abs_err=err))
        print(f"prefill B={b} new={new} cached={cached}: {rows[-1]['triton_tflops']:.1f} TFLOP/s "
              f"(SDPA {rows[-1]['sdpa_tflops']:.1f})", file=sys.stderr, flush=True)
        del batch
        torch.cuda.empty_cache()
    return rows


def config_kwargs(cfg, group: int) -> dict:
    """paged_attention's keywords for one of PREFILL_CONFIGS (None: the defaults): the engine's own mapping."""
    from sluice_engine.attention.triton_paged import prefill_launch_kwargs

    return prefill_launch_kwargs(cfg, group)


def config_name(cfg) -> str:
    return "default" if cfg is None else f"m{cfg[0]} w{cfg[1]} s{cfg[2]}"


def run_prefill_sweep(args, tk, device) -> list[dict]:
    dtype = DTYPES[args.dtype]
    hq, hkv, d = args.num_heads, args.num_kv_heads, args.head_dim
    rows = []
    for b, new, cached in SWEEP_SHAPES:
        batch = PagedBatch(b, new, cached, hq, hkv, d, args.block_size, dtype, device)
        ref = batch.sdpa().float()
        flops = 4 * hq * d * batch.causal_pairs()
        t_sdpa = bench_ms(lambda batch=batch: batch.sdpa())
        for cfg in PREFILL_CONFIGS:
            kw = config_kwargs(cfg, hq // hkv)
            err = (batch.triton(tk, **kw).float() - ref).abs().max().item()
            t = bench_ms(lambda batch=batch, kw=kw: batch.triton(tk, **kw))
            rows.append(dict(batch=b, new=new, cached=cached, config=config_name(cfg), triton_ms=t,
                             triton_tflops=flops / t / 1e9, sdpa_tflops=flops / t_sdpa / 1e9, max_abs_err=err))
            print(f"prefill sweep B={b} new={new} cached={cached} {config_name(cfg)}: {rows[-1]['triton_tflops']:.1f} "
                  f"TFLOP/s (SDPA {rows[-1]['sdpa_tflops']:.1f})", file=sys.stderr, flush=True)
        del batch, ref
        torch.cuda.empty_cache()
    return rows


def print_sweep(rows: list[dict]) -> dict:
    """The sweep's table, and per shape the best config and its gain over the default (returned for the JSON)."""
    print("\nPrefill tiles (rows per tile, warps, stages): TFLOP/s per config; the best per shape against the "
          "default\n")
    configs = [config_name(c) for c in PREFILL_CONFIGS]
    print("| batch | new | cached | " + " | ".join(configs) + " | best | best / default | best / SDPA |")
    print("|---:|---:|---:|" + "---:|" * len(configs) + "---|---:|---:|")
    best = {}
    for shape in dict.fromkeys((r["batch"], r["new"], r["cached"]) for r in rows):
        rs = {r["config"]: r for r in rows if (r["batch"], r["new"], r["cached"]) == shape}
        top = max(rs.values(), key=lambda r: r["triton_tflops"])
        gain = top["triton_tflops"] / rs["default"]["triton_tflops"]
        best["x".join(map(str, shape))] = {"config": top["config"], "gain_over_default": gain,
                                            "share_of_sdpa": top["triton_tflops"] / top["sdpa_tflops"]}
        print(f"| {shape[0]} | {shape[1]} | {shape[2]} | " + " | ".join(f"{rs[c]['triton_tflops']:.0f}" for c in configs)
              + f" | {top['config']} | {gain:.2f}x | {top['triton_tflops'] / top['sdpa_tflops']:.2f}x |")
    return best


def print_tables(decode: list[dict], prefill: list[dict], peak: float | None) -> None:
    if decode:
        print(f"\nDecode (one query per sequence; kernel time replayed from a CUDA graph, L2 flushed; eager: the same "
              f"call launched from Python); peak HBM {peak or '?'} TB/s\n")
        print("| batch | context | splits | Triton µs | Triton TB/s | % of peak | eager µs | SDPA (dense) µs | SDPA TB/s "
              "| max abs err |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in decode:
            pct = f"{r['triton_peak_pct']:.0f}%" if "triton_peak_pct" in r else "?"
            print(f"| {r['batch']} | {r['context']} | {r['splits']} | {r['triton_us']:.1f} | {r['triton_tbps']:.2f} "
                  f"| {pct} | {r['triton_eager_us']:.1f} | {r['sdpa_us']:.1f} | {r['sdpa_tbps']:.2f} "
                  f"| {r['max_abs_err']:.1e} |")
    if prefill:
        print("\nPrefill / extend (causal over cached + new tokens)\n")
        print("| batch | new | cached | Triton ms | Triton TFLOP/s | SDPA (dense) ms | SDPA TFLOP/s | max abs err |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in prefill:
            print(f"| {r['batch']} | {r['new']} | {r['cached']} | {r['triton_ms']:.3f} | {r['triton_tflops']:.1f} "
                  f"| {r['sdpa_ms']:.3f} | {r['sdpa_tflops']:.1f} | {r['max_abs_err']:.1e} |")


# -- no GPU: a smoke run in the interpreter ---------------------------------------------------------
def cpu_smoke(sweep: bool) -> None:
    from sluice_engine.attention import triton_kernels as tk
    from sluice_engine.attention.kernel_buckets import AttentionLaunch, block_m_for
    from sluice_engine.attention.torch_paged import TorchPagedAttention
    from sluice_engine.forward_context import AttentionMetadata

    t0 = time.perf_counter()
    cpu = torch.device("cpu")
    cases = [(3, 1, 40, {"launch": AttentionLaunch(2, block_m_for(1, 3))}),
             (2, 9, 20, {"launch": AttentionLaunch(1, block_m_for(9, 3))})]
    if sweep:  # each config's tile (the interpreter ignores warps and stages) over a prompt of several key tiles
        cases = [(2, 150, 30, config_kwargs(cfg, 3)) for cfg in PREFILL_CONFIGS]
    for b, new, cached, kw in cases:
        batch = PagedBatch(b, new, cached, 6, 2, 64, 16, torch.float32, cpu)
        got = batch.triton(tk, **kw)
        tables = batch.block_tables
        meta = AttentionMetadata(batch.query_start_loc, batch.seq_lens, tables, torch.empty(0, dtype=torch.long),
                                 new, batch.seq_len, [new] * b, [batch.seq_len] * b, 16)
        ref = TorchPagedAttention().attend(batch.q_flat, None, None, batch.cache, meta, batch.scale)
        err = (got - ref.view(b, new, *ref.shape[1:]).transpose(1, 2)).abs().max().item()
        print(f"interpreter: B={b} new={new} cached={cached} {kw}: max abs err vs torch {err:.1e}")
        if err > 1e-5:
            sys.exit("FAILED: the kernel disagrees with the torch reference")
    print(f"cpu smoke ok in {time.perf_counter() - t0:.1f}s (no timing: the interpreter is not a GPU)")


def main() -> None:
    args = parse_args()
    if args.cpu_smoke:
        # Triton reads this when triton is first imported and when kernels are decorated.
        os.environ["TRITON_INTERPRET"] = "1"
        cpu_smoke(args.prefill_sweep)
        return
    if not torch.cuda.is_available():
        sys.exit("benchmarks/attention_kernels.py measures GPU kernels and needs a CUDA device; none is "
                 "available here. Run it with --cpu-smoke for a tiny correctness check in Triton's interpreter.")
    from sluice_engine.attention import triton_kernels as tk

    device = torch.device("cuda")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {__import__('triton').__version__}, "
          f"{args.dtype}, Hq={args.num_heads} Hkv={args.num_kv_heads} D={args.head_dim} "
          f"block={args.block_size}", flush=True)
    t0 = time.perf_counter()
    if args.prefill_sweep:
        rows = run_prefill_sweep(args, tk, device)
        best = print_sweep(rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "dtype": args.dtype, "sweep": rows, "best": best}, f,
                          indent=2)
        return
    decode = [] if args.prefill_only else run_decode(args, tk, device)
    prefill = [] if args.decode_only else run_prefill(args, tk, device)
    print_tables(decode, prefill, peak_tbps(args))
    print(f"\n({time.perf_counter() - t0:.0f}s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(args), "decode": decode,
                       "prefill": prefill}, f, indent=2)


if __name__ == "__main__":
    main()
