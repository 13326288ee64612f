"""The engine's C++ kernels for CPU (paged attention for short queries, fp32 GEMM for linear layers, GEMM over GGUF
block-quantized weights, the decoder's norms/rotary/activation),
built with the system's C++ compiler once per machine into one shared object and loaded with ctypes
(which releases the GIL during a call). The library is cached under the sluice cache dir, keyed by the
sources, the flags, the compiler and the CPU (it is built for this CPU's vector units). Plain C++ and
OpenMP, no torch headers: a build takes a few seconds. It links the `libgomp` torch has already loaded,
so torch's ops and these kernels share one OpenMP thread pool. No compiler, or a failed build, means
`load()` returns None and the engine keeps its torch paths."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from ..model_fetch import cache_root

log = logging.getLogger("sluice.engine")

SOURCES = [Path(__file__).with_name(name) for name in ("paged_attention.cpp", "gemm.cpp", "quant_gemm.cpp",
                                                              "layer_ops.cpp", "ggml_attention.cpp")]
HEADERS = [Path(__file__).with_name("ggml_expf.h")]  # included by the sources: part of the build's cache key
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
# Where the compiler does not know -march=native for this CPU: the same without it (slower, still right).
PORTABLE_FLAGS = [f for f in FLAGS if f != "-march=native"]
ABI_VERSION = 2  # of paged_attention.cpp's entry points
QUANT_ABI_VERSION = 2  # of quant_gemm.cpp's: its packed weight layout and int8 activations

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def library_path(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(
        "\0".join([*(src.read_text() for src in (*SOURCES, *HEADERS)), " ".join(FLAGS), version, _cpu_model(),
                   platform.machine()]).encode()
    ).hexdigest()[:16]
    return cache_root() / "kernels" / f"sluice_cpu_kernels-{key}.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("compiling the CPU kernels (once per machine) -> %s", target)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        for flags in (FLAGS, PORTABLE_FLAGS):
            proc = subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", str(out)], capture_output=True,
                                  text=True, check=False)
            if proc.returncode == 0:
                break
            log.warning("%s %s failed: %s", compiler, " ".join(flags), proc.stderr[-500:])
        else:
            raise RuntimeError(f"{compiler} failed ({proc.returncode}): {proc.stderr[-2000:]}")
        os.replace(out, target)  # atomic: a concurrent builder finds either nothing or the whole file


def load() -> ctypes.CDLL | None:
    """The kernels' library, built on first use; None where it cannot be built (logged once), or where
    SLUICE_CPU_KERNELS=off (a GPU node's checks: no -march=native build there; comparisons with the torch paths)."""
    with _lock:
        if "lib" in _loaded:
            return _loaded["lib"]
        lib = None
        compiler = _compiler()
        if os.environ.get("SLUICE_CPU_KERNELS", "").lower() in ("0", "off", "false", "no"):
            log.info("SLUICE_CPU_KERNELS=off: the CPU kernels are not built, torch paths used")
        elif compiler is None:
            log.warning("no C++ compiler (g++/c++/clang++, or $CXX): the CPU kernels are off, torch paths used")
        else:
            try:
                path = library_path(compiler)
                if not path.exists():
                    _build(compiler, path)
                lib = _bind(ctypes.CDLL(str(path)))
            except (OSError, RuntimeError) as e:
                log.warning("CPU kernels unavailable, using the torch paths: %s", e)
                lib = None
        _loaded["lib"] = lib
        return lib


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    if lib.sluice_paged_attention_abi_version() != ABI_VERSION:
        raise RuntimeError("stale kernel library (ABI version mismatch)")
    if not hasattr(lib, "sluice_quant_abi_version") or lib.sluice_quant_abi_version() != QUANT_ABI_VERSION:
        raise RuntimeError("stale kernel library (quant ABI version mismatch)")
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    for name in ("sluice_paged_attention_f32", "sluice_paged_attention_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [p, i64, p, i64, p, p, p, i64, p, p, i32, i32, i32, i32, i32, i32, f32, i32]
        fn.restype = None
    lib.sluice_paged_attention_supports_head_dim.argtypes = [i32]
    lib.sluice_gemm_f32.argtypes = [p, i64, p, i32, i32, i32, p, i64, i32]
    lib.sluice_gemm_f32.restype = None
    lib.sluice_quant_gemm_f32.argtypes = [i32, p, i64, p, i32, i32, i32, p, i64, i32]
    lib.sluice_quant_gemm_f32.restype = None
    lib.sluice_quant_block_bytes.argtypes, lib.sluice_quant_block_bytes.restype = [i32], i32
    lib.sluice_quant_packed_bytes.argtypes, lib.sluice_quant_packed_bytes.restype = [i32, i32, i32], i64
    lib.sluice_quant_repack.argtypes, lib.sluice_quant_repack.restype = [i32, p, i32, i32, p], None
    lib.sluice_quant_unpack_rows.argtypes = [i32, p, i32, i32, p, i32, p, i64]
    lib.sluice_quant_unpack_rows.restype = None
    lib.sluice_quant_activations.argtypes = [i32, p, i64, i32, i32, p, p, p]
    lib.sluice_quant_activations.restype = None
    for name in ("sluice_gemm_available", "sluice_gemm_panel_width", "sluice_quant_abi_version", "sluice_quant_isa"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [], ctypes.c_int
    _bind_layer_ops(lib)
    _bind_ggml_attention(lib)
    return lib


def _bind_ggml_attention(lib: ctypes.CDLL) -> None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.sluice_ggml_attention_supports_head_dim.argtypes = [i32]
    lib.sluice_ggml_attention_supports_head_dim.restype = i32
    lib.sluice_ggml_write_kv.argtypes = [p, i64, p, i64, p, p, p, i32, i32, i32]
    lib.sluice_ggml_write_kv.restype = None
    lib.sluice_ggml_attention.argtypes = [p, i64, p, i64, p, p, p, i64, p, p, i32, i32, i32, i32, i32, f32, i32]
    lib.sluice_ggml_attention.restype = None


def _bind_layer_ops(lib: ctypes.CDLL) -> None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    signatures = {
        "sluice_rms_norm_f32": [p, i64, p, p, i64, i32, i32, f32, i32],
        "sluice_add_rms_norm_f32": [p, i64, p, i64, p, p, i64, p, i64, i32, i32, f32, i32],
        "sluice_rotary_f32": [p, i64, i64, i32, i32, i32, p, p, i64, i32],
        "sluice_silu_mul_f32": [p, i64, p, i64, i32, i32, i32],
        # llama.cpp's arithmetic bit for bit (layer_ops/ggml_ops.py): the same shapes as the four above.
        "sluice_ggml_rms_norm_f32": [p, i64, p, p, i64, i32, i32, f32, i32],
        "sluice_ggml_add_rms_norm_f32": [p, i64, p, i64, p, p, i64, p, i64, i32, i32, f32, i32],
        "sluice_ggml_rotary_f32": [p, i64, i64, i32, i32, i32, p, p, i64, i32],
        "sluice_ggml_swiglu_f32": [p, i64, p, i64, i32, i32, i32],
        "sluice_ggml_rope_cache_f32": [p, i32, i32, f32, f32, p, p],
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
