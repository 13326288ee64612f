"""spec.routing.inferencePool (routing.py), offline: the Gateway API Inference Extension objects reconcile
renders, the picker's minimal RBAC, the NetworkPolicies that admit the gateway's data plane, the spec's rules
(Python and the CRD's twin), and how the InferencePool's status folds into the endpoint's."""

from __future__ import annotations

import copy
import re
from typing import Any

import kubernetes_validate
import pytest
import yaml
from operator_schemas import CRD_FILE, EXAMPLES, ROOT, api_server_errors, crd_schema, gateway_crd, load_yaml

from sluice_operator.config import PROMETHEUS_PEERS, OperatorConfig
from sluice_operator.meta import ENDPOINT_LABEL, ROLE_LABEL
from sluice_operator.reconcile import reconcile
from sluice_operator.routing import DISCOVERY_RULES, OBJECTIVE_RULE, PICKER_RULES, picker_args
from sluice_operator.spec import SpecError, parse_endpoint
from sluice_operator.status import endpoint_status, transitions
from sluice_operator.workload import PORT

EXAMPLE = ROOT / "examples" / "gateway-api-inference-pool.yaml"
K8S_VERSION = kubernetes_validate.latest_version()
GIE_KINDS = {"InferencePool", "HTTPRoute", "ServiceAccount", "Role", "RoleBinding"}
NOW = "2026-01-01T00:00:00Z"


def doc(**routing: Any) -> dict[str, Any]:
    out = load_yaml(EXAMPLE)
    if routing:
        out["spec"]["routing"]["inferencePool"] = routing
    return out


def by_kind_name(manifests: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(m["kind"], m["metadata"]["name"]): m for m in manifests}


@pytest.fixture(scope="module")
def rendered() -> dict[tuple[str, str], dict[str, Any]]:
    return by_kind_name(reconcile(parse_endpoint(load_yaml(EXAMPLE))))


def test_no_routing_objects_without_spec_routing() -> None:
    for path in EXAMPLES:
        if path == EXAMPLE:
            continue
        manifests = reconcile(parse_endpoint(load_yaml(path)))
        assert not {m["kind"] for m in manifests} & GIE_KINDS, path.name
        assert not any(m["metadata"]["name"].endswith(("-epp", "-inference-pool")) for m in manifests), path.name
    bare = load_yaml(EXAMPLE)
    bare["spec"]["routing"] = {}  # routing without inferencePool: nothing either
    assert not {m["kind"] for m in reconcile(parse_endpoint(bare))} & GIE_KINDS


def test_inference_pool_selects_the_services_pods_and_names_the_picker(rendered) -> None:
    pool = rendered["InferencePool", "smollm2-gie"]
    service = rendered["Service", "smollm2-gie"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"] == {"matchLabels": service["spec"]["selector"]}
    assert pool["spec"]["targetPorts"] == [{"number": PORT}]
    container = rendered["Deployment", "smollm2-gie"]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "http", "containerPort": PORT, "protocol": "TCP"} in container["ports"]
    assert pool["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service", "name": "smollm2-gie-epp",
                                                 "port": {"number": 9002}, "failureMode": "FailClose"}


def test_disaggregated_pool_is_the_decode_pool() -> None:
    d = doc(gatewayNamespaces=["infra"])
    d["spec"].pop("replicas")
    d["spec"]["disaggregation"] = {"prefill": {"replicas": 1}, "decode": {"replicas": 2}}
    out = by_kind_name(reconcile(parse_endpoint(d)))
    pool = out["InferencePool", "smollm2-gie"]
    assert pool["spec"]["selector"]["matchLabels"] == out["Service", "smollm2-gie"]["spec"]["selector"]
    assert pool["spec"]["selector"]["matchLabels"][ROLE_LABEL] == "serving"


def test_every_child_is_owned_and_labelled(rendered) -> None:
    for (kind, name), m in rendered.items():
        meta = m["metadata"]
        assert meta["labels"][ENDPOINT_LABEL] == "smollm2-gie", (kind, name)  # the prune pass finds it
        assert meta["ownerReferences"][0]["kind"] == "InferenceEndpoint" and meta["ownerReferences"][0]["controller"]


def test_picker_deployment_and_service(rendered) -> None:
    cfg = OperatorConfig()
    deploy, service = rendered["Deployment", "smollm2-gie-epp"], rendered["Service", "smollm2-gie-epp"]
    pod = deploy["spec"]["template"]
    assert deploy["spec"]["replicas"] == 1
    assert deploy["spec"]["selector"]["matchLabels"] == pod["metadata"]["labels"] == service["spec"]["selector"]
    assert ENDPOINT_LABEL not in pod["metadata"]["labels"]  # the engines' policy `<name>` must not select it
    (c,) = pod["spec"]["containers"]
    assert c["image"] == cfg.engine_image
    assert [*c["command"], *c["args"]] == [
        "sluice", "gateway", "--endpoint-picker", "--picker-port", "9002", "--port", "8080", "--kubernetes",
        "-n", "default", "--pool", "default/smollm2-gie", "--load-floor", "8"]  # the example: max-num-seqs 16
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["resources"] == {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}}
    # Like the engine pods: non-root, read-only root, no capabilities.
    engine_pod = rendered["Deployment", "smollm2-gie"]["spec"]["template"]["spec"]
    assert c["securityContext"] == engine_pod["containers"][0]["securityContext"]
    assert c["securityContext"]["readOnlyRootFilesystem"] and c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod["spec"]["securityContext"] == engine_pod["securityContext"]
    assert pod["spec"]["serviceAccountName"] == "smollm2-gie-epp"
    assert {(p["name"], p["port"], p["targetPort"], p.get("appProtocol")) for p in service["spec"]["ports"]} == {
        ("grpc", 9002, "grpc", "kubernetes.io/h2c"), ("http", 8080, "http", None)}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": 9002, "http": 8080}


def test_picker_image_follows_the_operators_engine_image_not_the_endpoints() -> None:
    d = doc(gatewayNamespaces=["infra"])
    d["spec"]["engine"]["image"] = "registry.example/own-engine:1"
    cfg = OperatorConfig(engine_image="registry.example/sluice-engine:v9")
    out = by_kind_name(reconcile(parse_endpoint(d), cfg))
    assert out["Deployment", "smollm2-gie-epp"]["spec"]["template"]["spec"]["containers"][0]["image"] == cfg.engine_image


def test_picker_rbac_is_what_the_charts_gateway_reads_in_this_namespace_only(rendered) -> None:
    role, binding = rendered["Role", "smollm2-gie-epp"], rendered["RoleBinding", "smollm2-gie-epp"]
    assert role["metadata"]["namespace"] == "default"
    assert role["rules"] == [dict(r) for r in PICKER_RULES]
    for rule in role["rules"]:
        assert set(rule["verbs"]) == {"get", "list", "watch"}  # read only
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "smollm2-gie-epp"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "smollm2-gie-epp", "namespace": "default"}]
    assert ("ServiceAccount", "smollm2-gie-epp") in rendered
    assert not any(m["kind"] in ("ClusterRole", "ClusterRoleBinding") for m in rendered.values())
    # The chart's gateway rules (templates/_helpers.tpl, sluice.gateway.rules): the same discovery.
    helpers = (ROOT / "charts" / "sluice" / "templates" / "_helpers.tpl").read_text()
    block = re.search(r'define "sluice.gateway.rules" -}}\n(.*?)\{\{- end', helpers, re.S)
    assert block is not None
    assert yaml.safe_load(block.group(1)) == [dict(r) for r in DISCOVERY_RULES]
    # and, the picker's own, the InferenceObjectives (their priorities)
    assert role["rules"][-1] == OBJECTIVE_RULE and len(role["rules"]) == len(DISCOVERY_RULES) + 1


def test_http_route_attaches_the_pool_to_the_gateway(rendered) -> None:
    route = rendered["HTTPRoute", "smollm2-gie"]
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                            "name": "shared-gw", "namespace": "infra", "sectionName": "http"}]
    assert route["spec"]["hostnames"] == ["smollm2.example.com"]
    assert route["spec"]["rules"] == [{
        "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
        "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "smollm2-gie"}]}]


def test_no_route_without_http_route() -> None:
    out = by_kind_name(reconcile(parse_endpoint(doc(gatewayNamespaces=["infra"]))))
    assert ("InferencePool", "smollm2-gie") in out and not any(k == "HTTPRoute" for k, _ in out)


def test_apply_order_rbac_before_picker_pool_before_route() -> None:
    kinds = [(m["kind"], m["metadata"]["name"]) for m in reconcile(parse_endpoint(load_yaml(EXAMPLE)))]
    assert kinds.index(("RoleBinding", "smollm2-gie-epp")) < kinds.index(("Deployment", "smollm2-gie-epp"))
    assert kinds.index(("InferencePool", "smollm2-gie")) < kinds.index(("HTTPRoute", "smollm2-gie"))
    assert kinds.index(("NetworkPolicy", "smollm2-gie-epp")) < kinds.index(("Deployment", "smollm2-gie-epp"))


# -- NetworkPolicy ------------------------------------------------------------------------------------------
def namespaces_of(peers: list[dict[str, Any]]) -> set[str]:
    return {p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
            for p in peers if "namespaceSelector" in p and "podSelector" not in p}


def test_network_policy_admits_the_gateway_namespaces_only(rendered) -> None:
    pool_policy = rendered["NetworkPolicy", "smollm2-gie-inference-pool"]
    picker_policy = rendered["NetworkPolicy", "smollm2-gie-epp"]
    service = rendered["Service", "smollm2-gie"]
    picker_pod = rendered["Deployment", "smollm2-gie-epp"]["spec"]["template"]["metadata"]["labels"]
    assert pool_policy["spec"]["podSelector"] == {"matchLabels": service["spec"]["selector"]}
    (rule,) = pool_policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert namespaces_of(rule["from"]) == {"infra", "envoy-gateway-system"}
    assert {"podSelector": {"matchLabels": picker_pod}} in rule["from"]
    assert picker_policy["spec"]["podSelector"] == {"matchLabels": picker_pod}
    grpc, metrics = picker_policy["spec"]["ingress"]
    assert grpc["ports"] == [{"port": "grpc", "protocol": "TCP"}]
    assert namespaces_of(grpc["from"]) == {"infra", "envoy-gateway-system"} and len(grpc["from"]) == 2
    assert metrics == {"from": list(PROMETHEUS_PEERS), "ports": [{"port": "http", "protocol": "TCP"}]}
    # The engines' own policy is unchanged: no gateway namespace there.
    own = rendered["NetworkPolicy", "smollm2-gie"]
    assert not any(namespaces_of(r["from"]) for r in own["spec"]["ingress"])
    for policy in (pool_policy, picker_policy):
        kubernetes_validate.validate(policy, K8S_VERSION, strict=True)


def test_gateway_namespaces_default_to_the_parent_refs() -> None:
    route = {"parentRefs": [{"name": "gw", "namespace": "infra"}, {"name": "local"}]}
    out = by_kind_name(reconcile(parse_endpoint(doc(httpRoute=route))))
    (rule,) = out["NetworkPolicy", "smollm2-gie-inference-pool"]["spec"]["ingress"]
    assert namespaces_of(rule["from"]) == {"infra", "default"}


def test_no_routing_policies_with_network_policy_off() -> None:
    cfg = OperatorConfig(network_policy=False)
    assert not [m for m in reconcile(parse_endpoint(load_yaml(EXAMPLE)), cfg) if m["kind"] == "NetworkPolicy"]


@pytest.mark.parametrize(("kind", "filename"), [
    ("InferencePool", "inference.networking.k8s.io_inferencepools.yaml"),
    ("HTTPRoute", "gateway.networking.k8s.io_httproutes.yaml")])
def test_pool_and_route_validate_against_the_projects_crds(rendered, kind: str, filename: str) -> None:
    crd = gateway_crd(filename)
    manifest = rendered[kind, "smollm2-gie"]
    group, version = manifest["apiVersion"].split("/")
    assert crd["spec"]["group"] == group
    assert api_server_errors(crd_schema(crd, version), manifest) == []


def test_rendered_core_objects_validate_strictly(rendered) -> None:
    for (kind, _), m in rendered.items():
        if kind in ("Deployment", "Service", "ServiceAccount", "Role", "RoleBinding", "NetworkPolicy"):
            kubernetes_validate.validate(m, K8S_VERSION, strict=True)


# -- the spec --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return crd_schema(load_yaml(CRD_FILE))


def test_example_defaults(schema) -> None:
    routing = parse_endpoint(doc(gatewayNamespaces=["infra"])).spec.routing.inference_pool
    assert routing.failure_mode == "FailClose" and routing.picker.replicas == 1 and routing.http_route is None
    assert api_server_errors(schema, load_yaml(EXAMPLE)) == []


INVALID = [
    pytest.param({}, "routing.inferencePool needs gatewayNamespaces", id="no-gateway-namespaces"),
    pytest.param({"gatewayNamespaces": ["infra", "infra"]}, "gatewayNamespaces must be unique", id="dup-namespaces"),
    pytest.param({"gatewayNamespaces": ["Infra"]}, None, id="namespace-not-a-label"),
    pytest.param({"gatewayNamespaces": ["infra"], "failureMode": "Open"}, None, id="failure-mode"),
    pytest.param({"gatewayNamespaces": ["infra"], "picker": {"replicas": 0}}, None, id="zero-pickers"),
    pytest.param({"gatewayNamespaces": ["infra"], "picker": {"image": "x"}}, None, id="unknown-picker-field"),
    pytest.param({"httpRoute": {"parentRefs": []}}, None, id="no-parent"),
    pytest.param({"httpRoute": {"parentRefs": [{"name": "gw"}], "hostnames": ["a.example", "a.example"]}},
                 "hostnames must be unique", id="dup-hostnames"),
    pytest.param({"httpRoute": {"parentRefs": [{"name": "gw"}], "hostnames": ["http://x"]}}, None, id="bad-host"),
    pytest.param({"httpRoute": {"parentRefs": [{"name": "gw", "sectionName": "HTTP"}]}}, None, id="bad-section"),
]


@pytest.mark.parametrize(("routing", "message"), INVALID)
def test_invalid_routing_is_refused_by_both(routing: dict[str, Any], message: str | None, schema) -> None:
    d = doc(**routing) if routing else doc()
    if not routing:
        d["spec"]["routing"]["inferencePool"] = {}
    with pytest.raises(SpecError) as err:
        parse_endpoint(d)
    assert "routing.inferencePool" in str(err.value) or "routing" in str(err.value)
    if message:
        assert message in str(err.value)
    errors = api_server_errors(schema, d)
    assert errors, "the CRD admits it"
    if message:
        assert any(message in e for e in errors), errors


# -- status ----------------------------------------------------------------------------------------------
def pool_with(*parents: dict[str, Any]) -> dict[str, Any]:
    return {"status": {"parents": list(parents)}}


def parent(name: str, **conditions: tuple[str, str]) -> dict[str, Any]:
    return {"parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": "infra", "name": name},
            "conditions": [{"type": t, "status": s, "reason": r, "message": f"{t} {r}",
                            "lastTransitionTime": NOW} for t, (s, r) in conditions.items()]}


def pool_conditions(pool: dict[str, Any] | None, missing: frozenset[str] = frozenset()) -> dict[str, tuple]:
    ep = parse_endpoint(load_yaml(EXAMPLE))
    serving = {"spec": {"replicas": 2}, "status": {"replicas": 2, "readyReplicas": 2}}
    status = endpoint_status(ep, serving=serving, now=NOW, inference_pool=pool, missing_kinds=missing)
    return {c["type"]: (c["status"], c["reason"], c["message"]) for c in status["conditions"]
            if c["type"].startswith("InferencePool")}


def test_pool_status_folds_into_conditions() -> None:
    accepted = parent("shared-gw", Accepted=("True", "Accepted"), ResolvedRefs=("True", "ResolvedRefs"))
    got = pool_conditions(pool_with(accepted))
    assert got["InferencePoolAccepted"][:2] == ("True", "Accepted")
    assert "Gateway infra/shared-gw" in got["InferencePoolAccepted"][2]
    assert got["InferencePoolResolvedRefs"][:2] == ("True", "ResolvedRefs")
    refused = parent("other-gw", Accepted=("False", "NotSupportedByParent"), ResolvedRefs=("False", "InvalidExtensionRef"))
    got = pool_conditions(pool_with(accepted, refused))
    assert got["InferencePoolAccepted"][:2] == ("False", "NotSupportedByParent")
    assert "Gateway infra/other-gw" in got["InferencePoolAccepted"][2]
    assert got["InferencePoolResolvedRefs"][:2] == ("False", "InvalidExtensionRef")


def test_pool_status_unknown_until_a_gateway_reports() -> None:
    assert pool_conditions(pool_with())["InferencePoolAccepted"][:2] == ("Unknown", "NoParents")
    assert pool_conditions(None)["InferencePoolAccepted"][:2] == ("Unknown", "InferencePoolMissing")
    got = pool_conditions(None, frozenset({"InferencePool"}))
    assert got["InferencePoolAccepted"][:2] == ("False", "InferencePoolNotInstalled")
    assert "inference.networking.k8s.io" in got["InferencePoolAccepted"][2]
    pending = parent("gw", Accepted=("Unknown", "Pending"))
    assert pool_conditions(pool_with(pending))["InferencePoolAccepted"][:2] == ("Unknown", "Pending")
    assert pool_conditions(pool_with(parent("gw")))["InferencePoolResolvedRefs"][0] == "Unknown"


def test_no_pool_conditions_without_routing() -> None:
    ep = parse_endpoint(load_yaml(EXAMPLES[0]))
    status = endpoint_status(ep, serving=None, now=NOW)
    assert not [c for c in status["conditions"] if c["type"].startswith("InferencePool")]


def test_a_pool_refused_posts_a_warning() -> None:
    ep = parse_endpoint(load_yaml(EXAMPLE))
    serving = {"spec": {"replicas": 2}, "status": {"replicas": 2, "readyReplicas": 2}}
    old = endpoint_status(ep, serving=serving, now=NOW, inference_pool=pool_with())
    new = endpoint_status(ep, serving=serving, now=NOW, previous=old, inference_pool=pool_with(
        parent("gw", Accepted=("False", "NotSupportedByParent"))))
    assert [e.reason for e in transitions(old, new)] == ["InferencePoolNotAccepted"]


def test_picker_args_name_the_pool() -> None:
    ep = parse_endpoint({**copy.deepcopy(load_yaml(EXAMPLE)), "metadata": {"name": "x", "namespace": "team-a"}})
    assert picker_args(ep)[-6:-2] == ["-n", "team-a", "--pool", "team-a/x"]


def test_flow_control_and_priority_scheduling_follow_the_pool() -> None:
    d = doc(gatewayNamespaces=["infra"])
    d["spec"]["routing"]["inferencePool"]["maxInflightPerPod"] = 16
    out = by_kind_name(reconcile(parse_endpoint(d)))
    args = out["Deployment", "smollm2-gie-epp"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--picker-max-inflight") + 1] == "16"
    engine = out["Deployment", "smollm2-gie"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert engine[engine.index("--scheduling-policy") + 1] == "priority"  # the picker sends priorities
    d["spec"]["engine"]["args"]["scheduling-policy"] = "fcfs"  # the user's choice stands
    engine = by_kind_name(reconcile(parse_endpoint(d)))["Deployment", "smollm2-gie"]["spec"]["template"]["spec"][
        "containers"][0]["args"]
    assert engine.count("--scheduling-policy") == 1 and engine[engine.index("--scheduling-policy") + 1] == "fcfs"
    del d["spec"]["routing"], d["spec"]["engine"]["args"]["scheduling-policy"]
    plain = by_kind_name(reconcile(parse_endpoint(d)))
    assert "--scheduling-policy" not in plain["Deployment", "smollm2-gie"]["spec"]["template"]["spec"][
        "containers"][0]["args"]  # no picker: the engine's default (fcfs)


def test_the_picker_keeps_prefix_affinity_up_to_half_the_engines_batch() -> None:
    from sluice_engine.config import EngineConfig
    from sluice_operator.routing import ENGINE_MAX_NUM_SEQS

    assert ENGINE_MAX_NUM_SEQS == EngineConfig.__dataclass_fields__["max_num_seqs"].default
    d = doc(gatewayNamespaces=["infra"])
    d["spec"]["engine"]["args"]["max-num-seqs"] = 16
    args = by_kind_name(reconcile(parse_endpoint(d)))["Deployment", "smollm2-gie-epp"]["spec"]["template"]["spec"][
        "containers"][0]["args"]
    assert args[args.index("--load-floor") + 1] == "8"
    del d["spec"]["engine"]["args"]["max-num-seqs"]
    args = by_kind_name(reconcile(parse_endpoint(d)))["Deployment", "smollm2-gie-epp"]["spec"]["template"]["spec"][
        "containers"][0]["args"]
    assert args[args.index("--load-floor") + 1] == str(ENGINE_MAX_NUM_SEQS // 2)


def test_objectives_without_a_pool_schedule_the_engines_by_priority() -> None:
    d = load_yaml(ROOT / "examples" / "cpu-smollm2.yaml")
    d["spec"]["routing"] = {"objectives": [{"name": "critical", "priority": 10}, {"name": "batch", "priority": -1}]}
    out = by_kind_name(reconcile(parse_endpoint(d)))
    engine = out["Deployment", "smollm2"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert engine[engine.index("--scheduling-policy") + 1] == "priority"
    assert not any(m["kind"] in ("InferencePool", "HTTPRoute") for m in out.values())  # no pool: nothing of GIE's
    d["spec"]["routing"]["objectives"].append({"name": "critical", "priority": 1})
    with pytest.raises(SpecError, match="names must be unique"):
        parse_endpoint(d)
