"""The engine's C++ kernels for CPU (paged attention for short queries, fp32 GEMM for linear layers, GEMM over GGUF
block-quantized weights, the decoder's norms/rotary/activation, LoRA's low-rank delta, the sampler's draw), built
with the system's C++ compiler into one shared object per instruction-set level and loaded with ctypes (which
releases the GIL during a call).

Levels (ISAS, best first): avx512-vnni, avx512, avx2 (with FMA and F16C), portable (the compiler's baseline for
this architecture: SSE2 on x86-64, NEON on AArch64). Each is built with explicit -m flags, never -march=native,
so a library depends on the level only, not on the machine that built it: an image or a cache made on one CPU
serves any other with the same level. At run time the CPU's features (/proc/cpuinfo's flags, torch's CPU
capability where there is no /proc) choose the best level it has, logged once; SLUICE_CPU_ISA=<level> forces
one (tests run each level the CPU has), and a level the CPU lacks is refused with an error naming it. A library
is cached under the sluice cache dir per level, keyed by the sources, the level's flags and the compiler; it
carries its level's name in its bytes, read before it is loaded, so a file built for a level this CPU lacks is
never loaded (renamed or copied, whatever its name says). Plain C++ and OpenMP, no torch headers: a build
takes a few seconds. It links the `libgomp` torch has already loaded, so torch's ops and these kernels share
one OpenMP thread pool. No compiler, or a failed build, means `load()` returns None and the engine keeps its
torch paths; SLUICE_CPU_KERNELS=off skips the build altogether."""

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
from dataclasses import dataclass
from pathlib import Path

from ..model_fetch import cache_root

log = logging.getLogger("sluice.engine")

SOURCES = [Path(__file__).with_name(name) for name in ("paged_attention.cpp", "gemm.cpp", "quant_gemm.cpp",
                                                              "layer_ops.cpp", "ggml_attention.cpp", "lora.cpp",
                                                              "ggml_decoder.cpp", "sampling.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in ("ggml_expf.h", "libm_expf.h")]  # included by the sources: part of the build's cache key
BASE_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
ABI_VERSION = 2  # of paged_attention.cpp's entry points
QUANT_ABI_VERSION = 2  # of quant_gemm.cpp's: its packed weight layout and int8 activations
ISA_TAG = b"sluice-kernels-isa:"  # paged_attention.cpp's sluice_kernels_isa_tag: the level's name follows


@dataclass(frozen=True, slots=True)
class Isa:
    name: str
    cpu_flags: tuple[str, ...]  # /proc/cpuinfo flags the CPU must have (x86-64 only; portable needs none)
    compile_flags: tuple[str, ...]


_AVX2 = ("avx", "avx2", "fma", "f16c")
_AVX2_FLAGS = ("-mavx", "-mavx2", "-mfma", "-mf16c")
_AVX512 = (*_AVX2, "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl")
_AVX512_FLAGS = (*_AVX2_FLAGS, "-mavx512f", "-mavx512cd", "-mavx512bw", "-mavx512dq", "-mavx512vl")
ISAS = {  # best first
    "avx512-vnni": Isa("avx512-vnni", (*_AVX512, "avx512_vnni"), (*_AVX512_FLAGS, "-mavx512vnni")),
    "avx512": Isa("avx512", _AVX512, _AVX512_FLAGS),
    "avx2": Isa("avx2", _AVX2, _AVX2_FLAGS),
    "portable": Isa("portable", (), ()),
}
X86_ISAS = ("avx512-vnni", "avx512", "avx2")  # the levels that exist only on x86-64

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}
_announced: set[str] = set()


class CpuIsaError(ValueError):
    """SLUICE_CPU_ISA names a level that does not exist or that this CPU lacks."""


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags: /proc/cpuinfo's `flags` line (Linux, which also drops the AVX-512 flags where
    the OS does not save those registers); elsewhere the flags implied by torch's CPU capability."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    try:
        import torch

        cap = torch.backends.cpu.get_cpu_capability()
    except (ImportError, AttributeError):
        return frozenset()
    return frozenset(_AVX512 if cap.startswith("AVX512") else _AVX2 if cap == "AVX2" else ())


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def supported_isas(flags: frozenset[str] | None = None) -> list[str]:
    """The levels this CPU can run, best first (always ending with portable)."""
    flags = cpu_flags() if flags is None else flags
    ok = [name for name in X86_ISAS if _is_x86() and all(f in flags for f in ISAS[name].cpu_flags)]
    return [*ok, "portable"]


def selected_isa() -> str:
    """SLUICE_CPU_ISA if set (and this CPU has it), else the best level this CPU has."""
    forced = os.environ.get("SLUICE_CPU_ISA", "").strip().lower()
    supported = supported_isas()
    if forced in ("", "auto"):
        return supported[0]
    if forced not in ISAS:
        raise CpuIsaError(f"SLUICE_CPU_ISA={forced}: not a level; choose one of {', '.join(ISAS)} (or auto)")
    if forced not in supported:
        raise CpuIsaError(f"SLUICE_CPU_ISA={forced}: this CPU ({cpu_name()}) lacks it; it runs "
                          f"{', '.join(supported)}")
    return forced


def isa_flags(isa: str) -> list[str]:
    """The compiler flags of a level's build."""
    return [*BASE_FLAGS, *ISAS[isa].compile_flags, f'-DSLUICE_CPU_ISA_NAME="{isa}"']


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def library_path(compiler: str, isa: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(
        "\0".join([*(src.read_text() for src in (*SOURCES, *HEADERS)), " ".join(isa_flags(isa)), version,
                   platform.machine()]).encode()
    ).hexdigest()[:16]
    return cache_root() / "kernels" / f"sluice_cpu_kernels-{isa}-{key}.so"


def library_isa(path: Path) -> str | None:
    """The level a library was built for, read from its bytes (its sluice_kernels_isa_tag) without loading it."""
    data = path.read_bytes()
    at = data.find(ISA_TAG)
    if at < 0:
        return None
    end = data.find(b"\0", at)
    return data[at + len(ISA_TAG):end].decode(errors="replace")


def build(compiler: str, isa: str, target: Path) -> None:
    """Compiles the sources for a level into target (atomically: a concurrent builder finds either nothing
    or the whole file). Any CPU can build any level; only running it needs the CPU's features."""
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("compiling the CPU kernels for %s -> %s", isa, target)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run([compiler, *isa_flags(isa), *map(str, SOURCES), "-o", str(out)], capture_output=True,
                              text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed for {isa} ({proc.returncode}): {proc.stderr[-2000:]}")
        os.replace(out, target)


def open_library(path: Path, isa: str) -> ctypes.CDLL:
    """Loads and binds a library built for `isa`, after checking from its bytes that it is one and that this
    CPU runs that level: never loads code for instructions this CPU lacks."""
    built_for = library_isa(path)
    if built_for != isa:
        raise RuntimeError(f"{path} was built for {built_for or 'an unknown level'}, not {isa}")
    if isa not in supported_isas():
        raise CpuIsaError(f"{path} is built for {isa}, which this CPU ({cpu_name()}) lacks")
    lib = _bind(ctypes.CDLL(str(path)))
    if lib.sluice_kernels_isa().decode() != isa:
        raise RuntimeError(f"{path}: its sluice_kernels_isa() is not {isa}")
    return lib


def load(isa: str | None = None) -> ctypes.CDLL | None:
    """The kernels' library for a level (default: selected_isa(), this CPU's best or SLUICE_CPU_ISA), built on
    first use; None where it cannot be built (logged once), or where SLUICE_CPU_KERNELS=off (a GPU node's
    checks; comparisons with the torch paths). Raises CpuIsaError for a level this CPU lacks."""
    with _lock:
        if os.environ.get("SLUICE_CPU_KERNELS", "").lower() in ("0", "off", "false", "no"):
            if "off" not in _announced:
                _announced.add("off")
                log.info("SLUICE_CPU_KERNELS=off: the CPU kernels are not built, torch paths used")
            return None
        if isa is None:
            isa = selected_isa()
        elif isa not in ISAS:
            raise CpuIsaError(f"unknown CPU kernel level {isa!r}; one of {', '.join(ISAS)}")
        elif isa not in supported_isas():
            raise CpuIsaError(f"CPU kernel level {isa}: this CPU ({cpu_name()}) lacks it")
        if isa in _loaded:
            return _loaded[isa]
        lib = None
        compiler = _compiler()
        if compiler is None:
            log.warning("no C++ compiler (g++/c++/clang++, or $CXX): the CPU kernels are off, torch paths used")
        else:
            try:
                path = library_path(compiler, isa)
                if not path.exists():
                    build(compiler, isa, path)
                lib = open_library(path, isa)
                log.info("CPU kernels: %s (CPU %s runs %s%s)", isa, cpu_name(), ", ".join(supported_isas()),
                         "; SLUICE_CPU_ISA" if os.environ.get("SLUICE_CPU_ISA", "auto") not in ("", "auto") else "")
            except (OSError, RuntimeError) as e:
                log.warning("CPU kernels (%s) unavailable, using the torch paths: %s", isa, e)
                lib = None
        _loaded[isa] = lib
        return lib


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    if lib.sluice_paged_attention_abi_version() != ABI_VERSION:
        raise RuntimeError("stale kernel library (ABI version mismatch)")
    if not hasattr(lib, "sluice_quant_abi_version") or lib.sluice_quant_abi_version() != QUANT_ABI_VERSION:
        raise RuntimeError("stale kernel library (quant ABI version mismatch)")
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.sluice_kernels_isa.argtypes, lib.sluice_kernels_isa.restype = [], ctypes.c_char_p
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
    lib.sluice_lora_f32.argtypes = [p, i64, i32, p, i32, i32, p, p, p, p, p, i32, p, i64, i32]
    lib.sluice_lora_f32.restype = None
    lib.sluice_sample_inverse_cdf_f32.argtypes = [p, i64, i32, i32, p, p, i32]
    lib.sluice_sample_inverse_cdf_f32.restype = None
    return lib


def _bind_ggml_attention(lib: ctypes.CDLL) -> None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.sluice_ggml_attention_supports_head_dim.argtypes = [i32]
    lib.sluice_ggml_attention_supports_head_dim.restype = i32
    lib.sluice_ggml_write_kv.argtypes = [p, i64, p, i64, p, p, p, i32, i32, i32, i32]
    lib.sluice_ggml_write_kv.restype = None
    lib.sluice_ggml_attention.argtypes = [p, i64, p, i64, p, p, p, i64, p, p, i32, i32, i32, i32, i32, f32, i32]
    lib.sluice_ggml_attention.restype = None
    # The decoder layers in one call (models/ggml_decoder.py): pointers to its layer table and shape structs.
    lib.sluice_ggml_decoder_layers.argtypes = [p, i32, p, p, p, i32, p, p, p, p, i64, p, p, i32, i32, p, i64]
    lib.sluice_ggml_decoder_layers.restype = None
    lib.sluice_ggml_decoder_work_floats.argtypes = [p]
    lib.sluice_ggml_decoder_work_floats.restype = i64


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
