"""A dev cluster whose engine pods serve for real (scripts/pod_runner.py): kwok gives pods addresses from a /24
of 198.19.0.0/16 and leaves engine pods not Ready (scripts/kwok-engine-stages.yaml); the runner starts a real
`sluice serve` on each pod IP and sets readiness from the engine's own. No operator runs: an endpoint's objects
are applied as `sluice render` makes them, owned by the stored InferenceEndpoint.

Shared by tests/operator/test_cluster_pod_runner.py, the endpoint picker's cluster tests and
benchmarks/gie_pickers.py. Pod IPs become this machine's with local routes (`ip route add local`): root or
CAP_NET_ADMIN; `why_not()` says what is missing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from dev_cluster import ROOT, SCRIPTS, Cluster, tail, tool
from operator_schemas import CRD_FILE
from servers import stop_process

# The kinds of `sluice render` an engine pod needs (no operator runs to make the rest, or to act on them).
SERVING_KINDS = ("ConfigMap", "Deployment", "Service", "PodDisruptionBudget")


def pod_cidr(offset: int = 0) -> str:
    """One /24 per process (and `offset`: modules of one session that each start a cluster keep apart), apart
    from the 198.18.0.0/16 docs/operator.md uses."""
    return f"198.19.{(os.getpid() + offset) % 250}.0/24"


def can_route_locally(cidr: str) -> str | None:
    """Why local routes cannot be added here, or None."""
    probe = cidr.rsplit(".", 1)[0] + ".254/32"
    add = subprocess.run(["ip", "route", "add", "local", probe, "dev", "lo"], capture_output=True, text=True)
    if add.returncode != 0:
        return add.stderr.strip() or "ip route add failed"
    subprocess.run(["ip", "route", "del", "local", probe, "dev", "lo"], capture_output=True)
    return None


def why_not(cidr: str) -> str | None:
    """Why an engine-pods cluster cannot run here (for a skip), or None; builds the control plane if needed."""
    if tool("kubectl") is None:
        return "no kubectl (scripts/get-helm.sh fetches one into .tools/bin)"
    why = can_route_locally(cidr)
    if why is not None:
        return f"scripts/pod_runner.py routes pod IPs to this machine, which needs root or CAP_NET_ADMIN: {why}"
    build = subprocess.run(["bash", str(SCRIPTS / "get-control-plane.sh")], capture_output=True, text=True,
                           timeout=3600)
    if build.returncode != 0:
        return f"the control plane could not be built:\n{tail(build.stderr)}"
    return None


@contextmanager
def engines_cluster(state: Path, cidr: str) -> Iterator[Cluster]:
    """`dev-cluster.sh up` with pod addresses from `cidr` and the engine Stage file; `down` on exit."""
    kubectl = tool("kubectl")
    assert kubectl is not None
    env = {**os.environ, "SLUICE_DEV_CLUSTER_DIR": str(state), "KUBECTL": kubectl, "SLUICE_KWOK_CIDR": cidr,
           "SLUICE_KWOK_STAGES": str(SCRIPTS / "kwok-engine-stages.yaml")}
    down = ["bash", str(SCRIPTS / "dev-cluster.sh"), "down"]
    up = subprocess.run(["bash", str(SCRIPTS / "dev-cluster.sh"), "up"], capture_output=True, text=True, env=env,
                        timeout=300)
    try:
        if up.returncode != 0:
            raise RuntimeError(f"scripts/dev-cluster.sh up failed:\n{tail(up.stderr)}")
        yield Cluster(kubeconfig=state / "admin.kubeconfig", state=state, kubectl_path=kubectl)
    finally:
        subprocess.run(down, env=env, capture_output=True, timeout=60)


class Runner:
    """scripts/pod_runner.py against the cluster, its engines' logs in `logs`."""

    def __init__(self, cluster: Cluster, logs: Path, *flags: str):
        self.logs = logs
        self.out = logs / "pod_runner.log"
        logs.mkdir(parents=True, exist_ok=True)
        with open(self.out, "a") as out:
            self.proc = subprocess.Popen([sys.executable, str(SCRIPTS / "pod_runner.py"), "--kubeconfig",
                                          str(cluster.kubeconfig), "--log-dir", str(logs), *flags],
                                         stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)

    def log(self) -> str:
        return tail(self.out.read_text(errors="replace"), 40)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        stop_process(self.proc, timeout=60)


def render(path: Path) -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "sluice_engine.entrypoints.cli", "render", "-f", str(path), "-o",
                          "json"], capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout)["items"]


def apply_endpoint(c: Cluster, endpoint: dict[str, Any], workdir: Path,
                   kinds: tuple[str, ...] = SERVING_KINDS) -> list[dict[str, Any]]:
    """Store the InferenceEndpoint and apply its rendered objects of `kinds`, owned by it (a placeholder uid
    would have the garbage collector delete them). Returns the applied objects."""
    c.kubectl("apply", "--server-side", "-f", str(CRD_FILE))
    c.wait_established("inferenceendpoints.sluice.dev")
    meta = endpoint["metadata"]
    path = workdir / f"{meta['name']}.yaml"
    path.write_text(yaml.safe_dump(endpoint))
    c.apply(endpoint)
    uid = c.json("get", "inferenceendpoint", meta["name"], "-n", meta.get("namespace", "default"))["metadata"]["uid"]
    items = [o for o in render(path) if o["kind"] in kinds]
    for obj in items:
        for ref in obj["metadata"].get("ownerReferences", []):
            ref["uid"] = uid
    c.apply({"apiVersion": "v1", "kind": "List", "items": items})
    return items


def endpoint_pods(c: Cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    return [p for p in c.json("get", "pods", "-n", namespace, "-l", f"sluice.dev/endpoint={name}")["items"]
            if not p["metadata"].get("deletionTimestamp")]


def is_ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))
