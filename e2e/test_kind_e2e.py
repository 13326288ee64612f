"""End to end on a real cluster (kind): the chart, KEDA, the operator, the gateway and the engine together.

What it does (docs/operator.md, "End-to-end test on kind"):
1. creates a kind cluster (or reuses SLUICE_E2E_CLUSTER), builds the operator image (which also runs the
   gateway) and a CPU build of the engine image, and loads both into the cluster;
2. installs KEDA (its Helm chart), the LeaderWorkerSet controller (its release manifests), a bare Prometheus
   (e2e/prometheus.yaml) and charts/sluice;
3. applies examples/cpu-smollm2.yaml, waits for Ready, sends an OpenAI chat completion through the endpoint's
   Service (kubectl port-forward), scales it to zero (spec.replicas: 0, phase Idle) and back, and asks again;
4. creates an autoscaled copy (scaling.minReplicas 0), waits until KEDA has scaled it to zero, sends a request
   through the gateway, which holds it while KEDA (external-push) starts a replica, and gets the answer; then
   waits for the scale to zero again;
5. applies examples/cpu-pipeline-2node.yaml (pipeline 2 over two CPU pods: one LeaderWorkerSet group of a
   leader and a worker, each one `sluice serve --nnodes 2`), waits for Ready, checks the worker's /health and
   rendezvous, asks through the Service, deletes the worker pod, and waits until the whole group was restarted
   and answers again;
6. (issue 14) two endpoints of one model and revision with `model.cache.type: shared` (a static ReadWriteMany
   hostPath volume stands in for NFS): one claim and one fetch Job, co-owned by both, one successful download,
   both Ready and answering; the claim outlives the first endpoint and is garbage-collected with the second;
7. (issue 14) a hostPath cache directory nobody prepared (the kubelet creates it root-owned) is handed to the
   engine's uid by the operator's init container, and the endpoint serves from it.

Needs docker (a running daemon), kind, kubectl and helm (helm and kubectl may be in .tools/bin), and network
access for the images, the KEDA chart and the model (Hugging Face Hub). It skips, saying what is missing,
where any is absent. Not part of `pytest` from the repository root (testpaths = tests); run it with

    .venv/bin/python -m pytest e2e/ -v -s

Environment: SLUICE_E2E_CLUSTER (reuse this kind cluster; it is then never deleted), SLUICE_E2E_KEEP=1 (keep
the cluster it created), SLUICE_E2E_SKIP_BUILD=1 (use already built sluice-operator:e2e and
sluice-engine:e2e images), SLUICE_E2E_KEDA_VERSION (the KEDA chart version; default: the latest),
SLUICE_E2E_LWS_VERSION (the LeaderWorkerSet release, e.g. v0.7.0; default: the latest).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).parents[1]
LOCAL_BIN = ROOT / ".tools" / "bin"
CLUSTER = os.environ.get("SLUICE_E2E_CLUSTER", "sluice-e2e")
OPERATOR_IMAGE, ENGINE_IMAGE, TAG = "sluice-operator", "sluice-engine", "e2e"
NS, SYSTEM_NS = "e2e", "sluice-system"
GATEWAY = "sluice-gateway"  # the chart's gateway for release "sluice"
CACHE_DIR = "/var/lib/sluice-e2e-cache"  # a hostPath model cache on the kind node, owned by the engine's uid
LWS = "leaderworkersets.leaderworkerset.x-k8s.io"


def _which(tool: str) -> str | None:
    local = LOCAL_BIN / tool
    return str(local) if os.access(local, os.X_OK) else shutil.which(tool)


def _missing() -> list[str]:
    missing = [tool for tool in ("docker", "kind", "kubectl", "helm") if _which(tool) is None]
    if "docker" not in missing:
        try:
            ok = subprocess.run([_which("docker"), "info"], capture_output=True, timeout=60).returncode == 0
        except subprocess.TimeoutExpired:
            ok = False
        if not ok:
            missing.append("a running Docker daemon (`docker info` failed)")
    return missing


MISSING = _missing()
if MISSING:
    pytest.skip(f"kind end-to-end test skipped: this machine lacks {'; '.join(MISSING)} "
                "(see docs/operator.md, 'End-to-end test on kind')", allow_module_level=True)

DOCKER, KIND, KUBECTL, HELM = (_which(t) for t in ("docker", "kind", "kubectl", "helm"))


# -- commands ---------------------------------------------------------------------------------------------
def run(*cmd: str, env: dict[str, str] | None = None, input: str | None = None, timeout: float = 1800,
        check: bool = True) -> str:
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, env=env, input=input, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout


class Cluster:
    def __init__(self, kubeconfig: str):
        self.env = {**os.environ, "KUBECONFIG": kubeconfig}

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 600) -> str:
        return run(KUBECTL, *args, env=self.env, input=input, check=check, timeout=timeout)

    def helm(self, *args: str, timeout: float = 1200) -> str:
        return run(HELM, *args, env=self.env, timeout=timeout)

    def get(self, kind: str, name: str, namespace: str = NS) -> dict[str, Any] | None:
        out = self.kubectl("get", kind, name, "-n", namespace, "-o", "json", "--ignore-not-found")
        return json.loads(out) if out.strip() else None

    def endpoint(self, name: str) -> dict[str, Any]:
        return self.get("inferenceendpoints.sluice.dev", name) or {}

    def serving_pods(self, name: str) -> list[str]:
        out = self.kubectl("get", "pods", "-n", NS, "-l", f"sluice.dev/endpoint={name},sluice.dev/role=serving",
                           "-o", "name")
        return out.split()

    def event_reasons(self, name: str) -> list[str]:
        """Reasons of the events about an InferenceEndpoint (the operator's, on its transitions)."""
        out = self.kubectl("get", "events", "-n", NS, "--field-selector",
                           f"involvedObject.name={name},involvedObject.kind=InferenceEndpoint",
                           "-o", "jsonpath={.items[*].reason}")
        return out.split()

    def diagnostics(self) -> str:
        parts = []
        for args in (["get", "ie,deploy,pods,svc,scaledobjects,hpa", "-A", "-o", "wide"],
                     ["get", LWS, "-A", "-o", "wide"],
                     ["describe", "ie", "-n", NS],
                     ["get", "events", "-n", NS, "--sort-by=.lastTimestamp"],
                     ["logs", "-n", SYSTEM_NS, "deployment/sluice", "--tail=150"],
                     ["logs", "-n", SYSTEM_NS, f"deployment/{GATEWAY}", "--tail=150"],
                     ["logs", "-n", NS, "-l", "sluice.dev/endpoint", "--all-containers", "--tail=80"]):
            parts.append(f"$ kubectl {' '.join(args)}\n" + self.kubectl(*args, check=False))
        return "\n".join(parts)

    def wait_for(self, what: str, check: Callable[[], Any], timeout: float, interval: float = 5) -> Any:
        """Poll `check` until it returns something truthy; on timeout, fail with the cluster's state."""
        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            try:
                last = check()
                if last:
                    print(f"ok: {what}", flush=True)
                    return last
            except (AssertionError, KeyError, json.JSONDecodeError) as e:
                last = e
            time.sleep(interval)
        raise AssertionError(f"{what}: not within {timeout:.0f}s (last: {last!r})\n{self.diagnostics()}")

    def phase(self, name: str, phase: str) -> dict[str, Any] | None:
        st = self.endpoint(name).get("status") or {}
        return st if st.get("phase") == phase else None

    def idle(self, name: str) -> dict[str, Any] | None:
        """The status once the endpoint is Idle and its last serving pod is gone."""
        st = self.phase(name, "Idle")
        return st if st and not self.serving_pods(name) else None

    @contextlib.contextmanager
    def port_forward(self, target: str, port: int, namespace: str = NS) -> Iterator[str]:
        """kubectl port-forward to a Service; yields its local base URL."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            local = s.getsockname()[1]
        proc = subprocess.Popen([KUBECTL, "port-forward", "-n", namespace, target, f"{local}:{port}"],
                                env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 60
            while True:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", local), timeout=1):
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"port-forward {target} failed: {proc.stdout.read() if proc.stdout else ''}")
                time.sleep(0.5)
            yield f"http://127.0.0.1:{local}"
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def chat(base_url: str, model: str, timeout: float = 120) -> dict[str, Any]:
    import httpx

    resp = httpx.post(f"{base_url}/v1/chat/completions", timeout=timeout, json={
        "model": model, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert resp.status_code == 200, f"HTTP {resp.status_code}: {resp.text[:500]}"
    body = resp.json()
    assert body["choices"][0]["message"]["content"], body
    return body


# -- the stack ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    reuse = "SLUICE_E2E_CLUSTER" in os.environ
    existing = run(KIND, "get", "clusters").split()
    created = CLUSTER not in existing
    if created:
        run(KIND, "create", "cluster", "--name", CLUSTER, "--wait", "180s")
    with tempfile.TemporaryDirectory() as tmp:
        kubeconfig = Path(tmp) / "kubeconfig"
        kubeconfig.write_text(run(KIND, "get", "kubeconfig", "--name", CLUSTER))
        try:
            yield Cluster(str(kubeconfig))
        finally:
            if created and not reuse and os.environ.get("SLUICE_E2E_KEEP") != "1":
                run(KIND, "delete", "cluster", "--name", CLUSTER, check=False)


@pytest.fixture(scope="module")
def stack(cluster: Cluster) -> Cluster:
    """Images loaded; KEDA, a bare Prometheus and the Sluice chart installed; the e2e namespace there."""
    if os.environ.get("SLUICE_E2E_SKIP_BUILD") != "1":
        run(DOCKER, "build", "-f", "operator/Dockerfile", "-t", f"{OPERATOR_IMAGE}:{TAG}", str(ROOT), timeout=3600)
        run(DOCKER, "build", "-f", "engine_image/Dockerfile", "-t", f"{ENGINE_IMAGE}:{TAG}",
            "--build-arg", "CUDA_IMAGE=ubuntu:24.04",  # a CPU build: kind nodes have no GPU
            "--build-arg", "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu",
            "--build-arg", "BUNDLE_DEFAULT_MODEL=0", str(ROOT), timeout=3600)
    for image in (OPERATOR_IMAGE, ENGINE_IMAGE):
        run(KIND, "load", "docker-image", f"{image}:{TAG}", "--name", CLUSTER, timeout=1800)
    # The model cache of the autoscaled endpoint: a node directory the engine's uid may write.
    for node in run(KIND, "get", "nodes", "--name", CLUSTER).split():
        run(DOCKER, "exec", node, "sh", "-c", f"mkdir -p {CACHE_DIR} && chown 10001:10001 {CACHE_DIR}")

    cluster.helm("repo", "add", "kedacore", "https://kedacore.github.io/charts", "--force-update")
    version = os.environ.get("SLUICE_E2E_KEDA_VERSION")
    cluster.helm("upgrade", "--install", "keda", "kedacore/keda", "--namespace", "keda", "--create-namespace",
                 "--wait", "--timeout", "10m", *(["--version", version] if version else []))
    # LeaderWorkerSet (multi-node replicas), before the chart: the operator finds the kinds served when it starts.
    lws = os.environ.get("SLUICE_E2E_LWS_VERSION")
    lws_url = (f"https://github.com/kubernetes-sigs/lws/releases/download/{lws}/manifests.yaml" if lws else
               "https://github.com/kubernetes-sigs/lws/releases/latest/download/manifests.yaml")
    cluster.kubectl("apply", "--server-side", "-f", lws_url)  # server-side: the CRD is too big for client-side
    cluster.kubectl("rollout", "status", "-n", "lws-system", "deployment/lws-controller-manager", "--timeout=300s")
    cluster.kubectl("apply", "-f", str(ROOT / "e2e" / "prometheus.yaml"))
    cluster.kubectl("rollout", "status", "-n", "monitoring", "deployment/prometheus", "--timeout=300s")
    # After KEDA: the operator finds the kinds the cluster serves when it starts.
    cluster.helm("upgrade", "--install", "sluice", str(ROOT / "charts" / "sluice"), "--namespace", SYSTEM_NS,
                 "--create-namespace", "--wait", "--timeout", "10m",
                 "--set", f"image.repository={OPERATOR_IMAGE}", "--set", f"image.tag={TAG}",
                 "--set", "image.pullPolicy=Never",
                 "--set", f"engine.image.repository={ENGINE_IMAGE}", "--set", f"engine.image.tag={TAG}",
                 "--set", "prometheus.url=http://prometheus.monitoring.svc:9090",
                 "--set-json", 'extraArgs=["--resync-seconds","10"]',
                 "--set-json", 'gateway.extraArgs=["--hold-timeout","900"]')
    cluster.kubectl("create", "namespace", NS, check=False)
    return cluster


def example(name: str, **spec: Any) -> str:
    doc = yaml.safe_load((ROOT / "examples" / "cpu-smollm2.yaml").read_text())
    doc = copy.deepcopy(doc)
    doc["metadata"]["name"] = name
    for key, value in spec.items():
        if value is None:
            doc["spec"].pop(key, None)
        else:
            doc["spec"][key] = value
    return yaml.safe_dump(doc)


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), {})


# -- the tests ------------------------------------------------------------------------------------------------
@pytest.mark.timeout(5400)
def test_serve_then_scale_to_zero_and_back(stack: Cluster) -> None:
    k = stack
    k.kubectl("apply", "-n", NS, "-f", str(ROOT / "examples" / "cpu-smollm2.yaml"))
    st = k.wait_for("smollm2 Ready", lambda: k.phase("smollm2", "Ready"), timeout=1800)
    assert condition(st, "ModelReady")["status"] == "True" and condition(st, "Scheduled")["status"] == "True"
    assert st["url"] == f"http://smollm2.{NS}.svc.cluster.local/v1"
    with k.port_forward("svc/smollm2", 80) as url:
        chat(url, "smollm2")

    k.kubectl("patch", "ie", "smollm2", "-n", NS, "--type", "merge", "-p", '{"spec": {"replicas": 0}}')
    k.wait_for("smollm2 Idle with no pod", lambda: k.idle("smollm2"), timeout=600)
    k.kubectl("patch", "ie", "smollm2", "-n", NS, "--type", "merge", "-p", '{"spec": {"replicas": 1}}')
    k.wait_for("smollm2 Ready again", lambda: k.phase("smollm2", "Ready"), timeout=1800)
    with k.port_forward("svc/smollm2", 80) as url:
        chat(url, "smollm2")
    reasons = k.event_reasons("smollm2")
    assert {"Ready", "Idle"} <= set(reasons), reasons  # the operator's events on the transitions
    k.kubectl("delete", "ie", "smollm2", "-n", NS, "--wait=true")


@pytest.mark.timeout(5400)
def test_scale_from_zero_through_the_gateway(stack: Cluster) -> None:
    k, name = stack, "smollm2-auto"
    k.kubectl("apply", "-n", NS, "-f", "-", input=example(
        name, replicas=None, startupGraceSeconds=180,
        model={"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct", "servedName": name,
               "cache": {"type": "hostPath", "path": CACHE_DIR}},
        scaling={"minReplicas": 0, "maxReplicas": 1, "scaleDownDelaySeconds": 30}))
    so = k.wait_for("the ScaledObject", lambda: k.get("scaledobjects.keda.sh", name), timeout=120)
    assert [t["type"] for t in so["spec"]["triggers"]] == ["prometheus", "external-push"]
    assert so["spec"]["triggers"][1]["metadata"]["scalerAddress"] == f"{GATEWAY}.{SYSTEM_NS}.svc:9090"
    k.wait_for("KEDA Ready", lambda: condition(k.endpoint(name).get("status") or {}, "AutoscalerReady")
               .get("status") == "True", timeout=600)
    # The first replica loads the model into the node cache; after the initial cooldown KEDA scales to zero.
    st = k.wait_for(f"{name} Idle (KEDA scaled it to zero)", lambda: k.idle(name), timeout=1800)
    assert st["url"] == f"http://{GATEWAY}.{SYSTEM_NS}.svc:8080/v1"
    assert condition(st, "AutoscalerActive")["status"] == "False"

    # A request at zero: the gateway holds it, pushes demand to KEDA, and answers once a replica is ready.
    with k.port_forward(f"svc/{GATEWAY}", 8080, namespace=SYSTEM_NS) as url:
        started = time.monotonic()
        chat(url, f"{NS}/{name}", timeout=900)  # the chart watches every namespace: `<namespace>/<servedName>`
        print(f"answered from zero in {time.monotonic() - started:.0f}s", flush=True)
    # The endpoint went Ready on the way (it may be back to Idle already: the cooldown is short).
    k.wait_for(f"{name} Ready event", lambda: "Ready" in k.event_reasons(name), timeout=300)
    # No more demand: back to zero after the cooldown.
    k.wait_for(f"{name} Idle again", lambda: k.idle(name), timeout=900)
    k.kubectl("delete", "ie", name, "-n", NS, "--wait=true")


def group_pods(k: Cluster, name: str) -> dict[str, dict[str, Any]]:
    """The serving pods of a LeaderWorkerSet endpoint by part: "leader" (sluice.dev/serves=true), "worker"."""
    out = json.loads(k.kubectl("get", "pods", "-n", NS, "-l", f"sluice.dev/endpoint={name},sluice.dev/role=serving",
                               "-o", "json"))
    pods = [p for p in out["items"] if not p["metadata"].get("deletionTimestamp")]
    return {("leader" if p["metadata"]["labels"].get("sluice.dev/serves") == "true" else "worker"): p for p in pods}


def pod_ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))


def restarts(pod: dict[str, Any]) -> int:
    return sum(c.get("restartCount", 0) for c in pod.get("status", {}).get("containerStatuses", []))


@pytest.mark.timeout(5400)
def test_pipeline_over_two_cpu_pods(stack: Cluster) -> None:
    """Issue 12: a multi-node replica on CPU (gloo): pipeline 2 over a leader and a worker pod."""
    import httpx

    k, name = stack, "smollm2-pp2"
    k.kubectl("apply", "-n", NS, "-f", str(ROOT / "examples" / "cpu-pipeline-2node.yaml"))
    lws = k.wait_for("the LeaderWorkerSet", lambda: k.get(LWS, name), timeout=120)
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    k.wait_for(f"{name} Ready", lambda: k.phase(name, "Ready"), timeout=1800)
    pods = k.wait_for("leader and worker Ready", lambda: (lambda p: p if len(p) == 2 and all(
        pod_ready(x) for x in p.values()) else None)(group_pods(k, name)), timeout=600)

    # Each pod runs one `sluice serve` with the group's rendezvous; LWS injected the variables it expands.
    for part, pod in pods.items():
        (engine,) = pod["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in engine.get("env", [])}
        assert env.get("LWS_LEADER_ADDRESS") and env.get("LWS_WORKER_INDEX") == ("0" if part == "leader" else "1")
        args = engine["args"]
        assert args[args.index("--nnodes") + 1] == "2" and args[args.index("--pipeline-parallel-size") + 1] == "2"
    # The worker serves /health (its probes' endpoint), not the API.
    worker = pods["worker"]["metadata"]["name"]
    with k.port_forward(f"pod/{worker}", 8000) as url:
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    with k.port_forward(f"svc/{name}", 80) as url:
        chat(url, name)

    # Lose a rank: the engine stops the group (the leader exits) and LWS recreates it; then it serves again.
    leader = pods["leader"]
    k.kubectl("delete", "pod", worker, "-n", NS, "--wait=false")

    def group_restarted() -> bool:
        now = group_pods(k, name).get("leader")
        return bool(now) and (now["metadata"]["uid"] != leader["metadata"]["uid"] or restarts(now) > restarts(leader))

    k.wait_for("the leader restarted or recreated with its group", group_restarted, timeout=600)
    k.wait_for(f"{name} Ready again", lambda: (lambda p: len(p) == 2 and all(pod_ready(x) for x in p.values()))(
        group_pods(k, name)) and k.phase(name, "Ready"), timeout=1800)
    with k.port_forward(f"svc/{name}", 80) as url:
        chat(url, name)
    k.kubectl("delete", "ie", name, "-n", NS, "--wait=true")


# -- issue 14: model storage that loads once ----------------------------------------------------------------------
SHARED_CLASS, SHARED_DIR = "sluice-e2e-rwx", "/var/lib/sluice-e2e-shared"


def shared_volume() -> str:
    """A ReadWriteMany volume for the shared cache: kind's default provisioner (local-path) offers ReadWriteOnce
    only, so a static hostPath volume on the (single) node stands in for NFS/CephFS, in a class of its own."""
    return yaml.safe_dump_all([
        {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": SHARED_CLASS},
         "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "Immediate"},
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": SHARED_CLASS},
         "spec": {"capacity": {"storage": "5Gi"}, "accessModes": ["ReadWriteMany"],
                  "storageClassName": SHARED_CLASS, "persistentVolumeReclaimPolicy": "Retain",
                  "hostPath": {"path": SHARED_DIR, "type": "DirectoryOrCreate"}}},
    ])


def shared_cache_objects(k: Cluster, kind: str) -> list[dict[str, Any]]:
    out = k.kubectl("get", kind, "-n", NS, "-l", "sluice.dev/model-cache", "-o", "json")
    return [o for o in json.loads(out)["items"] if not o["metadata"].get("deletionTimestamp")]


def owner_names(obj: dict[str, Any]) -> set[str]:
    return {r["name"] for r in obj["metadata"].get("ownerReferences") or []}


@pytest.mark.timeout(5400)
def test_two_endpoints_share_one_download(stack: Cluster) -> None:
    k = stack
    # The static volume's directory: the engine's uid writes it (fsGroup does not apply to hostPath volumes).
    for node in run(KIND, "get", "nodes", "--name", CLUSTER).split():
        run(DOCKER, "exec", node, "sh", "-c", f"mkdir -p {SHARED_DIR} && chown 10001:10001 {SHARED_DIR}")
    k.kubectl("apply", "-f", "-", input=shared_volume())
    cache = {"type": "shared", "size": "2Gi", "storageClassName": SHARED_CLASS}
    names = ("smollm2-shared-a", "smollm2-shared-b")
    for name in names:
        k.kubectl("apply", "-n", NS, "-f", "-", input=example(name, model={
            "uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct", "revision": "main", "servedName": name,
            "cache": cache}))
    # One claim and one Job for both, co-owned by both.
    job = k.wait_for("one fetch Job owned by both endpoints", lambda: (lambda jobs: jobs[0] if len(jobs) == 1 and
                     owner_names(jobs[0]) == set(names) else None)(shared_cache_objects(k, "jobs")), timeout=300)
    (claim,) = shared_cache_objects(k, "pvc")
    assert claim["metadata"]["name"] == job["metadata"]["name"] and owner_names(claim) == set(names)
    for name in names:
        st = k.wait_for(f"{name} Ready", lambda name=name: k.phase(name, "Ready"), timeout=1800)
        assert condition(st, "ModelReady")["status"] == "True"
        with k.port_forward(f"svc/{name}", 80) as url:
            chat(url, name)
    # It downloaded once: one successful fetch pod, and the claim says it is complete.
    job = k.get("jobs", job["metadata"]["name"])
    assert job and job["status"].get("succeeded") == 1 and not job["status"].get("failed")
    fetch_pods = k.kubectl("get", "pods", "-n", NS, "-l", f"job-name={job['metadata']['name']}", "-o", "name").split()
    assert len(fetch_pods) == 1, fetch_pods
    claim = k.get("pvc", claim["metadata"]["name"])
    assert claim and claim["metadata"]["annotations"]["sluice.dev/model-complete"] == "true"
    reasons = k.event_reasons(names[0])
    assert "Loading" in reasons, reasons  # Downloading, then loading: never Failed on the way
    assert "Failed" not in reasons, reasons

    # Garbage collection: the claim outlives one endpoint, and goes with the last.
    k.kubectl("delete", "ie", names[0], "-n", NS, "--wait=true")
    k.wait_for("the claim owned by the other endpoint only", lambda: owner_names(
        k.get("pvc", claim["metadata"]["name"]) or {"metadata": {}}) == {names[1]}, timeout=300)
    k.kubectl("delete", "ie", names[1], "-n", NS, "--wait=true")
    k.wait_for("the shared claim and Job deleted with the last endpoint", lambda: not shared_cache_objects(k, "pvc")
               and not shared_cache_objects(k, "jobs"), timeout=300)
    k.kubectl("delete", "pv", SHARED_CLASS, "--ignore-not-found")


@pytest.mark.timeout(5400)
def test_node_local_cache_made_by_the_kubelet_is_handed_to_the_engine(stack: Cluster) -> None:
    """A hostPath cache nobody prepared: the kubelet creates it root-owned, the operator's init container hands
    it to the engine's uid, and the fetch writes there."""
    k, name, path = stack, "smollm2-node-cache", "/var/lib/sluice-e2e-fresh-cache"
    nodes = run(KIND, "get", "nodes", "--name", CLUSTER).split()
    for node in nodes:
        run(DOCKER, "exec", node, "rm", "-rf", path)
    k.kubectl("apply", "-n", NS, "-f", "-", input=example(name, model={
        "uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct", "servedName": name,
        "cache": {"type": "hostPath", "path": path}}))
    k.wait_for(f"{name} Ready", lambda: k.phase(name, "Ready"), timeout=1800)
    with k.port_forward(f"svc/{name}", 80) as url:
        chat(url, name)
    owners = {run(DOCKER, "exec", node, "sh", "-c", f"stat -c %u:%g {path} 2>/dev/null || true").strip()
              for node in nodes} - {""}
    assert owners == {"10001:10001"}, owners
    k.kubectl("delete", "ie", name, "-n", NS, "--wait=true")
