"""The CRD against a real Kubernetes control plane (marker `cluster`; tests/support/dev_cluster.py: built from Go modules,
run on 127.0.0.1 with kwok's simulated nodes).

What the in-process twins (tests/support/operator_schemas.py: jsonschema plus cel-python) can only approximate, the
real server decides here: the CRD is accepted and Established, every example endpoint is admitted, and every
hostile spec the twin tests use is refused, by the CRD's own CEL rule with the same message the Python twin
(`sluice render`, the operator) gives, or by the schema naming the same field. A plain Deployment gets
Running, Ready pods on a simulated node, and a GPU request lands on a GPU node.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import test_operator_pod_fields as pod_fields
import test_operator_spec as spec_cases
from dev_cluster import ROOT, Cluster, wait_until
from operator_schemas import CRD_FILE, EXAMPLES, load_yaml

from sluice_operator.spec import SpecError, parse_endpoint

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def crd(cluster: Cluster) -> Cluster:
    cluster.kubectl("apply", "--server-side", "-f", str(CRD_FILE))
    name = load_yaml(CRD_FILE)["metadata"]["name"]
    cluster.wait_established(name)
    for ns in ("ml", "inference"):  # the namespaces the examples and the hostile specs name
        cluster.kubectl("create", "namespace", ns, check=False)
    return cluster


def dry_run_create(cluster: Cluster, doc: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    # kubectl's default --validate=strict: the server refuses unknown fields, as it does for users.
    return cluster.kubectl("create", "--dry-run=server", "-f", "-", "-o", "name", stdin=json.dumps(doc),
                           check=False)


# -- the CRD and the examples ----------------------------------------------------------------------------------
def test_crd_is_established_with_its_subresources(crd: Cluster) -> None:
    name = load_yaml(CRD_FILE)["metadata"]["name"]
    served = crd.json("get", f"crd/{name}")
    conditions = {c["type"]: c["status"] for c in served["status"]["conditions"]}
    assert conditions.get("Established") == "True" and conditions.get("NamesAccepted") == "True", conditions
    version = next(v for v in served["spec"]["versions"] if v["storage"])
    assert set(version.get("subresources", {})) == {"status", "scale"}
    resources = crd.kubectl("api-resources", "--api-group=sluice.dev", "-o", "name").stdout.split()
    assert resources == [name]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_admitted(crd: Cluster, path: Path) -> None:
    doc = load_yaml(path)
    assert doc["kind"] == "InferenceEndpoint"
    proc = crd.kubectl("apply", "--server-side", "--dry-run=server", "-f", str(path), check=False)
    assert proc.returncode == 0, proc.stderr


def test_examples_are_stored_with_the_server_defaults(crd: Cluster) -> None:
    # A real create: the schema's defaults are applied by the server, and the twin applies the same.
    doc = load_yaml(ROOT / "examples" / "cpu-smollm2.yaml")
    doc["metadata"] = {"name": "defaults", "namespace": "ml"}
    crd.kubectl("create", "-f", "-", stdin=json.dumps(doc))
    try:
        stored = crd.json("get", "inferenceendpoint/defaults", "-n", "ml")
        parsed = parse_endpoint(stored).spec
        assert parsed == parse_endpoint(doc).spec  # defaulting by the server changes nothing the operator sees
    finally:
        crd.kubectl("delete", "inferenceendpoint/defaults", "-n", "ml", "--wait=false")


# -- hostile specs: the real server refuses each, and says what the Python twin says ----------------------------
def _cases() -> list[Any]:
    out = []
    for case in spec_cases.INVALID:
        doc, _, _ = case.values
        out.append(pytest.param(doc, id=f"spec-{case.id}"))
    for case in pod_fields.TYPOS + pod_fields.RULES:
        pod = case.values[0]
        out.append(pytest.param(pod_fields.with_pod(**pod), id=f"pod-{case.id}"))
    for path in ("/", "//", "relative/dir", "/var/../etc", "/a/.."):
        doc = copy.deepcopy(pod_fields.BASE)
        doc["spec"]["model"]["cache"] = {"type": "hostPath", "path": path}
        out.append(pytest.param(doc, id=f"hostpath-cache-{path}"))
    return out


def _rule_messages(node: Any) -> set[str]:
    if isinstance(node, dict):
        own = {r["message"] for r in node.get("x-kubernetes-validations", [])}
        return own.union(*(_rule_messages(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_rule_messages(v) for v in node))
    return set()


RULE_MESSAGES = _rule_messages(load_yaml(CRD_FILE))
# A field error, one per line (the first follows `... is invalid: `): `path: Invalid value: rest`, where a CEL
# rule's failure has its message as the rest; `path: Required value`, `path: Unsupported value: ...`.
FIELD_ERROR = re.compile(r'(?P<path>[^\s:]+): (?P<kind>Invalid value|Unsupported value|Required value|Forbidden'
                         r'|Too long|Too many|Duplicate value)(?:: (?P<rest>.*))?$', re.M)
# One CRD rule covers every engine.args key; the twin names the key and says where to set it instead.
ENGINE_ARGS_RULE = "engine.args keys must be engine flags"


def server_refusal(cluster: Cluster, doc: dict[str, Any]) -> str:
    proc = dry_run_create(cluster, doc)
    assert proc.returncode != 0, f"the API server admits a spec the twins refuse:\n{json.dumps(doc)}"
    return proc.stderr


def _twin_path(twin: str, message: str) -> str:
    line = next(line for line in twin.splitlines() if message in line)
    return line.split(": ", 1)[0]


@pytest.mark.parametrize("doc", _cases())
def test_hostile_spec_is_refused_as_the_twin_says(crd: Cluster, doc: dict[str, Any]) -> None:
    with pytest.raises(SpecError) as err:
        parse_endpoint(doc)
    twin = str(err.value)
    server = server_refusal(crd, doc)
    assert "evaluating rule" not in server, f"a CEL rule failed to evaluate on the real server:\n{server}"
    errors = [(m["path"], (m["rest"] or "").strip()) for m in FIELD_ERROR.finditer(server)]
    cel = [(path, rest) for path, rest in errors if rest in RULE_MESSAGES]
    schema = [path for path, rest in errors if rest not in RULE_MESSAGES and path != "<nil>"]
    schema += re.findall(r'unknown field "([^"]+)"', server)  # strict field validation
    assert cel or schema, f"no field error in the server's answer:\n{server}"
    if cel and all(rest.startswith(ENGINE_ARGS_RULE) for _, rest in cel):
        key = next(iter(doc["spec"]["engine"]["args"]))
        assert f"'{key}'" in twin and "spec.engine.args" in twin, f"server: {server}\ntwin: {twin}"
        return
    shared = [(path, rest) for path, rest in cel if rest in twin]
    if shared:
        # A CEL rule refused it. The twin gives the same rule's message word for word, at the path of the
        # object the rule is declared on; the server reports it at the rule's fieldPath, at or under that.
        for path, rest in shared:
            twin_path = _twin_path(twin, rest)
            assert path == "<nil>" or path == twin_path or path.startswith(twin_path + "."), (path, twin_path)
    else:
        # The schema refused it (types, enums, bounds, required and unknown fields; the twin, like pydantic,
        # stops there, where the server may add the CEL rules that also fail): both name the same field.
        assert schema, f"the twin's message is none of the server's CEL messages:\nserver: {server}\ntwin: {twin}"
        assert any(re.sub(r"\[\d+\]", "", f).rsplit(".", 1)[-1] in twin for f in schema), \
            f"server: {server}\ntwin: {twin}"


# -- kwok: simulated nodes run pods ----------------------------------------------------------------------------
def _deployment(name: str, replicas: int, resources: dict[str, Any] | None = None) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "main", "image": "registry.invalid/pause:3.10"}
    if resources:
        container["resources"] = resources
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                 "template": {"metadata": {"labels": {"app": name}}, "spec": {"containers": [container]}}},
    }


def _ready_pods(cluster: Cluster, app: str, want: int, timeout: float = 60) -> list[dict[str, Any]]:
    def ready() -> list[dict[str, Any]] | None:
        pods = cluster.json("get", "pods", "-n", "default", "-l", f"app={app}")["items"]
        out = [p for p in pods if p["status"].get("phase") == "Running" and any(
            c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]
        return out if len(out) >= want else None
    return wait_until(f"{want} Ready pods of {app}", ready, timeout)


def test_deployment_gets_ready_pods_on_simulated_nodes(cluster: Cluster) -> None:
    cluster.kubectl("apply", "--server-side", "-f", "-", stdin=json.dumps(_deployment("plain", 2)))
    try:
        pods = _ready_pods(cluster, "plain", 2)
        assert {p["spec"]["nodeName"] for p in pods} <= {n["metadata"]["name"] for n in cluster.json(
            "get", "nodes", "-l", "type=kwok")["items"]}
        cluster.kubectl("rollout", "status", "deployment/plain", "-n", "default", "--timeout=30s")
    finally:
        cluster.kubectl("delete", "deployment/plain", "-n", "default", "--wait=false")


def test_gpu_request_lands_on_a_gpu_node(cluster: Cluster) -> None:
    gpu = {"limits": {"nvidia.com/gpu": "8"}}
    cluster.kubectl("apply", "--server-side", "-f", "-", stdin=json.dumps(_deployment("gpu", 1, gpu)))
    try:
        (pod,) = _ready_pods(cluster, "gpu", 1)
        node = cluster.json("get", "node", pod["spec"]["nodeName"])
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
        assert node["metadata"]["labels"]["nvidia.com/gpu.present"] == "true"
    finally:
        cluster.kubectl("delete", "deployment/gpu", "-n", "default", "--wait=false")


# -- issue 39: what keeps an endpoint's pods to themselves ---------------------------------------------------
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_network_policies_and_the_kv_secret_are_admitted(crd: Cluster, path: Path) -> None:
    """The real API server takes every NetworkPolicy the operator renders (named ports, peers with namespace
    and pod selectors, the LWS group labels) and a disaggregated endpoint's KV Secret, as kubectl's strict field
    validation sends them."""
    from sluice_operator.disaggregation import kv_secret
    from sluice_operator.reconcile import reconcile

    ep = parse_endpoint(load_yaml(path))
    crd.kubectl("create", "namespace", ep.namespace, check=False)
    docs = [m for m in reconcile(ep) if m["kind"] == "NetworkPolicy"]
    assert docs
    if ep.spec.disaggregation is not None:
        docs.append(kv_secret(ep))
    for doc in docs:
        proc = dry_run_create(crd, doc)
        assert proc.returncode == 0, f"{doc['kind']} {doc['metadata']['name']}: {proc.stderr}"
