"""Builds and loads the C++ CPU attention kernel (csrc/paged_attention_cpu.cpp) with the system's
C++ compiler, once per machine: the shared object is cached under the sluice cache dir, keyed by the
source, the flags, the compiler and the CPU (it is built for this CPU's vector units). No compiler, or a
failed build, means `load()` returns None and the engine keeps the torch reference path."""

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

SOURCE = Path(__file__).with_name("csrc") / "paged_attention_cpu.cpp"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
ABI_VERSION = 2

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
        "\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_model(), platform.machine()]).encode()
    ).hexdigest()[:16]
    return cache_root() / "kernels" / f"paged_attention_cpu-{key}.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("compiling the CPU attention kernel (once per machine) -> %s", target)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(out)], capture_output=True, text=True,
                              check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed ({proc.returncode}): {proc.stderr[-2000:]}")
        os.replace(out, target)  # atomic: a concurrent builder finds either nothing or the whole file


def load() -> ctypes.CDLL | None:
    """The kernel library, built on first use; None where it cannot be built (logged once)."""
    with _lock:
        if "lib" in _loaded:
            return _loaded["lib"]
        lib = None
        compiler = _compiler()
        if compiler is None:
            log.warning("no C++ compiler (g++/c++/clang++, or $CXX): CPU attention uses the torch path")
        else:
            try:
                path = library_path(compiler)
                if not path.exists():
                    _build(compiler, path)
                lib = _bind(ctypes.CDLL(str(path)))
            except (OSError, RuntimeError) as e:
                log.warning("CPU attention kernel unavailable, using the torch path: %s", e)
                lib = None
        _loaded["lib"] = lib
        return lib


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    if lib.sluice_paged_attention_abi_version() != ABI_VERSION:
        raise RuntimeError("stale kernel library (ABI version mismatch)")
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    for name in ("sluice_paged_attention_f32", "sluice_paged_attention_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [p, i64, p, i64, p, p, p, i64, p, p, i32, i32, i32, i32, i32, i32, f32, i32]
        fn.restype = None
    lib.sluice_paged_attention_supports_head_dim.argtypes = [i32]
    return lib
