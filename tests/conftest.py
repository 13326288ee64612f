"""Shared pytest fixtures."""

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from dev_cluster import cluster  # noqa: F401  (the session's real control plane, for the cluster tests)
from helm import helm  # noqa: F401  (helm with its own homes, for the chart tests and those that install it)
from servers import SERVED_NAME, ServerProcess
from time_report import TimeReport

# Tests live by component (engine/, operator/, gateway/, faults/); what they share is in support/, on the import
# path through pytest's `pythonpath` (pyproject.toml): `from servers import ServerProcess`, `import kube_emulator`.

# httpx and the model cache's packages are imported where used, so that modules needing neither (the Triton kernel
# tests run by benchmarks/gpu_check.sh on a bare GPU machine) collect with torch, triton and pytest alone.


def pytest_configure(config: pytest.Config) -> None:
    # Which test files CI's time goes to, and how busy the machine was meanwhile (printed at the end).
    config.pluginmanager.register(TimeReport(), "sluice-time-report")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The bundled default model as an HF directory (downloaded and converted on first use, ~1 min). With
    SLUICE_OFFLINE=1 and no cached copy, the tests that need it skip instead of trying the network."""
    from sluice_engine.model_fetch import OfflineError, resolve_model

    try:
        return resolve_model(None)
    except OfflineError as e:
        pytest.skip(str(e))


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

    from sluice_engine.models.gguf_checkpoint import hf_dense_dir

    return AutoModelForCausalLM.from_pretrained(hf_dense_dir(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`): small tensors and
    the Triton interpreter's numpy tiles, where extra threads only add overhead and thrash a shared CPU."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
