"""Shared pytest fixtures."""

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from dev_cluster import cluster  # noqa: F401  (the session's real control plane, for the cluster tests)

# httpx and the model cache's packages are imported where used, so that modules needing neither (the Triton kernel
# tests run by benchmarks/gpu_check.sh on a bare GPU machine) collect with torch, triton and pytest alone.


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The bundled default model as an HF directory (downloaded and converted on first use, ~1 min). With
    SLUICE_OFFLINE=1 and no cached copy, the tests that need it skip instead of trying the network."""
    from sluice_engine.model_fetch import OfflineError, resolve_model

    try:
        return resolve_model(None)
    except OfflineError as e:
        pytest.skip(str(e))


# -- a real `sluice serve` process ---------------------------------------------------------------
SERVED_NAME = "smollm2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path):
        self.port = free_port()
        self.model = SERVED_NAME
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sluice_engine.entrypoints.cli", "serve", "--port", str(self.port), *args],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def wait_ready(self, timeout: float = 180) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sluice serve exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"sluice serve not ready after {timeout}s:\n{self.log_path.read_text()}")

    def metrics(self) -> dict[str, float]:
        """Scalar metric samples by name (labels dropped; one model per server)."""
        import httpx

        out: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name_labels, value = line.rsplit(" ", 1)
                out[name_labels.split("{")[0]] = out.get(name_labels.split("{")[0], 0.0) + float(value)
        return out

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()


def stop_process(proc: subprocess.Popen, timeout: float = 15) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def child_pids(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def engine_core_pid(server: ServerProcess) -> int:
    """The pid of the engine-core process a `sluice serve` started (core_process.py)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for pid in child_pids(server.proc.pid):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"sluice_engine.engine.core_process" in f.read():
                    return pid
        time.sleep(0.1)
    raise AssertionError("no engine-core process under the server")


def process_gone(pid: int, timeout: float) -> bool:
    """Whether the process exits (or is a zombie) within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie (exited, not yet reaped) is gone too
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def start_server(model_dir: Path, tmp_path_factory) -> Iterator[Callable[..., ServerProcess]]:
    """Factory: start_server(*flags) -> a ready `sluice serve` on a free port, stopped when the test
    module ends (each server holds ~1.5 GB: kept for the whole session they filled the CI box)."""
    started: list[ServerProcess] = []

    def start(*flags: str) -> ServerProcess:
        log = tmp_path_factory.mktemp("server") / "serve.log"
        # A 512 MiB KV cache (11k tokens, more than the model's 8192-token window) instead of the
        # 1 GiB default: a module may hold several servers at once.
        kv = [] if "--kv-cache-memory" in flags else ["--kv-cache-memory", "512M"]
        server = ServerProcess(["--model", str(model_dir), "--served-model-name", SERVED_NAME, *kv, *flags], log)
        started.append(server)
        server.wait_ready()
        return server

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def hf_model(model_dir: Path):
    """HF transformers on the same weights, fp32: the numerical reference."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`): small tensors and
    the Triton interpreter's numpy tiles, where extra threads only add overhead and thrash a shared CPU."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
