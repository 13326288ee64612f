"""spec.routing.inferencePool against a real API server (marker `cluster`; tests/support/dev_cluster.py) holding the
projects' own CRDs: the Gateway API's standard channel and the Inference Extension's (scripts/get-gateway-crds.sh,
installed by scripts/dev-cluster.sh up). No gateway controller runs: what is checked is that the server admits
what the operator renders (strict field validation, the CRDs' CEL rules), stores it as sent (a second apply changes
nothing, so the resync sees no drift), that the InferencePool's status subresource takes what a gateway writes,
and that the InferenceEndpoint CRD refuses a routing spec that breaks its rules, saying why.

The operator's own loop over these objects (apply, prune, the pool's status folded into the endpoint's) is
test_cluster_operator.py's (test_routing_objects_applied_and_pool_status_folded).
"""

from __future__ import annotations

import copy
import json
import subprocess
from typing import Any

import pytest
from dev_cluster import ROOT, Cluster
from operator_schemas import CRD_FILE, load_yaml

from sluice_operator.reconcile import reconcile
from sluice_operator.routing import POOL_API_VERSION
from sluice_operator.spec import SpecError, parse_endpoint

pytestmark = pytest.mark.cluster

EXAMPLE = ROOT / "examples" / "gateway-api-inference-pool.yaml"
NAMESPACE = "gie-routing"
GATEWAY_CRDS = ("inferencepools.inference.networking.k8s.io", "inferenceobjectives.inference.networking.x-k8s.io",
                "gatewayclasses.gateway.networking.k8s.io", "gateways.gateway.networking.k8s.io",
                "httproutes.gateway.networking.k8s.io")
ROUTING_KINDS = ("ServiceAccount", "Role", "RoleBinding", "Deployment", "Service", "InferencePool", "HTTPRoute",
                 "NetworkPolicy")


@pytest.fixture(scope="module")
def gie(cluster: Cluster) -> Cluster:
    if cluster.gateway_crds is None:
        log = cluster.state / "logs" / "gateway-crds.log"
        pytest.skip(f"dev-cluster.sh installed no Gateway API CRDs (scripts/get-gateway-crds.sh: "
                    f"{log.read_text().strip() if log.is_file() else 'no log'})")
    name = load_yaml(CRD_FILE)["metadata"]["name"]
    if cluster.get("crd", name) is None:  # else as an earlier module put it there (the chart's install, helm's)
        cluster.kubectl("apply", "--server-side", "-f", str(CRD_FILE))
    cluster.wait_established(name)
    cluster.kubectl("create", "namespace", NAMESPACE, check=False)
    return cluster


def example() -> dict[str, Any]:
    doc = load_yaml(EXAMPLE)
    doc["metadata"]["namespace"] = NAMESPACE
    return doc


def routing_objects() -> list[dict[str, Any]]:
    ep = parse_endpoint(example())
    out = [m for m in reconcile(ep) if m["kind"] in ROUTING_KINDS and (
        m["kind"] not in ("Deployment", "Service", "NetworkPolicy") or m["metadata"]["name"] != ep.name)]
    for m in out:  # no owner to point at: the endpoint is not stored here
        m["metadata"].pop("ownerReferences")
    return out


def dry_run_create(cluster: Cluster, doc: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    # kubectl's default --validate=strict: the server refuses unknown fields.
    return cluster.kubectl("create", "--dry-run=server", "-f", "-", "-o", "name", stdin=json.dumps(doc), check=False)


def test_the_projects_crds_are_established(gie: Cluster) -> None:
    gie.wait_established(*GATEWAY_CRDS, timeout=30)
    pool = gie.json("get", "crd", GATEWAY_CRDS[0])
    assert POOL_API_VERSION.split("/")[1] in [v["name"] for v in pool["spec"]["versions"] if v["served"]]


def test_rendered_routing_objects_are_admitted_and_stored_as_sent(gie: Cluster) -> None:
    docs = routing_objects()
    assert {d["kind"] for d in docs} == set(ROUTING_KINDS)
    for doc in docs:
        proc = dry_run_create(gie, doc)
        assert proc.returncode == 0, f"{doc['kind']} {doc['metadata']['name']}: {proc.stderr}"
    # The pool and the route for real: a second server-side apply of the same manifest changes nothing.
    for doc in [d for d in docs if d["kind"] in ("InferencePool", "HTTPRoute")]:
        kind, name = doc["kind"].lower(), doc["metadata"]["name"]
        gie.apply(doc, "--field-manager=sluice-operator")
        first = gie.json("get", kind, name, "-n", NAMESPACE)
        gie.apply(doc, "--field-manager=sluice-operator")
        second = gie.json("get", kind, name, "-n", NAMESPACE)
        assert first["metadata"]["resourceVersion"] == second["metadata"]["resourceVersion"], kind
        for key, value in doc["spec"].items():  # the server's defaults add fields, never change ours
            assert second["spec"][key] == value or key == "rules", (kind, key, second["spec"][key])
    route = gie.json("get", "httproute", "smollm2-gie", "-n", NAMESPACE)
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"][0]["kind"] == "InferencePool" and rule["backendRefs"][0]["name"] == "smollm2-gie"


def test_pool_status_takes_what_a_gateway_writes(gie: Cluster) -> None:
    """What the endpoint's status folds (status.py, pool_condition) is what the CRD stores: parents[].conditions."""
    pool = next(d for d in routing_objects() if d["kind"] == "InferencePool")
    gie.apply(pool, "--field-manager=sluice-operator")
    status = {"parents": [{"parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                         "namespace": "infra", "name": "shared-gw"},
                           "controllerName": "gateway.example/controller",
                           "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted",
                                           "message": "accepted", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}]}
    gie.kubectl("patch", "inferencepool", pool["metadata"]["name"], "-n", NAMESPACE, "--subresource=status",
                "--type=merge", "-p", json.dumps({"status": status}))
    stored = gie.json("get", "inferencepool", pool["metadata"]["name"], "-n", NAMESPACE)
    assert stored["status"]["parents"][0]["conditions"][0]["reason"] == "Accepted"


@pytest.mark.parametrize(("routing", "message"), [
    pytest.param({"failureMode": "FailClose"}, "routing.inferencePool needs gatewayNamespaces", id="no-namespaces"),
    pytest.param({"gatewayNamespaces": ["infra"], "failureMode": "Open"}, "Unsupported value: \"Open\"",
                 id="failure-mode"),
    pytest.param({"httpRoute": {"parentRefs": [{"name": "gw"}], "hostnames": ["a.example", "a.example"]}},
                 "hostnames must be unique", id="duplicate-hostnames"),
    pytest.param({"gatewayNamespaces": ["Infra"]}, "gatewayNamespaces[0]", id="namespace-not-a-label"),
])
def test_a_schema_violating_routing_spec_is_refused_with_a_reason(gie: Cluster, routing: dict[str, Any],
                                                                   message: str) -> None:
    doc = example()
    doc["spec"]["routing"] = {"inferencePool": copy.deepcopy(routing)}
    with pytest.raises(SpecError):
        parse_endpoint(doc)  # `sluice render` and the operator refuse it too
    proc = dry_run_create(gie, doc)
    assert proc.returncode != 0, "admitted"
    assert message in proc.stderr, proc.stderr
    assert "spec.routing.inferencePool" in proc.stderr, proc.stderr


def test_the_example_endpoint_is_admitted(gie: Cluster) -> None:
    proc = dry_run_create(gie, example())
    assert proc.returncode == 0, proc.stderr
