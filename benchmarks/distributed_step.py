"""Tensor and pipeline parallelism (issue 12): the engine's step time per layout and each rank's memory.

    .venv/bin/python benchmarks/distributed_step.py        # CPU, gloo: TP 1, TP 3, PP 2; ~5 min on 2 cores
    .venv/bin/python benchmarks/distributed_step.py --gpu  # one CUDA GPU: rank machinery at world size 1

The step is `Executor.execute_model` on hand-made SchedulerOutputs (no scheduler, sampler or HTTP): per
batch size, a prefill of B random prompts of --context tokens (fixed seed), then decode steps adding one
token (the argmax) per sequence, block tables growing as the scheduler's do; median of --steps after
--warmup. Each layout runs in a fresh process (rank 0), layouts interleaved over --rounds. Memory: each
rank's VmHWM (rank 0 and its worker processes) once every rank holds its weights and KV cache, and the
peak private (anon) and file-backed RSS sampled every 10 ms while loading, against the checkpoint's
size and a bare process that imported the engine. Ranks on one CPU share it (cores // ranks threads).

--gpu (--overhead-cpu: the same over gloo on this CPU): world size 1, the plain path against the rank
machinery (init_distributed: NCCL + a gloo control group; each step broadcast to the group before
execute_model), alternating rounds; its cost as % of a decode step (target < 2%).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from sluice_engine.bench.machine import CpuMeter, cpu_name, load_average
from sluice_engine.config import EngineConfig
from sluice_engine.core.sched_output import ScheduledRequest, SchedulerOutput
from sluice_engine.distributed import parallel_state as ps
from sluice_engine.distributed.layout import rank_shard
from sluice_engine.executor.executor import PING, Executor
from sluice_engine.model_config import ModelConfig
from sluice_engine.model_fetch import resolve_model

BLOCK = 16
LAYOUTS = [(1, 1), (3, 1), (1, 2)]  # (TP, PP); PP 1 is TP 1
MB = 1e6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status_mb(pid: int) -> dict[str, float]:
    """VmHWM, VmRSS, RssAnon, RssFile of a process."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, val = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(val.split()[0]) * 1e3 / MB
    return out


def checkpoint_mb(model_dir: Path) -> float:
    """Sum of the safetensors tensors' sizes (from the files' headers); for a directory converted from a GGUF,
    which reads its weights from the GGUF, the float32 size of its tensors as loaded."""
    if not any(model_dir.glob("*.safetensors")):
        from sluice_engine.models.loader import checkpoint_tensors

        return sum(4 * math.prod(get.shape) for _, get in checkpoint_tensors(model_dir)) / MB
    total = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            head = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in head.items() if k != "__metadata__")
    return total / MB


def baseline_mb() -> dict[str, float]:
    """status_mb of a bare process that imported torch and the engine (what every rank holds anyway)."""
    code = "import os, sys, torch, sluice_engine.engine.llm_engine, sluice_engine.executor.rank_process; " \
           "print(os.getpid(), flush=True); sys.stdin.read()"
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    s = status_mb(int(p.stdout.readline()))
    p.communicate("")
    return s


def sample_rss(peak: dict[int, dict[str, float]], done: threading.Event) -> None:
    """Peak RssAnon / RssFile of this process and its children until `done` (VmHWM mixes the two)."""
    me = os.getpid()
    while not done.is_set():
        for pid in [me, *map(int, Path(f"/proc/{me}/task/{me}/children").read_text().split())]:
            try:
                s = status_mb(pid)
            except (OSError, ValueError):
                continue
            p = peak.setdefault(pid, {"RssAnon": 0.0, "RssFile": 0.0})
            for k in p:
                p[k] = max(p[k], s.get(k, 0.0))
        done.wait(0.01)


def send_control(obj: object) -> None:
    """Rank 0's per-step message to every rank (pickled, sent asynchronously)."""
    ps.send_control(obj)


def kv_budget(mc: ModelConfig, tp: int, pp: int, args, itemsize: int) -> int:
    """Bytes per rank (the budget is per rank) so that every rank holds the blocks the run needs."""
    blocks = max(args.batch) * -(-(args.context + args.warmup + args.steps) // BLOCK)
    return blocks * max(2 * sh.num_layers * sh.num_kv_heads * mc.head_dim * itemsize * BLOCK
                        for sh in (rank_shard(mc, tp, pp, r) for r in range(tp * pp)))


def time_decode(ex: Executor, batch: int, args, vocab: int, broadcast: bool = False) -> dict[str, float]:
    """Prefill `batch` prompts, then decode; median ms per decode step (and of the broadcast alone)."""
    cuda = ex.device.type == "cuda"
    prompts = torch.randint(0, vocab, (batch, args.context), generator=torch.Generator().manual_seed(batch))
    nb = -(-(args.context + args.warmup + args.steps) // BLOCK)
    ids = [f"b{batch}-{i}" for i in range(batch)]

    def blocks(i: int, end: int) -> list[int]:  # sequence i owns blocks i*nb.., as many as `end` tokens fill
        return list(range(i * nb, i * nb + -(-end // BLOCK)))

    logits = ex.execute_model(SchedulerOutput([ScheduledRequest(ids[i], p, 0, blocks(i, args.context))
                                               for i, p in enumerate(prompts.tolist())]))
    tokens = logits.argmax(-1).tolist()
    steps, casts = [], []
    for k in range(args.warmup + args.steps):
        pos = args.context + k
        sched = SchedulerOutput([ScheduledRequest(ids[i], [t], pos, blocks(i, pos + 1))
                                 for i, t in enumerate(tokens)])
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if broadcast:
            send_control(sched)
        t1 = time.perf_counter()
        logits = ex.execute_model(sched)
        if cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        tokens = logits.argmax(-1).tolist()
        if k >= args.warmup:
            steps.append(t2 - t0)
            casts.append(t1 - t0)
    return {"step_ms": statistics.median(steps) * 1e3, "broadcast_ms": statistics.median(casts) * 1e3}


def one_layout(args, model_dir: Path, mc: ModelConfig, tp: int, pp: int) -> dict:
    """In a fresh process per layout, so rank 0's memory and threads are this layout's alone."""
    kv = kv_budget(mc, tp, pp, args, 4)
    cfg = EngineConfig(model=str(model_dir), device="cpu", tensor_parallel_size=tp, pipeline_parallel_size=pp,
                       block_size=BLOCK, kv_cache_memory=kv, master_port=free_port(), distributed_timeout=300,
                       attention_backend=args.attention_backend)
    peak, done = {}, threading.Event()
    sampler = threading.Thread(target=sample_rss, args=(peak, done), daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    ex = Executor(cfg, model_dir)
    try:
        res = {"load_s": time.perf_counter() - t0, "kv_mb": kv / MB, "threads": torch.get_num_threads()}
        pids = {0: os.getpid()}
        if ex.workers is not None:
            send_control(PING)  # reaches each worker once its KV cache is allocated
            time.sleep(1.0)
            pids |= {r: p.pid for r, p in ex.workers.procs.items()}
        done.set()
        sampler.join()
        res["rss"] = {r: status_mb(pid) | {"peak" + k: v for k, v in peak[pid].items()} for r, pid in pids.items()}
        meter = CpuMeter(list(pids.values()))  # other processes' share of the CPU while timing
        meter.start()
        res["decode"] = {b: time_decode(ex, b, args, mc.vocab_size)["step_ms"] for b in args.batch}
        res["other_cpu_pct"] = meter.other_pct()
    finally:
        ex.shutdown()
        ps.destroy_distributed()
    print(f"TP{tp} x PP{pp}: built in {res['load_s']:.1f}s, KV cache {kv / MB:.0f} MB per rank, rank 0 on "
          f"{res['threads']} threads; decode ms/step " + ", ".join(f"batch {b}: {ms:.1f}" for b, ms in
          res["decode"].items()) + f"; other processes took {res['other_cpu_pct'] or 0:.0f}% of the CPU", flush=True)
    return res


def cpu_mode(args, model_dir: Path) -> dict:
    model_mb, base = checkpoint_mb(model_dir), baseline_mb()
    print(f"checkpoint {model_mb:.0f} MB (fp32 tensors); a bare process (import torch + engine): VmHWM "
          f"{base['VmHWM']:.0f} MB, anon {base['RssAnon']:.0f} MB, file {base['RssFile']:.0f} MB")
    runs: dict[tuple[int, int], list[dict]] = {lay: [] for lay in LAYOUTS}
    for _ in range(args.rounds):  # layouts interleaved, so a drift in load hits each alike
        for tp, pp in LAYOUTS:
            with tempfile.TemporaryDirectory() as tmp:
                subprocess.run([sys.executable, __file__, *sys.argv[1:], "--layout", str(tp), str(pp),
                                "--json", f"{tmp}/r.json"], check=True)
                runs[(tp, pp)].append(json.loads(Path(f"{tmp}/r.json").read_text()))
    ref = {b: statistics.median(r["decode"][b] for r in runs[LAYOUTS[0]]) for b in runs[LAYOUTS[0]][0]["decode"]}
    print(f"\ndecode step: median over {args.rounds} rounds [each round's] of the median of {args.steps} steps "
          f"(after {args.warmup} warm-up), context {args.context}")
    print("| layout | ranks | " + " | ".join(f"batch {b} ms/step | vs TP1" for b in ref) + " | others' CPU % |")
    print("|---|---:|" + "---:|---:|" * len(ref) + "---:|")
    for (tp, pp), rs in runs.items():
        cells = []
        for b in ref:
            ms = statistics.median(r["decode"][b] for r in rs)
            cells.append(f"{ms:.1f} {[round(r['decode'][b]) for r in rs]} | {ms / ref[b]:.2f}x")
        name = "TP1 (= PP1)" if tp * pp == 1 else f"TP{tp}" if pp == 1 else f"PP{pp}"
        other = [round(r["other_cpu_pct"] or 0) for r in rs]
        print(f"| {name} | {tp * pp} | " + " | ".join(cells) + f" | {other} |")
    print(f"\nper rank, MB (first round): VmHWM once built, and over the bare process's {base['VmHWM']:.0f}; "
          f"peak anon while loading (sampled) over the bare process's {base['RssAnon']:.0f}; peak file-backed "
          "(mmapped checkpoint + libraries); anon once built")
    print("| layout | rank | VmHWM | - bare | / checkpoint | peak anon - bare | / checkpoint | peak file | anon now |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (tp, pp), rs in runs.items():
        for rank, s in sorted(rs[0]["rss"].items(), key=lambda kv: int(kv[0])):
            hwm, anon = s["VmHWM"] - base["VmHWM"], s["peakRssAnon"] - base["RssAnon"]
            print(f"| {'TP1' if tp * pp == 1 else f'TP{tp}' if pp == 1 else f'PP{pp}'} | {rank} | {s['VmHWM']:.0f} | "
                  f"{hwm:.0f} | {hwm / model_mb:.0%} | {anon:.0f} | {anon / model_mb:.0%} | "
                  f"{s['peakRssFile']:.0f} | {s['RssAnon']:.0f} |")
    return {"model_mb": model_mb, "baseline_mb": base, "runs": {f"tp{t}-pp{p}": r for (t, p), r in runs.items()}}


def overhead_mode(args, model_dir: Path, mc: ModelConfig, device: str) -> dict:
    """World size 1: the plain path vs the rank machinery (process groups + the per-step broadcast)."""
    cuda = device == "cuda"
    cfg = EngineConfig(model=str(model_dir), device=device, dtype="bfloat16" if cuda else "float32",
                       block_size=BLOCK, kv_cache_memory=kv_budget(mc, 1, 1, args, 2 if cuda else 4))
    ex = Executor(cfg, model_dir)
    res = {m: {b: [] for b in args.batch} for m in ("plain", "machinery", "broadcast")}
    for b in args.batch:  # once before any process group exists
        res["plain"][b].append(time_decode(ex, b, args, mc.vocab_size)["step_ms"])
    ps.init_distributed(0, 1, 1, "127.0.0.1", free_port(), torch.device(device), 60)
    try:
        for r in range(args.rounds):
            for mode in ("machinery", "plain")[:: 1 if r % 2 == 0 else -1]:
                for b in args.batch:
                    d = time_decode(ex, b, args, mc.vocab_size, broadcast=mode == "machinery")
                    res[mode][b].append(d["step_ms"])
                    if mode == "machinery":
                        res["broadcast"][b].append(d["broadcast_ms"])
    finally:
        ps.destroy_distributed()
    name = torch.cuda.get_device_name() if cuda else cpu_name()
    print(f"world size 1 on {name} ({cfg.dtype}), {args.rounds} alternating rounds, median of round medians:")
    print("| batch | plain ms/step | machinery ms/step | diff | broadcast ms | broadcast / step |")
    print("|---:|---:|---:|---:|---:|---:|")
    for b in args.batch:
        p, m, c = (statistics.median(res[k][b]) for k in ("plain", "machinery", "broadcast"))
        print(f"| {b} | {p:.2f} | {m:.2f} | {(m - p) / p:+.1%} | {c:.3f} | {c / p:.2%} |")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="HF directory (default: the bundled SmolLM2-135M)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=128, help="prefilled tokens per sequence")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every layout (or of plain/machinery)")
    ap.add_argument("--attention-backend", default="auto", help="torch: no packed C++ linears (CPU mode)")
    ap.add_argument("--gpu", action="store_true", help="world-size-1 machinery overhead on one CUDA GPU (bf16)")
    ap.add_argument("--overhead-cpu", action="store_true", help="the same measurement on this CPU (gloo)")
    ap.add_argument("--layout", type=int, nargs=2, default=None, help=argparse.SUPPRESS)  # internal: one run
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    if args.gpu and not torch.cuda.is_available():
        sys.exit("--gpu needs a CUDA device, and torch.cuda.is_available() is False here (torch "
                 f"{torch.__version__}, CUDA build {torch.version.cuda}); run the CPU mode without --gpu")
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    model_dir = Path(args.model or resolve_model(None))
    mc = ModelConfig.from_dir(model_dir)
    if args.layout:
        args.json.write_text(json.dumps(one_layout(args, model_dir, mc, *args.layout)))
        return
    print(f"{cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"load average {load_average()[0]:.2f} at start; {model_dir.name}: {mc.num_layers} layers, "
          f"{mc.num_heads} heads, {mc.num_kv_heads} KV heads")
    if args.gpu or args.overhead_cpu:
        out = overhead_mode(args, model_dir, mc, "cuda" if args.gpu else "cpu")
    else:
        out = cpu_mode(args, model_dir)
    print(f"load average at end {load_average()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_name(), "args": vars(args) | {"model": str(model_dir),
                                         "json": str(args.json)}, "results": out}, indent=1))


if __name__ == "__main__":
    main()
