"""The operator, installed by the chart, against a real control plane (marker `cluster`; tests/support/dev_cluster.py).

`helm install charts/sluice` puts the CRD, RBAC, the operator's and the gateway's Deployments into the cluster
(their pods run on kwok's simulated nodes, which run no process). The operator under test is a real
`sluice operator` process on this machine, started with the args and SLUICE_* environment of the chart's own
Deployment and authenticated as the chart's ServiceAccount with a token from the TokenRequest API, so what the
chart's RBAC allows is what it can do. The optional kinds it renders come from their projects' own CRDs
(../shared/reference-crds: KEDA, the Prometheus operator, LeaderWorkerSet), so the real server validates them.

The LeaderWorkerSet controller runs (built from sigs.k8s.io/lws by scripts/get-control-plane.sh, started with
its admission webhooks by scripts/dev-cluster.sh, whose LWS CRDs, the module's own, stay as they are): the
multi-node examples' groups get their leader and worker pods, with LWS's labels and LWS_* environment, and
reach Ready. Where LWS could not be built those examples stay Pending and the LWS tests skip, saying so.
No KEDA controller runs here (not built yet): ScaledObjects are admitted and stored, and scaling is what KEDA's
HPA would do, through the Deployment's scale subresource.

In file order: every example reconciles with no 403, the KV Secret and NetworkPolicies (issue 39) and a hostPath
cache the default policy refuses, the multi-node groups as LWS makes them, LWS's webhooks
admitting what the operator renders, a ServedModel's status following its versions (issue 42), the printer
columns and the scale subresource, a spec edit rolls the pods, scale from zero, garbage collection, NameConflict, a verb removed from the ClusterRole, the gateway under
its own ServiceAccount finding the serving pods, and last the leader hand-over between two operator processes
on the real Lease.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from dev_cluster import ROOT, Cluster, tool, wait_until
from operator_schemas import CRD_FILE, EXAMPLES, load_yaml
from servers import free_port, stop_process

from sluice_operator.meta import ENDPOINT_LABEL, ROLE_LABEL, SERVING

pytestmark = pytest.mark.cluster

RELEASE, RELEASE_NS = "sluice", "sluice-system"
REFERENCE_CRDS = ROOT.parent / "shared" / "reference-crds"
# The chart's values for this cluster: the scaler's client certificate copied into the endpoint namespaces (the
# operator renders a TriggerAuthentication naming it), and a short resync so repairs show within seconds.
HELM_VALUES = ["--set", "gateway.scalerTLS.generate=true", "--set", "gateway.scalerTLS.namespaces={default,inference}",
               "--set-json", "extraArgs=[\"--resync-seconds\",\"3\"]"]
EXAMPLE_NAMESPACES = ("default", "inference")
LEASE = "sluice-operator"  # operator/sluice_operator/main.py LEASE_NAME


@dataclass
class OperatorProcess:
    """`sluice operator` as the chart's pod runs it, under the chart's ServiceAccount."""
    name: str
    args: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        log = open(self.log_path, "w")  # noqa: SIM115 - the child holds it; closed with the test session
        self.proc = subprocess.Popen([sys.executable, "-m", "sluice_engine.entrypoints.cli", "operator", *self.args],
                                     stdout=log, stderr=subprocess.STDOUT, env=self.env)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL: a node lost, no clean release of the Lease."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_process(self.proc)


@dataclass
class Stack:
    cluster: Cluster
    service_account: str
    kubeconfig: Path
    args: list[str]
    env: dict[str, str]
    workdir: Path
    operators: list[OperatorProcess] = field(default_factory=list)

    def operator(self, name: str) -> OperatorProcess:
        args = [a.replace("0.0.0.0:8080", f"127.0.0.1:{free_port()}") for a in self.args]  # the liveness URL
        if "--metrics-port" in args:
            args[args.index("--metrics-port") + 1] = str(free_port())
        env = {**os.environ, **self.env, "KUBECONFIG": str(self.kubeconfig), "POD_NAME": name,
               "POD_NAMESPACE": RELEASE_NS, "PYTHONUNBUFFERED": "1"}
        op = OperatorProcess(name, args, env, self.workdir / f"{name}.log").start()
        self.operators.append(op)
        return op

    def logs(self) -> str:
        return "".join(f"\n--- operator {op.name}\n{op.log()[-6000:]}" for op in self.operators)


def _chart_container(cluster: Cluster) -> dict[str, Any]:
    deploy = cluster.json("get", "deployment", RELEASE, "-n", RELEASE_NS)
    (container,) = [c for c in deploy["spec"]["template"]["spec"]["containers"] if c["name"] == "operator"]
    return {**container, "serviceAccountName": deploy["spec"]["template"]["spec"]["serviceAccountName"]}


def _install_optional_crds(cluster: Cluster) -> None:
    """The reference CRDs, except those the cluster already serves: LWS's, installed by dev-cluster.sh from
    the module of the controller it runs (v0.9.0 here; the reference copies are v0.10.x, whose schema only adds
    to it), which its controller and webhooks are written against."""
    if not REFERENCE_CRDS.is_dir():
        pytest.skip(f"{REFERENCE_CRDS} is missing (KEDA's, LWS's and the Prometheus operator's CRDs)")
    names = []
    for path in sorted(REFERENCE_CRDS.glob("*.yaml")):
        name = load_yaml(path)["metadata"]["name"]
        if cluster.get("crd", name) is None:
            cluster.kubectl("apply", "--server-side", "-f", str(path))
        names.append(name)
    cluster.wait_established(*names)


def _model_storage(cluster: Cluster, tmp: Path) -> None:
    """What the examples expect to exist: their Secrets, the PriorityClass multinode-70b.yaml names, and the
    claims they name (bound to pre-made hostPath PersistentVolumes: this cluster has no provisioner)."""
    for ns in EXAMPLE_NAMESPACES:
        cluster.kubectl("create", "namespace", ns, check=False)
    cluster.apply({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                   "metadata": {"name": "inference-high"}, "value": 1000})
    for name, key in (("hf-token", "HF_TOKEN"), ("s3-credentials", "AWS_ACCESS_KEY_ID")):
        cluster.kubectl("create", "secret", "generic", name, "-n", "inference", f"--from-literal={key}=x", check=False)
    for claim, mode in (("model-cache", "ReadWriteMany"), ("llama-weights", "ReadOnlyMany")):
        cluster.apply({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"pv-{claim}"},
                       "spec": {"capacity": {"storage": "500Gi"}, "accessModes": [mode], "storageClassName": "",
                                "hostPath": {"path": str(tmp / claim)},
                                "claimRef": {"namespace": "inference", "name": claim}}})
        cluster.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                       "metadata": {"name": claim, "namespace": "inference"},
                       "spec": {"accessModes": [mode], "storageClassName": "", "volumeName": f"pv-{claim}",
                                "resources": {"requests": {"storage": "500Gi"}}}})
    for claim in ("model-cache", "llama-weights"):
        wait_until(f"PVC {claim} bound", lambda c=claim: (cluster.get("pvc", c, "-n", "inference") or {})
                   .get("status", {}).get("phase") == "Bound", 30)


@pytest.fixture(scope="module")
def stack(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    helm = tool("helm")
    if helm is None:
        pytest.skip("no helm (scripts/get-helm.sh fetches one into .tools/bin)")
    workdir = tmp_path_factory.mktemp("operator")
    _install_optional_crds(cluster)
    _model_storage(cluster, workdir)
    install = subprocess.run([helm, "install", RELEASE, str(ROOT / "charts" / "sluice"), "-n", RELEASE_NS,
                              "--create-namespace", f"--kubeconfig={cluster.kubeconfig}", *HELM_VALUES],
                             capture_output=True, text=True, timeout=120)
    assert install.returncode == 0, install.stderr
    stack: Stack | None = None
    try:
        # The chart's own pods (operator and gateway) are scheduled and Ready on simulated nodes.
        for deploy in cluster.json("get", "deployments", "-n", RELEASE_NS)["items"]:
            cluster.kubectl("rollout", "status", f"deployment/{deploy['metadata']['name']}", "-n", RELEASE_NS,
                            "--timeout=90s", timeout=100)
        container = _chart_container(cluster)
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        kubeconfig = cluster.token_kubeconfig(workdir / "operator.kubeconfig", RELEASE_NS,
                                              container["serviceAccountName"])
        stack = Stack(cluster, container["serviceAccountName"], kubeconfig, container["args"], env, workdir)
        stack.operator("operator-a")
        wait_until("operator-a to hold the Lease", lambda: _holder(cluster) == "operator-a", 60)
        yield stack
    finally:
        try:
            # The endpoints go first, and their pods with them (the garbage collector, then kwok): the
            # multi-node groups hold whole GPU nodes that later modules' tests schedule onto.
            for ns in EXAMPLE_NAMESPACES:
                cluster.kubectl("delete", "inferenceendpoints", "--all", "-n", ns, "--timeout=60s", check=False,
                                timeout=90)
            wait_until("the endpoints' pods to go", lambda: not any(
                cluster.json("get", "pods", "-n", n, "-l", ENDPOINT_LABEL)["items"] for n in EXAMPLE_NAMESPACES), 90)
        finally:
            if stack is not None:
                for op in stack.operators:
                    op.stop()
            subprocess.run([helm, "uninstall", RELEASE, "-n", RELEASE_NS, f"--kubeconfig={cluster.kubeconfig}",
                            "--wait=false"], capture_output=True, timeout=120)


def _holder(cluster: Cluster) -> str | None:
    lease = cluster.get("lease", LEASE, "-n", RELEASE_NS)
    return lease["spec"].get("holderIdentity") if lease else None


def _endpoint(stack: Stack, name: str, ns: str) -> dict[str, Any]:
    ep = stack.cluster.get("inferenceendpoint", name, "-n", ns)
    assert ep is not None, f"endpoint {ns}/{name} is gone"
    return ep


def _condition(ep: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in ep.get("status", {}).get("conditions", []) if c["type"] == kind), {})


def _wait_phase(stack: Stack, name: str, ns: str, phases: set[str], timeout: float = 90) -> dict[str, Any]:
    def probe() -> Any:
        ep = _endpoint(stack, name, ns)
        status = ep.get("status", {})
        current = status.get("observedGeneration") == ep["metadata"]["generation"]
        return ep if current and status.get("phase") in phases else None
    try:
        return wait_until(f"{ns}/{name} in phase {sorted(phases)}", probe, timeout)
    except AssertionError as e:
        raise AssertionError(f"{e}\nstatus: {json.dumps(_endpoint(stack, name, ns).get('status'), indent=1)}"
                             f"{stack.logs()}") from None


def _apply_endpoint(stack: Stack, doc: dict[str, Any]) -> tuple[str, str]:
    doc = copy.deepcopy(doc)
    ns = doc["metadata"].setdefault("namespace", "default")
    stack.cluster.apply(doc)
    return doc["metadata"]["name"], ns


def _small(name: str, **spec: Any) -> dict[str, Any]:
    doc = load_yaml(ROOT / "examples" / "cpu-smollm2.yaml")
    doc["metadata"] = {"name": name, "namespace": "default"}
    doc["spec"].update(spec)
    return doc


def _serving_pods(stack: Stack, name: str, ns: str) -> list[dict[str, Any]]:
    selector = f"{ENDPOINT_LABEL}={name},{ROLE_LABEL}={SERVING}"  # the endpoint's status.selector
    return stack.cluster.json("get", "pods", "-n", ns, "-l", selector)["items"]


_LOG_TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[,.]\d+\s*")


def _forbidden(text: str) -> list[str]:
    # The timestamp goes first: its milliseconds are sometimes ",403". And 403 as a number of its own: a port such
    # as 127.0.0.1:40349 is none (seen in CI).
    return [line for line in text.splitlines()
            if re.search(r"(?<![0-9])403(?![0-9])", body := _LOG_TIMESTAMP.sub("", line))
            or "forbidden" in body.lower()]


def _require_lws(cluster: Cluster) -> None:
    if not cluster.lws:
        pytest.skip("no LeaderWorkerSet controller in this cluster: scripts/get-control-plane.sh could not build "
                    "it (its output says why; log: ~/.cache/sluice/control-plane/lws-*/build.log), so the "
                    "multi-node examples stay Pending")


# -- every example, under the chart's RBAC ---------------------------------------------------------------------
# What each example reaches here: single-node ones serve on simulated pods (an autoscaled one starts at the
# Deployment's default of 1 replica, the operator applying no count, until KEDA scales it); multi-node ones
# are LeaderWorkerSets whose groups LWS makes into pods (an autoscaled one at LWS's default of 1 replica), or,
# where no LWS controller runs, admitted and stored with no pods (Pending).
MULTI_NODE = {"multinode-70b.yaml": ("llama-70b", "inference", "NVIDIA-H100-80GB-HBM3"),
              "cpu-pipeline-2node.yaml": ("smollm2-pp2", "default", None)}  # name, namespace, GPU product
EXPECTED_PHASE = {"cpu-smollm2.yaml": {"Ready"}, "cpu-scale-to-zero.yaml": {"Ready", "Idle"}, "cpu-disaggregated.yaml": {"Ready"}, "gpu-8b.yaml": {"Ready"}, "gpu-8b-lora.yaml": {"Ready"},
                  "scale-to-zero.yaml": {"Ready"}, "gateway-api-inference-pool.yaml": {"Ready"},
                  **{example: {"Ready"} for example in MULTI_NODE}}


def _expected_phase(cluster: Cluster, example: str) -> set[str]:
    return {"Pending"} if example in MULTI_NODE and not cluster.lws else EXPECTED_PHASE[example]


def test_examples_reconcile_under_the_charts_service_account(stack: Stack) -> None:
    assert set(EXPECTED_PHASE) == {p.name for p in EXAMPLES}
    applied = {path.name: _apply_endpoint(stack, load_yaml(path)) for path in EXAMPLES}
    for example, (name, ns) in applied.items():
        expected = _expected_phase(stack.cluster, example)
        ep = _wait_phase(stack, name, ns, expected)
        reconciled = _condition(ep, "Reconciled")
        assert reconciled.get("status") == "True", (example, ep["status"])
        if expected == {"Ready"}:
            assert ep["status"]["replicas"]["ready"] == ep["status"]["replicas"]["desired"] >= 1, ep["status"]
    # Every child the renderer makes exists, owned by its endpoint.
    for example, (name, ns) in applied.items():
        ep = _endpoint(stack, name, ns)
        rendered = json.loads(subprocess.run([sys.executable, "-m", "sluice_engine.entrypoints.cli", "render", "-f",
                                              str(ROOT / "examples" / example), "-o", "json"],
                                             capture_output=True, text=True, check=True).stdout)
        for child in rendered["items"]:
            kind = child["kind"].lower() + "." + child["apiVersion"].split("/")[0] if "/" in child["apiVersion"] \
                else child["kind"].lower()
            live = stack.cluster.get(kind, child["metadata"]["name"], "-n", ns)
            assert live is not None, f"{example}: {child['kind']} {child['metadata']['name']} was not applied"
            owners = live["metadata"].get("ownerReferences", [])
            assert any(o["uid"] == ep["metadata"]["uid"] and o.get("controller") for o in owners), owners
    assert not _forbidden(stack.logs()), _forbidden(stack.logs())
    # The GPU example's pods landed on the nodes with the product it asks for.
    nodes = {p["spec"]["nodeName"] for p in _serving_pods(stack, "llama-8b", "inference")}
    assert nodes and all(stack.cluster.json("get", "node", n)["metadata"]["labels"]["nvidia.com/gpu.product"]
                         == "NVIDIA-L40S" for n in nodes), nodes


# -- ServedModel: model versions by weight (issue 42) ------------------------------------------------------------
def test_served_model_status_follows_its_versions(stack: Stack) -> None:
    """examples/model-versions/: two InferenceEndpoints and the ServedModel splitting `chat` 90/10 between them,
    admitted by the real API server (the CRD's rules) and given a status by the operator under the chart's RBAC:
    each version ready with its traffic share; a shift to 0/100 shows at once; a version missing is said."""
    cluster = stack.cluster
    ns = "versions"
    cluster.kubectl("create", "namespace", ns, check=False)
    try:
        folder = ROOT / "examples" / "model-versions"
        for endpoint in ("chat-v1.yaml", "chat-v2.yaml"):
            doc = load_yaml(folder / endpoint)
            doc["metadata"]["namespace"] = ns
            _apply_endpoint(stack, doc)
        for name in ("chat-v1", "chat-v2"):
            _wait_phase(stack, name, ns, {"Ready"})
        model = load_yaml(folder / "servedmodel.yaml")
        model["metadata"]["namespace"] = ns
        cluster.apply(model)

        def status(want: dict[str, int], reason: str) -> Any:
            def probe() -> Any:
                sm = cluster.get("servedmodel", "chat", "-n", ns) or {}
                got = {v["endpoint"]: v.get("trafficPercent") for v in (sm.get("status") or {}).get("versions") or []}
                ready = _condition(sm, "Ready")
                return sm if got == want and ready.get("reason") == reason else None
            try:
                return wait_until(f"ServedModel {ns}/chat at {want} ({reason})", probe, 60)
            except AssertionError as e:
                raise AssertionError(f"{e}\n{json.dumps(cluster.get('servedmodel', 'chat', '-n', ns), indent=1)}"
                                     f"{stack.logs()}") from None

        sm = status({"chat-v1": 90, "chat-v2": 10}, "VersionsReady")
        assert all(v["ready"] for v in sm["status"]["versions"]), sm["status"]
        cluster.kubectl("patch", "servedmodel", "chat", "-n", ns, "--type=merge", "-p", json.dumps(
            {"spec": {"versions": [{"endpoint": "chat-v1", "weight": 0}, {"endpoint": "chat-v2", "weight": 100}]}}))
        status({"chat-v1": 0, "chat-v2": 100}, "VersionsReady")
        # The CRD's own rules: a weightless split is refused with its reason.
        out = cluster.kubectl("patch", "servedmodel", "chat", "-n", ns, "--type=merge", "-p", json.dumps(
            {"spec": {"versions": [{"endpoint": "chat-v1", "weight": 0}]}}), check=False)
        assert out.returncode != 0 and "weight" in out.stderr, out.stderr
        cluster.kubectl("delete", "inferenceendpoint", "chat-v1", "-n", ns, "--wait=false")
        wait_until("the missing version in the ServedModel's status", lambda: _condition(
            cluster.get("servedmodel", "chat", "-n", ns) or {}, "Ready").get("reason") == "EndpointNotFound", 60)
        assert not _forbidden(stack.logs()), _forbidden(stack.logs())
    finally:  # the Prometheus test, later on this cluster, must not find these endpoints' ServiceMonitors
        cluster.kubectl("delete", "servedmodels,inferenceendpoints", "--all", "-n", ns, "--timeout=60s", check=False,
                        timeout=90)
        wait_until("the versions' ServiceMonitors to go", lambda: not cluster.kubectl(
            "get", "servicemonitors.monitoring.coreos.com", "-n", ns, "-o", "name", check=False).stdout.strip(), 60)


# -- spec.routing.inferencePool: the Gateway API Inference Extension objects -----------------------------------
def test_routing_objects_applied_and_pool_status_folded(stack: Stack) -> None:
    """examples/gateway-api-inference-pool.yaml (as the examples test applied it), against the projects' own CRDs (dev-cluster.sh):
    the operator, under the chart's RBAC, made the picker's Role (a Role grants only what its creator holds) and
    the InferencePool; what a gateway writes into the pool's status reaches the endpoint's conditions at the
    next resync; without spec.routing the objects are pruned."""
    from sluice_operator.routing import PICKER_RULES

    cluster = stack.cluster
    if cluster.gateway_crds is None:
        pytest.skip("no Gateway API CRDs in this cluster (scripts/get-gateway-crds.sh could not fetch them)")
    name, ns = _apply_endpoint(stack, load_yaml(ROOT / "examples" / "gateway-api-inference-pool.yaml"))  # as above
    ep = _wait_phase(stack, name, ns, {"Ready"})
    pool = cluster.get("inferencepool", name, "-n", ns)
    assert pool is not None and pool["metadata"]["ownerReferences"][0]["uid"] == ep["metadata"]["uid"]
    assert _condition(ep, "InferencePoolAccepted")["reason"] == "NoParents", ep["status"]
    role = cluster.get("role", f"{name}-epp", "-n", ns)
    assert role is not None and role["rules"] == [dict(r) for r in PICKER_RULES], role
    cluster.kubectl("rollout", "status", f"deployment/{name}-epp", "-n", ns, "--timeout=60s", timeout=70)
    parent = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": "infra", "name": "shared-gw"}
    status = {"parents": [{"parentRef": parent, "controllerName": "gateway.example/controller", "conditions": [
        {"type": "Accepted", "status": "True", "reason": "Accepted", "message": "routing",
         "lastTransitionTime": "2026-01-01T00:00:00Z"},
        {"type": "ResolvedRefs", "status": "False", "reason": "InvalidExtensionRef",
         "message": "the picker Service has no ready endpoint", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}]}
    cluster.kubectl("patch", "inferencepool", name, "-n", ns, "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": status}))

    def folded() -> Any:
        ep = _endpoint(stack, name, ns)
        accepted, refs = _condition(ep, "InferencePoolAccepted"), _condition(ep, "InferencePoolResolvedRefs")
        return ep if accepted.get("status") == "True" and refs.get("reason") == "InvalidExtensionRef" else None
    ep = wait_until("the pool's status in the endpoint's conditions", folded, 30)
    assert "Gateway infra/shared-gw" in _condition(ep, "InferencePoolResolvedRefs")["message"]
    # Without spec.routing: the pool, the route and the picker go.
    cluster.kubectl("patch", "inferenceendpoint", name, "-n", ns, "--type=merge", "-p",
                    json.dumps({"spec": {"routing": None}}))
    wait_until("the routing objects to be pruned", lambda: all(cluster.get(kind, obj, "-n", ns) is None for kind, obj in (
        ("inferencepool", name), ("httproute", name), ("deployment", f"{name}-epp"), ("role", f"{name}-epp"))), 30)
    assert not _forbidden(stack.logs()), _forbidden(stack.logs())


# -- issue 39: the KV key and the NetworkPolicies, as the operator makes them under the chart's RBAC --------------
def test_the_kv_secret_and_the_network_policies_are_made_under_the_charts_rbac(stack: Stack) -> None:
    """The disaggregated example (applied above) has its KV Secret, created by the operator with the chart's
    create-only right on Secrets, owned by the endpoint and mounted by both pools, whose pods the API server
    admitted; every endpoint has its NetworkPolicies, the group ones for each multi-node group index; the chart
    renders no namespace-wide engine policy."""
    doc = load_yaml(ROOT / "examples" / "cpu-disaggregated.yaml")
    name, ns = doc["metadata"]["name"], doc["metadata"].get("namespace", "default")
    ep = _wait_phase(stack, name, ns, {"Ready"})
    secret = stack.cluster.get("secret", f"{name}-kv", "-n", ns)
    assert secret is not None, stack.logs()
    assert secret["immutable"] is True and secret["type"] == "Opaque"
    key = base64.b64decode(secret["data"]["kv-secret"]).decode()
    assert re.fullmatch(r"[0-9a-f]{64}", key)
    (owner,) = secret["metadata"]["ownerReferences"]
    assert owner["uid"] == ep["metadata"]["uid"] and owner["controller"]
    pods = stack.cluster.json("get", "pods", "-n", ns, "-l", f"{ENDPOINT_LABEL}={name}")["items"]
    assert {p["metadata"]["labels"][ROLE_LABEL] for p in pods} == {"serving", "prefill"}
    for pod in pods:
        assert any(v.get("secret", {}).get("secretName") == f"{name}-kv" for v in pod["spec"]["volumes"])
        assert "--kv-secret-file" in _engine(pod)["args"]
    for pool in (name, f"{name}-prefill"):
        policy = stack.cluster.get("networkpolicy", pool, "-n", ns)
        assert policy is not None and policy["metadata"]["ownerReferences"][0]["uid"] == ep["metadata"]["uid"]
    # A pass over the endpoint later keeps the key (the operator never writes it again).
    stack.cluster.kubectl("annotate", "inferenceendpoint", name, "-n", ns, "touched=yes", "--overwrite")
    time.sleep(5)
    again = stack.cluster.get("secret", f"{name}-kv", "-n", ns)
    assert again["data"] == secret["data"] and again["metadata"]["uid"] == secret["metadata"]["uid"]
    for n in EXAMPLE_NAMESPACES:
        labels = [p["metadata"].get("labels", {}) for p in
                  stack.cluster.json("get", "networkpolicies", "-n", n)["items"]]
        assert all(lb.get("app.kubernetes.io/component") != "engines" for lb in labels), labels
    assert not _forbidden(stack.logs()), _forbidden(stack.logs())


def test_a_host_path_cache_outside_the_default_prefixes_is_refused(stack: Stack) -> None:
    """The chart's default policy: a hostPath cache at /etc (which a root init container would hand to the engine's
    user) is refused whole, naming the field; nothing is applied."""
    doc = _small("etc-cache", model={**_small("x")["spec"]["model"], "cache": {"type": "hostPath", "path": "/etc"}})
    name, ns = _apply_endpoint(stack, doc)
    try:
        ep = _wait_phase(stack, name, ns, {"Failed"})
        ready = _condition(ep, "Ready")
        assert ready["reason"] == "PolicyViolation", ready
        assert "spec.model.cache.path: hostPath '/etc'" in ready["message"]
        assert "policy.hostPath.pathPrefixes" in ready["message"]
        assert stack.cluster.get("configmap", f"{name}-engine", "-n", ns) is None
    finally:
        stack.cluster.kubectl("delete", "inferenceendpoint", name, "-n", ns, "--wait=false")


# -- LeaderWorkerSet: the multi-node groups ---------------------------------------------------------------------
LWS_NAME, LWS_GROUP_INDEX, LWS_WORKER_INDEX = (f"leaderworkerset.sigs.k8s.io/{k}"
                                               for k in ("name", "group-index", "worker-index"))


def _engine(pod: dict[str, Any]) -> dict[str, Any]:
    (engine,) = [c for c in pod["spec"]["containers"] if c["name"] == "engine"]
    return engine


def _owner_kinds(obj: dict[str, Any]) -> list[str]:
    return [o["kind"] for o in obj["metadata"].get("ownerReferences", [])]


@pytest.mark.parametrize("example", sorted(MULTI_NODE))
def test_multi_node_groups_run_as_lws_makes_them(stack: Stack, example: str) -> None:
    # What the engine's multi-node launch relies on (docs/operator.md, "What runs"): every pod of a group gets
    # LWS's group labels and LWS_LEADER_ADDRESS (the leader's name under the group's headless Service) and
    # LWS_WORKER_INDEX (0 on the leader), which the kubelet expands in --master-addr and --node-rank.
    _require_lws(stack.cluster)
    name, ns, product = MULTI_NODE[example]
    ep = _wait_phase(stack, name, ns, {"Ready"})  # test_examples_... applied it
    size = stack.cluster.json("get", "leaderworkerset", name, "-n", ns)["spec"]["leaderWorkerTemplate"]["size"]
    assert size == 2, size

    def group() -> Any:
        pods = stack.cluster.json("get", "pods", "-n", ns, "-l", f"{LWS_NAME}={name}")["items"]
        ready = [p for p in pods if any(c["type"] == "Ready" and c["status"] == "True"
                                        for c in p["status"].get("conditions", []))]
        return pods if len(pods) == len(ready) == size else None
    pods = sorted(wait_until(f"the {size} pods of {ns}/{name}'s group Ready", group, 60),
                  key=lambda p: int(p["metadata"]["labels"][LWS_WORKER_INDEX]))
    leader, worker = pods
    assert leader["metadata"]["name"] == f"{name}-0" and worker["metadata"]["name"] == f"{name}-0-1", pods
    for index, pod in enumerate(pods):
        labels, engine = pod["metadata"]["labels"], _engine(pod)
        env, args = {e["name"]: e.get("value") for e in engine["env"]}, engine["args"]
        assert labels[LWS_NAME] == name and labels[LWS_GROUP_INDEX] == "0", labels
        assert labels[LWS_WORKER_INDEX] == str(index), labels
        assert labels[ENDPOINT_LABEL] == name and labels[ROLE_LABEL] == SERVING, labels
        assert env["LWS_LEADER_ADDRESS"] == f"{name}-0.{name}-0.{ns}", env  # <leader pod>.<group's Service>
        assert pod["spec"]["subdomain"] == f"{name}-0", pod["spec"]
        assert env["LWS_WORKER_INDEX"] == str(index) and env["LWS_GROUP_SIZE"] == str(size), env
        assert args[args.index("--master-addr") + 1] == "$(LWS_LEADER_ADDRESS)", args
        assert args[args.index("--node-rank") + 1] == ("0" if index == 0 else "$(LWS_WORKER_INDEX)"), args
    assert len({p["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/group-key"] for p in pods}) == 1, pods
    # The group's NetworkPolicy (issue 39) selects exactly these pods, by the labels LWS gave them, and admits
    # them (every port) and no other pod of the endpoint; the endpoint's own policy selects them too.
    policy = stack.cluster.get("networkpolicy", f"{name}-group-0", "-n", ns)
    assert policy is not None
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert all(all(p["metadata"]["labels"].get(k) == v for k, v in selector.items()) for p in pods), selector
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": selector}}]}]
    assert selector[LWS_GROUP_INDEX] == "0" and selector[LWS_NAME] == name
    # LWS_LEADER_ADDRESS resolves under the group's headless Service, named after the leader pod, which
    # publishes the pods before they are Ready (the rendezvous comes first): its EndpointSlice holds the
    # leader's hostname and address, what cluster DNS answers for <leader>.<Service>.<namespace>.
    group_service = stack.cluster.json("get", "service", f"{name}-0", "-n", ns)["spec"]
    assert group_service["clusterIP"] == "None" and group_service["publishNotReadyAddresses"], group_service
    assert group_service["selector"] == {LWS_NAME: name, LWS_GROUP_INDEX: "0"}, group_service

    def published() -> Any:
        slices = stack.cluster.json("get", "endpointslices", "-n", ns, "-l",
                                    f"kubernetes.io/service-name={name}-0")["items"]
        return {e.get("hostname"): e["addresses"] for s in slices for e in s.get("endpoints") or []} or None
    endpoints = wait_until(f"the EndpointSlice of Service {name}-0", published, 30)
    assert endpoints.get(leader["metadata"]["name"]) == [leader["status"]["podIP"]], endpoints
    # The endpoint's own Service (the URL) stays its own: a ClusterIP selecting the leader only.
    service = stack.cluster.json("get", "service", name, "-n", ns)
    assert service["spec"]["type"] == "ClusterIP" and service["spec"]["clusterIP"] != "None", service["spec"]
    assert _owner_kinds(service) == ["InferenceEndpoint"], service["metadata"]
    if product:  # 8 GPUs a pod: one whole node each, of the product asked for
        nodes = [p["spec"]["nodeName"] for p in pods]
        assert len(set(nodes)) == size, nodes
        assert all(stack.cluster.json("get", "node", n)["metadata"]["labels"]["nvidia.com/gpu.product"] == product
                   for n in nodes), nodes
    # The operator counts LWS's ready groups: one replica, ready.
    lws = stack.cluster.json("get", "leaderworkerset", name, "-n", ns)
    assert lws["status"]["readyReplicas"] == 1, lws["status"]
    assert ep["status"]["replicas"]["ready"] == ep["status"]["replicas"]["desired"] == 1, ep["status"]


def test_lws_webhooks_admit_what_the_operator_renders(stack: Stack) -> None:
    # The LeaderWorkerSet `sluice render` makes of the 70B example, created through the apiserver as a dry run,
    # passes LWS's defaulting and validating webhooks as it is (both failurePolicy Fail: no answer, no
    # admission); the same object with a rollout that could never replace a group is refused by the validating
    # webhook (the CRD's schema allows it; the InferenceEndpoint CRD refuses the spec.rollout that would render
    # it). The examples' LeaderWorkerSets went through both webhooks too.
    _require_lws(stack.cluster)
    rendered = json.loads(subprocess.run([sys.executable, "-m", "sluice_engine.entrypoints.cli", "render", "-f",
                                          str(ROOT / "examples" / "multinode-70b.yaml"), "-o", "json"],
                                         capture_output=True, text=True, check=True).stdout)
    (lws,) = [o for o in rendered["items"] if o["kind"] == "LeaderWorkerSet"]
    lws["metadata"]["name"] = "admission-check"
    del lws["metadata"]["ownerReferences"]  # the placeholder owner of `sluice render`

    def dry_run(doc: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        return stack.cluster.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-",
                                     stdin=json.dumps(doc), check=False)
    admitted = dry_run(lws)
    assert admitted.returncode == 0, admitted.stderr
    spec = json.loads(admitted.stdout)["spec"]
    assert spec["networkConfig"] == lws["spec"]["networkConfig"] == {"subdomainPolicy": "UniquePerReplica"}, spec
    assert spec["leaderWorkerTemplate"]["size"] == 2 and spec["replicas"] == 1, spec  # replicas: the CRD's default
    broken = copy.deepcopy(lws)
    broken["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"] = {"maxSurge": 0, "maxUnavailable": 0}
    refused = dry_run(broken)
    assert refused.returncode != 0, refused.stdout
    assert 'admission webhook "vleaderworkerset.kb.io" denied the request' in refused.stderr, refused.stderr
    assert "must not be 0 when `maxSurge` is 0" in refused.stderr, refused.stderr


def test_printer_columns_and_the_scale_subresource(stack: Stack) -> None:
    table = stack.cluster.kubectl("get", "inferenceendpoint", "smollm2", "-n", "default").stdout.split("\n")
    header, row = table[0].split(), table[1].split()
    assert header[:6] == ["NAME", "MODEL", "PHASE", "READY", "DESIRED", "URL"], header
    assert row[:5] == ["smollm2", "hf://HuggingFaceTB/SmolLM2-135M-Instruct", "Ready", "1", "1"], row
    stack.cluster.kubectl("scale", "inferenceendpoint/smollm2", "-n", "default", "--replicas=2")
    ep = wait_until("2 ready replicas", lambda: (e := _endpoint(stack, "smollm2", "default")).get("status", {})
                    .get("replicas", {}).get("ready") == 2 and e, 90)
    assert ep["spec"]["replicas"] == 2
    scale = stack.cluster.json("get", "inferenceendpoint", "smollm2", "-n", "default", "--subresource=scale")
    assert scale["spec"]["replicas"] == 2 and scale["status"]["replicas"] == 2, scale
    assert scale["status"]["selector"], scale  # what an HPA would select the pods by
    assert stack.cluster.json("get", "deployment", "smollm2", "-n", "default")["spec"]["replicas"] == 2
    stack.cluster.kubectl("scale", "inferenceendpoint/smollm2", "-n", "default", "--replicas=1")


def test_spec_edit_rolls_the_pods_as_rollout_says(stack: Stack) -> None:
    name, ns = _apply_endpoint(stack, _small("rolling", replicas=2, rollout={"maxSurge": 1, "maxUnavailable": 0}))
    _wait_phase(stack, name, ns, {"Ready"})
    deploy = stack.cluster.json("get", "deployment", name, "-n", ns)
    assert deploy["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    before = {p["metadata"]["name"] for p in _serving_pods(stack, name, ns)}
    stack.cluster.kubectl("patch", "inferenceendpoint", name, "-n", ns, "--type=merge",
                          "-p", json.dumps({"spec": {"engine": {"maxModelLen": 1024}}}))
    _wait_phase(stack, name, ns, {"Ready"})
    stack.cluster.kubectl("rollout", "status", f"deployment/{name}", "-n", ns, "--timeout=90s", timeout=100)
    deploy = stack.cluster.json("get", "deployment", name, "-n", ns)
    assert deploy["metadata"]["generation"] >= 2 and deploy["status"]["updatedReplicas"] == 2

    def replaced() -> Any:
        live = {p["metadata"]["name"] for p in _serving_pods(stack, name, ns) if not p["metadata"].get("deletionTimestamp")}
        return live if len(live) == 2 and not live & before else None
    wait_until("both pods replaced", replaced, 60)


def test_scale_from_zero_through_the_deployments_scale_subresource(stack: Stack) -> None:
    # KEDA (its HPA above one replica) scales the Deployment through its scale subresource; the operator owns
    # no replica count of an autoscaled endpoint, so its resyncs leave that alone: Ready -> Idle -> Ready.
    stack.cluster.kubectl("scale", "deployment/qwen-7b", "-n", "inference", "--replicas=0")
    ep = _wait_phase(stack, "qwen-7b", "inference", {"Idle"})
    wait_until("the serving pod to go", lambda: not _serving_pods(stack, "qwen-7b", "inference"), 60)
    assert stack.cluster.get("deployment", "qwen-7b-warm", "-n", "inference")["status"]["readyReplicas"] == 1
    stack.cluster.kubectl("scale", "deployment/qwen-7b", "-n", "inference", "--replicas=1")
    ep = _wait_phase(stack, "qwen-7b", "inference", {"Ready"})
    assert ep["status"]["replicas"]["ready"] == 1
    generation = ep["status"].get("observedGeneration")
    time.sleep(7)  # two of the operator's 3 s resyncs (HELM_VALUES) pass
    assert stack.cluster.json("get", "deployment", "qwen-7b", "-n", "inference")["spec"]["replicas"] == 1
    assert _endpoint(stack, "qwen-7b", "inference")["status"]["phase"] == "Ready"
    assert _endpoint(stack, "qwen-7b", "inference")["status"].get("observedGeneration") == generation


def test_deleting_an_endpoint_garbage_collects_its_children(stack: Stack) -> None:
    name, ns = _apply_endpoint(stack, _small("collected"))
    _wait_phase(stack, name, ns, {"Ready"})
    children = [("deployment", name), ("service", name), ("configmap", f"{name}-engine"),
                ("poddisruptionbudget", name)]
    assert all(stack.cluster.get(kind, n, "-n", ns) for kind, n in children)
    stack.cluster.kubectl("delete", "inferenceendpoint", name, "-n", ns, "--timeout=60s")
    wait_until("the garbage collector to delete every child",
               lambda: [c for c in children if stack.cluster.get(c[0], c[1], "-n", ns)] == [] or None, 60)
    wait_until("the pods to go", lambda: not _serving_pods(stack, name, ns), 60)


def test_an_unowned_object_of_a_childs_name_is_left_alone(stack: Stack) -> None:
    mine = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "squatter", "namespace": "default",
                                                                "labels": {"owner": "someone-else"}},
            "spec": {"ports": [{"port": 1234}], "selector": {"app": "theirs"}}}
    stack.cluster.kubectl("create", "-f", "-", stdin=json.dumps(mine))
    try:
        name, ns = _apply_endpoint(stack, _small("squatter"))
        ep = _wait_phase(stack, name, ns, {"Failed"})
        reconciled = _condition(ep, "Reconciled")
        assert reconciled["status"] == "False" and reconciled["reason"] == "NameConflict", ep["status"]
        assert "Service" in reconciled["message"] and "squatter" in reconciled["message"], reconciled
        live = stack.cluster.json("get", "service", "squatter", "-n", "default")
        assert live["spec"]["ports"][0]["port"] == 1234 and live["metadata"]["labels"] == {"owner": "someone-else"}
        assert not live["metadata"].get("ownerReferences")
        stack.cluster.kubectl("delete", "inferenceendpoint", name, "-n", ns, "--timeout=60s")
        assert stack.cluster.get("service", "squatter", "-n", "default") is not None  # not collected either
    finally:
        stack.cluster.kubectl("delete", "service", "squatter", "-n", "default", check=False)


def test_a_verb_removed_from_the_cluster_role_fails_that_operation_clearly(stack: Stack) -> None:
    role = stack.cluster.json("get", "clusterrole", RELEASE)
    original = copy.deepcopy(role["rules"])
    rule = next(r for r in role["rules"] if r.get("apiGroups") == ["apps"] and "deployments" in r["resources"])
    rule["verbs"] = [v for v in rule["verbs"] if v != "patch"]
    stack.cluster.kubectl("patch", "clusterrole", RELEASE, "--type=merge", "-p", json.dumps({"rules": role["rules"]}))
    try:
        name, ns = _apply_endpoint(stack, _small("no-patch"))
        ep = _wait_phase(stack, name, ns, {"Failed"})
        reconciled = _condition(ep, "Reconciled")
        assert reconciled["status"] == "False" and reconciled["reason"] == "ApplyFailed", ep["status"]
        who = f"system:serviceaccount:{RELEASE_NS}:{stack.service_account}"
        assert "forbidden" in reconciled["message"] and who in reconciled["message"], reconciled
        assert 'cannot patch resource "deployments" in API group "apps"' in reconciled["message"], reconciled
        assert stack.cluster.get("deployment", name, "-n", ns) is None
        assert stack.cluster.get("service", name, "-n", ns) is not None  # the rest was applied
    finally:
        stack.cluster.kubectl("patch", "clusterrole", RELEASE, "--type=merge", "-p", json.dumps({"rules": original}))
    _wait_phase(stack, name, ns, {"Ready"})  # with the verb back, the next resync completes it
    stack.cluster.kubectl("delete", "inferenceendpoint", name, "-n", ns, "--timeout=60s")


def test_the_gateway_under_its_service_account_finds_the_serving_pods(stack: Stack) -> None:
    # `sluice gateway --kubernetes` as the chart runs it, authenticated as the chart's gateway ServiceAccount
    # (through `kubectl proxy` with its token: the gateway reads in-cluster credentials only): it lists and
    # watches the endpoints and the EndpointSlices the real controller made of the kwok pods, with no 403.
    cluster = stack.cluster
    deploy = cluster.json("get", "deployment", f"{RELEASE}-gateway", "-n", RELEASE_NS)
    account = deploy["spec"]["template"]["spec"]["serviceAccountName"]
    kubeconfig = cluster.token_kubeconfig(stack.workdir / "gateway.kubeconfig", RELEASE_NS, account)
    proxy_port, port = free_port(), free_port()
    logs = {name: stack.workdir / f"{name}.log" for name in ("proxy", "gateway")}
    with open(logs["proxy"], "w") as proxy_log, open(logs["gateway"], "w") as gateway_log:
        proxy = subprocess.Popen([cluster.kubectl_path, f"--kubeconfig={kubeconfig}", "proxy", "--address=127.0.0.1",
                                  f"--port={proxy_port}"], stdout=proxy_log, stderr=subprocess.STDOUT)
        gateway = subprocess.Popen(
            [sys.executable, "-m", "sluice_engine.entrypoints.cli", "gateway", "--kubernetes", "--kube-api",
             f"http://127.0.0.1:{proxy_port}", "--host", "127.0.0.1", "--port", str(port),
             "--scaler-port", str(free_port()), "--peer-port", str(free_port())],
            stdout=gateway_log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            (pod,) = _serving_pods(stack, "smollm2", "default")
            backend = f"http://{pod['status']['podIP']}:8000"
            wait_until("the gateway to add smollm2's serving pod", lambda: f"serving backend {backend} added"
                       in logs["gateway"].read_text(), 60)
            import httpx

            models = {m["id"]: m for m in httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"]}
            assert models["default/smollm2"]["served_name"] == "smollm2", models
            # gpu-8b.yaml and gpu-8b-lora.yaml serve one name in one namespace: the endpoint created first holds
            # it (creationTimestamp has one-second resolution; a tie goes to the smaller key), the other is
            # logged as a conflict. Which one was first depends on when the examples were applied.
            served = load_yaml(ROOT / "examples" / "gpu-8b.yaml")["spec"]["model"]["servedName"]
            claimants = sorted((_endpoint(stack, name, "inference")["metadata"]["creationTimestamp"],
                                f"inference/{name}") for name in ("llama-8b", "llama-8b-lora"))
            assert models[f"inference/{served}"]["endpoint"] == claimants[0][1], (claimants, models)
            loser = claimants[1][1]
            wait_until("the gateway to log the name conflict", lambda: f"endpoint {loser} claims it"
                       in logs["gateway"].read_text(), 10)
        finally:
            for proc in (gateway, proxy):
                stop_process(proc)
    text = logs["gateway"].read_text() + logs["proxy"].read_text()
    assert not _forbidden(text), _forbidden(text)


def test_leader_hand_over_on_the_real_lease(stack: Stack) -> None:
    (leader,) = [op for op in stack.operators if op.proc and op.proc.poll() is None]
    assert _holder(stack.cluster) == leader.name
    standby = stack.operator("operator-b")
    wait_until("operator-b to wait as a candidate", lambda: standby.log().strip() or None, 30)
    # The standby reconciles nothing while the leader holds the Lease.
    name, ns = _apply_endpoint(stack, _small("while-a-leads"))
    _wait_phase(stack, name, ns, {"Ready"})
    assert _holder(stack.cluster) == leader.name and "while-a-leads" not in standby.log()
    leader.kill()
    wait_until("operator-b to take the Lease", lambda: _holder(stack.cluster) == "operator-b", 60)
    name, ns = _apply_endpoint(stack, _small("after-hand-over"))
    _wait_phase(stack, name, ns, {"Ready"})
    assert standby.proc is not None and standby.proc.poll() is None, standby.log()
    for n in ("while-a-leads", "after-hand-over"):
        stack.cluster.kubectl("delete", "inferenceendpoint", n, "-n", ns, "--timeout=60s")


def test_crd_comes_from_the_chart(stack: Stack) -> None:
    # The chart's CRD is the one the operator tests and the docs describe (charts/sluice/crds is a copy).
    served = stack.cluster.json("get", "crd", load_yaml(CRD_FILE)["metadata"]["name"])
    assert served["spec"]["versions"][0]["schema"] == load_yaml(CRD_FILE)["spec"]["versions"][0]["schema"]
