"""Where a CPU engine step's time goes (issue 27): the bundled model, B sequences decoding together (and, for
contrast, their prefill), split into the quantized/fp32 GEMMs, attention, the layer ops, the sampler and the
rest (Python: scheduler, batch building, the model's own glue).

    .venv/bin/python benchmarks/cpu_step_profile.py                       # Q4_1 (the default), B=32, ~1 min
    SLUICE_CPU_ISA=avx2 .venv/bin/python benchmarks/cpu_step_profile.py  # the AVX2 kernels on an AVX-512 CPU
    .venv/bin/python benchmarks/cpu_step_profile.py --quantization none   # fp32
    SLUICE_CPU_FUSED_DECODER=off .venv/bin/python benchmarks/cpu_step_profile.py  # GEMM/attention/layer ops apart
    .venv/bin/python benchmarks/cpu_step_profile.py --prompt-len 256 --perf 12  # + the prefill's hottest symbols

B requests of --prompt-len random token ids (seed 0), greedy (--temperature to sample), ignore_eos. The prefill steps
run first, unprofiled but timed; then --steps decode steps (every sequence one token) run under cProfile, and each
bucket is the cumulative time of the Python entry points of its kernels (their ctypes calls release the GIL but run
on this thread): cProfile's own overhead falls on the Python share, so that share is an upper bound. Also printed:
the median wall time of the same number of decode steps run without the profiler.

--perf N: the timed prefill also runs under Linux `perf record -e cpu-clock` (a software clock: it needs no
hardware counters, which VMs often lack), attached to this process only, and the N symbols with the most samples
are printed (the C++ kernels by name; both OpenMP threads' samples count, so shares are of CPU time, not wall).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

BUCKETS = {  # bucket: (file suffix, function name) pairs whose cumulative time it takes
    # A GGUF's decoder layers as one C++ call (models/ggml_decoder.py): GEMMs, attention and layer ops together;
    # SLUICE_CPU_FUSED_DECODER=off runs them one op at a time, which splits them into the buckets below.
    "decoder layers (1 call)": [("models/ggml_decoder.py", "__call__")],
    "GEMM (quantized)": [("cpu_kernels/quant.py", "forward")],
    "GEMM (fp32 packed)": [("cpu_kernels/linear.py", "forward")],
    "attention": [("attention/ggml_cpu.py", "attend"), ("attention/cpu_paged.py", "attend"),
                  ("attention/ggml_cpu.py", "write_kv"), ("attention/cpu_paged.py", "write_kv")],
    "layer ops": [("layer_ops/cpu_ops.py", "rms_norm"), ("layer_ops/cpu_ops.py", "fused_add_rms_norm"),
                  ("layer_ops/cpu_ops.py", "rotary"), ("layer_ops/cpu_ops.py", "silu_and_mul"),
                  ("layer_ops/ggml_ops.py", "forward")],
    "sampler": [("step_sampler.py", "sample_step")],
}


# A `perf report --stdio` row: "  74.13%  libfoo.so  [.] symbol" (some perf versions pad with "-" columns after it).
PERF_ROW = re.compile(r"^\s*([0-9.]+%)\s+(\S+)\s+\[.\]\s+(.*?)(?:\s+-)*\s*$")


class PerfRecorder:
    """`perf record -e cpu-clock` attached to this process from now until report()."""

    def __init__(self):
        if not shutil.which("perf"):
            raise SystemExit("--perf needs Linux perf on PATH")
        self.data = Path(tempfile.mkdtemp()) / "perf.data"
        self.proc = subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-F", "1999", "-p", str(os.getpid()),
                                      "-o", str(self.data)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # perf attaches asynchronously: let it start before the work it should see

    def report(self, top: int) -> None:
        self.proc.send_signal(signal.SIGINT)
        _, err = self.proc.communicate(timeout=60)
        if not self.data.exists():
            raise SystemExit(f"perf record wrote nothing: {err.decode(errors='replace')[-500:]}")
        out = subprocess.run(["perf", "report", "-i", str(self.data), "--no-children", "--sort", "dso,symbol",
                              "--stdio"], capture_output=True, text=True, check=True).stdout
        rows = [m.groups() for m in map(PERF_ROW.match, out.splitlines()) if m]
        print(f"prefill under perf (cpu-clock samples of both threads), top {top}:")
        for share, dso, sym in rows[:top]:
            print(f"  {share:>7}  {sym[:90]}  ({Path(dso).name})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=108)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="of every request (0: greedy; vllm bench serve's requests get the server's default, 1)")
    ap.add_argument("--perf", type=int, default=0, metavar="N",
                    help="record the prefill with `perf record -e cpu-clock` and print its N hottest symbols")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from sluice_engine import cpu_kernels
    from sluice_engine.entrypoints.llm import LLM
    from sluice_engine.sampling_params import SamplingParams

    llm = LLM(device="cpu", quantization=a.quantization)
    eng = llm.engine
    print(f"CPU {cpu_kernels.cpu_name()}, {a.threads} threads, kernel level {cpu_kernels.selected_isa()}, "
          f"quantization {eng.runner.quantization}, attention {eng.runner.backend.name}, B={a.batch}, "
          f"temperature {a.temperature:g}")
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=3 * a.steps + 8, temperature=a.temperature, ignore_eos=True)

    def add_batch(tag: str) -> None:
        for i in range(a.batch):
            eng.add_request(f"{tag}-{i}", torch.randint(100, 40000, (a.prompt_len,), generator=g).tolist(), params)

    def timed_steps(n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            eng.step()
            out.append(time.perf_counter() - t0)
        return out

    add_batch("warm")  # a first batch warms everything up; its prefill is the one timed below
    recorder = PerfRecorder() if a.perf else None
    t0 = time.perf_counter()
    prefill_steps = 0
    while eng.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
        eng.step()
        prefill_steps += 1
    prefill_s = time.perf_counter() - t0
    if recorder:
        recorder.report(a.perf)
    print(f"prefill: {a.batch} x {a.prompt_len} tokens in {prefill_steps} steps, {prefill_s:.2f} s "
          f"({a.batch * a.prompt_len / prefill_s:.0f} tok/s)")
    plain = timed_steps(a.steps)
    prof = cProfile.Profile()
    prof.enable()
    t0 = time.perf_counter()
    timed_steps(a.steps)
    total = time.perf_counter() - t0
    prof.disable()
    stats = pstats.Stats(prof).stats
    print(f"decode: median step {statistics.median(plain) * 1e3:.1f} ms unprofiled "
          f"({a.batch / statistics.median(plain):.0f} tok/s); profiled {total / a.steps * 1e3:.1f} ms/step")
    rest = total
    for bucket, keys in BUCKETS.items():
        t = sum(v[3] for (file, _, fn), v in stats.items()
                if any(file.endswith(suffix) and fn == name for suffix, name in keys))
        rest -= t
        print(f"  {bucket:<20} {t / a.steps * 1e3:7.2f} ms/step  {100 * t / total:5.1f}%")
    print(f"  {'rest (Python etc.)':<20} {rest / a.steps * 1e3:7.2f} ms/step  {100 * rest / total:5.1f}%")
    if os.environ.get("PROFILE_TOP"):
        pstats.Stats(prof).sort_stats("tottime").print_stats(int(os.environ["PROFILE_TOP"]))


if __name__ == "__main__":
    main()
