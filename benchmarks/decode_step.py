"""Decode-step time of the engine on a random-weight model (issue 15): eager against CUDA graphs, per batch size,
beside the floor set by reading the weights once per step.

    python benchmarks/decode_step.py                                  # CUDA: Llama-3.1-8B shape, bf16, B 1/16/64
    python benchmarks/decode_step.py --model-dir /dev/shm/llama8b     # reuse (or create there) the random model
    python benchmarks/decode_step.py --preset tiny --device cpu       # CPU smoke run: seconds

The model comes from benchmarks/random_model.py (created under --model-dir unless already there). One LLMEngine
per mode (graphs, then --enforce-eager; on CPU only eager: graphs need CUDA), one after the other. Per batch size
B: a short warm-up request set (compiles kernels, captures nothing new), then B requests of --prompt-len fixed
random token ids (seed 0), greedy, ignore_eos, max_tokens --steps + 1, so that every request decodes exactly
--steps tokens after its prefill. Step time: wall time of each engine.step() in which every request decodes
(the sampler's host read synchronizes the GPU each step); the median is reported, and tok/s = B / median.

Floor: bytes a decode step must read from HBM for the weights (every parameter but the embedding table, of
which a step reads only its rows) / --peak-tbps (4.8 TB/s: H200). Targets (issue 15, H200, 8B bf16): batch 1
<= 4.4 ms per step, batch 64 >= 6000 tok/s. Exits 1 when a run produced the wrong token count or a
non-finite time; missing a target is reported, not an error (--strict makes it one).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import random_model  # noqa: E402

TARGET_B1_MS = 4.4
TARGET_B64_TOKS = 6000.0


def make_engine(model_dir: Path, device: str, dtype: str, eager: bool, backend: str, max_batch: int,
                kv_cache_memory: int):
    from sluice_engine.config import EngineConfig
    from sluice_engine.engine.llm_engine import LLMEngine

    cfg = EngineConfig(model=str(model_dir), device=device, dtype=dtype, enforce_eager=eager,
                       attention_backend=backend, max_num_seqs=max_batch, cuda_graph_max_batch=max_batch,
                       kv_cache_memory=kv_cache_memory, max_model_len=1024)
    return LLMEngine(cfg)


def run_batch(engine, batch: int, steps: int, prompt_len: int, seed: int = 0, tag: str = "") -> dict:
    """B requests decoding `steps` tokens each: the step times of pure-decode steps and the tokens out."""
    from sluice_engine.sampling_params import SamplingParams

    vocab = engine.runner.model_config.vocab_size
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for i in range(batch):
        rid = f"{tag}{batch}-{i}"
        # ids >= 3: never a special token (random_model's <unk> <s> </s>)
        engine.add_request(rid, torch.randint(3, vocab, (prompt_len,), generator=g).tolist(), params)
        tokens[rid] = []
    times: list[float] = []
    replays = 0
    graphs = engine.runner.graphs
    inner = graphs.replay if graphs is not None else None
    if graphs is not None:
        def counted(n):
            nonlocal replays
            replays += 1
            return inner(n)
        graphs.replay = counted
    try:
        while engine.has_unfinished():
            decoding = not engine.scheduler.waiting and all(
                r.num_computed_tokens == r.num_tokens - 1 for r in engine.scheduler.running)
            t0 = time.perf_counter()
            for out in engine.step():
                if out.error:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                tokens[out.request_id].extend(out.new_token_ids)
            if decoding:
                times.append(time.perf_counter() - t0)
    finally:
        if graphs is not None:
            graphs.replay = inner
    return {"batch": batch, "times": times, "tokens": tokens, "replays": replays}


def summarize(r: dict) -> dict:
    med = statistics.median(r["times"]) if r["times"] else float("nan")
    return {"batch": r["batch"], "steps": len(r["times"]), "median_ms": med * 1e3, "tok_s": r["batch"] / med,
            "replays": r["replays"], "tokens_per_request": sorted({len(t) for t in r["tokens"].values()})}


def bench(model_dir: Path, device: str, dtype: str, batches: list[int], steps: int, prompt_len: int,
          modes: list[bool], backend: str, kv_cache_memory: int, warmup: bool = True) -> dict[bool, list[dict]]:
    """{eager: [summary per batch size]} (the core, also run by tests/engine/test_decode_step_bench.py)."""
    results: dict[bool, list[dict]] = {}
    for eager in modes:
        t0 = time.perf_counter()
        engine = make_engine(model_dir, device, dtype, eager, backend, max(batches), kv_cache_memory)
        print(f"[{'eager' if eager else 'graphs'}] engine up in {time.perf_counter() - t0:.1f}s "
              f"(backend {engine.runner.backend.name}, graphs {'on' if engine.runner.graphs else 'off'})", flush=True)
        rows = []
        for b in batches:
            if warmup:
                run_batch(engine, b, 3, prompt_len, seed=1000 + b, tag="warm")
            rows.append(summarize(run_batch(engine, b, steps, prompt_len)))
            print(f"  batch {b}: {rows[-1]['median_ms']:.3f} ms/step", flush=True)
        results[eager] = rows
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=list(random_model.PRESETS), default="llama-8b")
    p.add_argument("--model-dir", default=None, help="random model directory (default: /tmp/sluice-random-<preset>)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--attention-backend", default=None, help="default: triton on CUDA, torch on CPU")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--steps", type=int, default=64, help="decode steps measured per batch size")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--modes", default=None, help="eager,graphs (default: both on CUDA, eager on CPU)")
    p.add_argument("--kv-cache-memory", default="4G")
    p.add_argument("--peak-tbps", type=float, default=4.8, help="HBM bandwidth for the floor (H200: 4.8)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = p.parse_args()

    from sluice_engine.config import parse_size

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    backend = args.attention_backend or ("triton" if device == "cuda" else "torch")
    modes_s = args.modes or ("graphs,eager" if device == "cuda" else "eager")
    modes = [m.strip() == "eager" for m in modes_s.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    model_dir = Path(args.model_dir or f"/tmp/sluice-random-{args.preset}")

    t0 = time.perf_counter()
    random_model.create(model_dir, args.preset, device="cuda" if device == "cuda" else "cpu")
    cfg = json.loads((model_dir / "config.json").read_text())
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    total_b, read_b = random_model.weight_bytes(cfg, itemsize)
    floor_ms = read_b / (args.peak_tbps * 1e12) * 1e3
    print(f"model {model_dir} ({args.preset}, {total_b / 1e6:.1f} MB in {dtype}; a decode step reads "
          f"{read_b / 1e6:.1f} MB of weights: floor {floor_ms:.3f} ms at {args.peak_tbps} TB/s) "
          f"ready in {time.perf_counter() - t0:.1f}s", flush=True)

    results = bench(model_dir, device, dtype, batches, args.steps, args.prompt_len, modes, backend,
                    parse_size(args.kv_cache_memory))
    ok = True
    print(f"\n{'mode':<7} {'batch':>5} {'steps':>5} {'ms/step':>9} {'tok/s':>10} {'floor/step':>10} {'replayed':>8}  tokens")
    for eager, rows in results.items():
        for r in rows:
            good = (math.isfinite(r["median_ms"]) and r["steps"] >= args.steps - 1
                    and r["tokens_per_request"] == [args.steps + 1])
            ok &= good
            print(f"{'eager' if eager else 'graphs':<7} {r['batch']:>5} {r['steps']:>5} {r['median_ms']:>9.3f} "
                  f"{r['tok_s']:>10.1f} {floor_ms / r['median_ms']:>9.0%} {r['replays']:>8}  "
                  f"{r['tokens_per_request']}{'' if good else '  WRONG'}")
    targets = []
    if device == "cuda" and args.preset == "llama-8b":
        best = {}
        for rows in results.values():
            for r in rows:
                best[r["batch"]] = min(best.get(r["batch"], math.inf), r["median_ms"])
        if 1 in best:
            targets.append((f"batch 1 <= {TARGET_B1_MS} ms/step", best[1] <= TARGET_B1_MS, f"{best[1]:.3f} ms"))
        if 64 in best:
            toks = 64 / best[64] * 1e3
            targets.append((f"batch 64 >= {TARGET_B64_TOKS:.0f} tok/s", toks >= TARGET_B64_TOKS, f"{toks:.0f} tok/s"))
    for name, met, got in targets:
        print(f"target {name}: {got} -> {'MET' if met else 'MISSED'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"preset": args.preset, "device": device, "dtype": dtype,
                                               "backend": backend, "floor_ms": floor_ms,
                                               "results": {("eager" if e else "graphs"): rows
                                                           for e, rows in results.items()},
                                               "targets": [{"name": n, "met": m, "got": g} for n, m, g in targets]},
                                              indent=1))
    print("OK" if ok else "FAILED")
    if not ok:
        return 1
    return 1 if args.strict and not all(m for _, m, _ in targets) else 0


if __name__ == "__main__":
    raise SystemExit(main())
