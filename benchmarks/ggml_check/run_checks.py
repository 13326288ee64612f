"""Builds and runs the bit-exactness checks of this folder (attention, layer ops, quantized GEMM) for one CPU
kernel level against the llama.cpp build of the same instruction set:

    .venv/bin/python benchmarks/ggml_check/run_checks.py --isa avx2          # vs .tools/.../build-avx2
    .venv/bin/python benchmarks/ggml_check/run_checks.py --isa avx512-vnni   # vs .tools/.../build (native)

The kernels are compiled with the level's own flags (cpu_kernels.isa_flags, as the engine builds them), the
check's driver with the same. llama.cpp's static libraries come from scripts/get-llama-server.sh (native: its
GGML_NATIVE build, on an AVX-512 VNNI CPU for that level; LLAMA_CPU_ISA=avx2: AVX2+FMA+F16C, no AVX-512).
Exit status 0 when every check printed its all-identical line. tests/engine/test_ggml_attention.py runs it."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "engine_image"))

from sluice_engine import cpu_kernels  # noqa: E402

LLAMA = ROOT / ".tools/src/llama-cpp-python-0.3.36"
BUILD_DIR = {"avx2": "build-avx2", "avx512-vnni": "build"}  # the llama.cpp build each level is exact against
KERNELS = ROOT / "engine_image/sluice_engine/cpu_kernels"
CHECKS = {  # check: (our sources it drives, the line it prints when every float is identical)
    "attention": (["ggml_attention.cpp"], "all bit-identical"),
    "layer_ops": (["layer_ops.cpp"], "OK: bit-identical to ggml"),
    "quant_gemm": (["quant_gemm.cpp"], "OK: bit-identical"),
}


def llama_libs(isa: str) -> list[Path] | None:
    lib = LLAMA / BUILD_DIR[isa] / "ggml/src"
    libs = [lib / "libggml.a", lib / "libggml-cpu.a", lib / "libggml-base.a"]
    return libs if all(p.exists() for p in libs) else None


def run_check(check: str, isa: str, workdir: Path) -> tuple[bool, str]:
    libs = llama_libs(isa)
    if libs is None:
        raise FileNotFoundError(f"llama.cpp's {BUILD_DIR[isa]} is not built (scripts/get-llama-server.sh)")
    sources, ok_line = CHECKS[check]
    flags = [f for f in cpu_kernels.isa_flags(isa) if f not in ("-shared", "-fPIC")]
    exe = workdir / f"{check}_check_{isa}"
    subprocess.run(["c++", *flags, f"-I{LLAMA / 'vendor/llama.cpp/ggml/include'}",
                    str(ROOT / f"benchmarks/ggml_check/{check}_check.cpp"), *(str(KERNELS / s) for s in sources),
                    *map(str, libs), "-lpthread", "-ldl", "-lm", "-o", str(exe)], check=True, capture_output=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    return out.returncode == 0 and ok_line in out.stdout, out.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isa", choices=sorted(BUILD_DIR), required=True)
    ap.add_argument("--check", choices=sorted(CHECKS), action="append")
    args = ap.parse_args()
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for check in args.check or CHECKS:
            ok, out = run_check(check, args.isa, Path(tmp))
            print(f"== {check} ({args.isa}): {'identical' if ok else 'DIFFERS'}\n{out}")
            failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
