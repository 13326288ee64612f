"""The real control plane the cluster tests run against (marker `cluster`): scripts/get-control-plane.sh builds
kube-apiserver, kube-controller-manager, kube-scheduler, etcd and kwok from their Go modules (once per machine,
cached), and scripts/dev-cluster.sh runs them on 127.0.0.1 with kwok's simulated nodes, and the LeaderWorkerSet
controller with its webhooks where it could be built (`Cluster.lws`), and the Gateway API and Inference Extension
CRDs where scripts/get-gateway-crds.sh could fetch them (`Cluster.gateway_crds`). One cluster per test session (the
`cluster` fixture, registered in conftest.py); each test module cleans up what it creates.

Skipped, saying why, only where the control plane cannot be built (no Go, or the build failed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parents[2]
SCRIPTS = ROOT / "scripts"
TOOLS = ROOT / ".tools" / "bin"  # kubectl and helm from scripts/get-helm.sh


def tool(name: str) -> str | None:
    local = TOOLS / name
    return str(local) if os.access(local, os.X_OK) else shutil.which(name)


def tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


@dataclass
class Cluster:
    kubeconfig: Path
    state: Path
    kubectl_path: str

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{(self.state / 'api-port').read_text().strip()}"

    @property
    def ca_file(self) -> Path:
        return self.state / "pki" / "ca.crt"

    @property
    def lws(self) -> bool:
        """Whether the LeaderWorkerSet controller runs (dev-cluster.sh starts it where get-control-plane.sh
        built it)."""
        return (self.state / "lws" / "webhook-port").is_file()

    @property
    def keda(self) -> bool:
        """Whether KEDA's operator and metrics API server run behind the external metrics APIService
        (dev-cluster.sh up --keda, which the fixture passes where get-control-plane.sh --keda built them)."""
        return (self.state / "keda" / "ready").is_file()

    @property
    def gateway_crds(self) -> Path | None:
        """The Gateway API (standard) and Inference Extension CRDs dev-cluster.sh installed (their directory, from
        scripts/get-gateway-crds.sh), or None where they could not be fetched (no Go, no module proxy)."""
        marker = self.state / "gateway-crds"
        return Path(marker.read_text().strip()) if marker.is_file() else None

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 60,
                kubeconfig: Path | None = None) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([self.kubectl_path, f"--kubeconfig={kubeconfig or self.kubeconfig}", *args],
                              input=stdin, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

    def json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def get(self, *args: str) -> Any | None:
        """The object, or None where it does not exist."""
        proc = self.kubectl("get", *args, "-o", "json", check=False)
        if proc.returncode != 0:
            assert "NotFound" in proc.stderr, proc.stderr
            return None
        return json.loads(proc.stdout)

    def apply(self, doc: dict[str, Any], *extra: str) -> None:
        self.kubectl("apply", "--server-side", *extra, "-f", "-", stdin=json.dumps(doc))

    def wait_established(self, *crds: str, timeout: float = 60) -> None:
        # Polled: `kubectl wait` fails outright on a CRD whose status has no conditions yet (just created).
        def established(name: str) -> bool:
            crd = self.get("crd", name) or {}
            return any(c["type"] == "Established" and c["status"] == "True"
                       for c in (crd.get("status") or {}).get("conditions") or [])
        for name in crds:
            wait_until(f"CRD {name} to be Established", lambda n=name: established(n), timeout)

    def token_kubeconfig(self, path: Path, namespace: str, service_account: str) -> Path:
        """A kubeconfig that authenticates as the ServiceAccount with a token from the TokenRequest API, as the
        pod's projected token would: RBAC decides what it may do."""
        token = self.kubectl("create", "token", service_account, "-n", namespace, "--duration=2h").stdout.strip()
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "sa",
            "clusters": [{"name": "dev", "cluster": {"server": self.server,
                                                     "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": "sa", "user": {"token": token}}],
            "contexts": [{"name": "sa", "context": {"cluster": "dev", "user": "sa", "namespace": namespace}}],
        }))
        return path


def wait_until(what: str, probe: Callable[[], Any], timeout: float = 60, interval: float = 0.5) -> Any:
    """probe() until it returns something truthy; on timeout fail with `what` and the last value seen."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last seen: {value!r}"[:4000])
        time.sleep(interval)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The session's cluster, without KEDA: the operator tests expect no autoscaler to act on what they render
    (KEDA's tests start a cluster of their own: start_cluster(..., "--keda"))."""
    yield from start_cluster(tmp_path_factory)


def start_cluster(tmp_path_factory: pytest.TempPathFactory, *extra_up_args: str) -> Iterator[Cluster]:
    """`dev-cluster.sh up [extra_up_args]` in a state dir of its own; `down` when the generator closes."""
    kubectl = tool("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl (scripts/get-helm.sh fetches one into .tools/bin); cluster tests skipped")
    # A cold build takes many minutes (docs/BENCHMARKS.md, "Control plane build"); scripts/test.sh runs it first.
    build = subprocess.run(["bash", str(SCRIPTS / "get-control-plane.sh")], capture_output=True, text=True,
                           timeout=3600)
    if build.returncode != 0:
        pytest.skip(f"the control plane could not be built (scripts/get-control-plane.sh exited "
                    f"{build.returncode}); cluster tests skipped. Its output ends:\n{tail(build.stderr)}")
    state = tmp_path_factory.mktemp("dev-cluster")
    env = {**os.environ, "SLUICE_DEV_CLUSTER_DIR": str(state), "KUBECTL": kubectl}
    down = ["bash", str(SCRIPTS / "dev-cluster.sh"), "down"]
    up = subprocess.run(["bash", str(SCRIPTS / "dev-cluster.sh"), "up", *extra_up_args],
                        capture_output=True, text=True, env=env, timeout=300)
    if up.returncode != 0:
        logs = "".join(f"\n--- {p.name}\n{tail(p.read_text(errors='replace'), 10)}"
                       for p in sorted((state / "logs").glob("*.log")))
        subprocess.run(down, env=env, capture_output=True, timeout=60)
        pytest.fail(f"scripts/dev-cluster.sh up failed:\n{tail(up.stderr)}{logs}")
    try:
        yield Cluster(kubeconfig=state / "admin.kubeconfig", state=state, kubectl_path=kubectl)
    finally:
        subprocess.run(down, env=env, capture_output=True, timeout=60)
