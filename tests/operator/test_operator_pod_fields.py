"""spec.pod: misspelt core/v1 fields are refused (by the CRD's schema, as the API server checks it with strict
field validation, and by `sluice render` / the operator), the operator's own names stay its own, and a pod
with every customization renders to manifests Kubernetes accepts (kubernetes-validate, strict)."""

from __future__ import annotations

import copy
import json
from typing import Any

import kubernetes_validate
import pytest
from operator_schemas import CRD_FILE, EXAMPLES, api_server_errors, crd_schema, load_yaml

from sluice_operator import core_schemas
from sluice_operator.adapters import CLAIMS_DIR
from sluice_operator.reconcile import reconcile
from sluice_operator.spec import (
    OPERATOR_LABEL_PREFIX,
    OPERATOR_LABELS,
    OPERATOR_MOUNT_PATHS,
    OPERATOR_VOLUME_PREFIX,
    OPERATOR_VOLUMES,
    SpecError,
    parse_endpoint,
)

K8S_VERSIONS = ["1.30", kubernetes_validate.latest_version()]
BASE = {
    "apiVersion": "sluice.dev/v1alpha1",
    "kind": "InferenceEndpoint",
    "metadata": {"name": "demo", "namespace": "ml"},
    "spec": {"model": {"uri": "hf://org/model"}, "accelerator": {"type": "cpu"}},
}
SPREAD = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway",
          "labelSelector": {"matchLabels": {"sluice.dev/endpoint": "demo"}}}
NODE_TERM = {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}]}


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return crd_schema(load_yaml(CRD_FILE))


def with_pod(**pod: Any) -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    doc["spec"]["pod"] = copy.deepcopy(pod)
    return doc


# (spec.pod, the field the typo is in): each is a real core/v1 field misspelt, or of the wrong type.
TYPOS = [
    pytest.param({"affinity": {"nodeAfinity": {}}}, "nodeAfinity", id="nodeAfinity"),
    pytest.param({"tolerations": [{"key": "gpu", "operator": "Exists", "efect": "NoSchedule"}]}, "efect",
                 id="tolerations-efect"),
    pytest.param({"topologySpreadConstraints": [{**SPREAD, "maxskew": 1}]}, "maxskew", id="spread-maxskew"),
    pytest.param({"volumes": [{"name": "scratch", "hostpath": {"path": "/data"}}]}, "hostpath", id="volume-hostpath"),
    pytest.param({"volumes": [{"name": "scratch", "emptyDir": {}}], "volumeMounts": [
        {"name": "scratch", "mountpath": "/scratch"}]}, "mountpath", id="mount-mountpath"),
    pytest.param({"env": [{"name": "A", "valuefrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]}, "valuefrom",
                 id="env-valuefrom"),
    pytest.param({"resources": {"limit": {"cpu": "1"}}}, "limit", id="resources-limit"),
    pytest.param({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operater": "In", "values": ["a"]}]}]}}}},
        "operater", id="node-selector-operater"),
    pytest.param({"affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"topologykey": "kubernetes.io/hostname", "labelSelector": {}}]}}}, "topologykey", id="anti-affinity-topologykey"),
    pytest.param({"serviceAccount": "reader"}, "serviceAccount", id="serviceAccount-for-serviceAccountName"),
    pytest.param({"volumes": [{"name": "scratch", "emptyDir": {"sizelimit": "1Gi"}}]}, "sizelimit",
                 id="emptyDir-sizelimit"),
    pytest.param({"tolerations": [{"key": "gpu", "tolerationSeconds": "60"}]}, "tolerationSeconds",
                 id="tolerationSeconds-string"),
    pytest.param({"topologySpreadConstraints": [{"maxSkew": 1, "whenUnsatisfiable": "DoNotSchedule"}]},
                 "topologyKey", id="spread-without-topologyKey"),
]


@pytest.mark.parametrize(("pod", "field"), TYPOS)
def test_pod_field_typos_are_refused_everywhere(pod: dict[str, Any], field: str, schema: dict[str, Any]) -> None:
    doc = with_pod(**pod)
    server = api_server_errors(schema, doc)
    assert server and any(field in e for e in server), server  # the API server refuses the CR, naming the field
    with pytest.raises(SpecError) as err:  # and so do `sluice render` and the operator (a status condition)
        parse_endpoint(doc)
    assert field in str(err.value) and "spec.pod" in str(err.value)


# (spec.pod or spec.model, what pydantic says, what the API server says): the operator's names stay its own,
# and a node directory is a directory.
RULES = [
    pytest.param({"labels": {"sluice.dev/role": "serving"}}, "pod.labels must not set the operator's own labels",
                 id="label-role"),
    pytest.param({"labels": {"app.kubernetes.io/instance": "other"}}, "pod.labels must not set", id="label-instance"),
    pytest.param({"annotations": {"sluice.dev/config-hash": "x"}}, "pod.annotations must not set", id="annotation"),
    pytest.param({"volumes": [{"name": "tmp", "emptyDir": {}}]}, "pod.volumes must not use the names",
                 id="volume-name-tmp"),
    pytest.param({"volumes": [{"name": "adapter-x", "emptyDir": {}}]}, "pod.volumes must not use the names",
                 id="volume-name-adapter-prefix"),
    pytest.param({"volumes": [{"name": "s", "emptyDir": {}}],
                  "volumeMounts": [{"name": "s", "mountPath": "/adapter-claims/mine"}]},
                 "must not be or be under a directory the operator mounts", id="mount-under-adapter-claims"),
    pytest.param({"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}, "must be an absolute directory",
                 id="volume-hostpath-root"),
    pytest.param({"volumes": [{"name": "up", "hostPath": {"path": "/var/lib/../../etc"}}]},
                 "must be an absolute directory", id="volume-hostpath-dotdot"),
    pytest.param({"volumes": [{"name": "rel", "hostPath": {"path": "data"}}]}, "must be an absolute directory",
                 id="volume-hostpath-relative"),
    pytest.param({"volumeMounts": [{"name": "nowhere", "mountPath": "/x"}]},
                 "pod.volumeMounts[].name must name one of pod.volumes", id="mount-without-volume"),
    pytest.param({"volumes": [{"name": "s", "emptyDir": {}}], "volumeMounts": [{"name": "s", "mountPath": "/tmp"}]},
                 "must not be or be under a directory the operator mounts", id="mount-over-tmp"),
    pytest.param({"volumes": [{"name": "s", "emptyDir": {}}],
                  "volumeMounts": [{"name": "s", "mountPath": "/models-cache/hub"}]},
                 "must not be or be under a directory the operator mounts", id="mount-under-cache"),
]


@pytest.mark.parametrize(("pod", "message"), RULES)
def test_operator_names_and_paths_are_guarded(pod: dict[str, Any], message: str, schema: dict[str, Any]) -> None:
    doc = with_pod(**pod)
    with pytest.raises(SpecError) as err:
        parse_endpoint(doc)
    assert message in str(err.value)
    errors = api_server_errors(schema, doc)
    assert any(message in e for e in errors), errors


@pytest.mark.parametrize("path", ["/", "//", "relative/dir", "/var/../etc", "/a/.."])
def test_hostpath_cache_must_be_a_real_directory(path: str, schema: dict[str, Any]) -> None:
    doc = copy.deepcopy(BASE)
    doc["spec"]["model"]["cache"] = {"type": "hostPath", "path": path}
    with pytest.raises(SpecError):
        parse_endpoint(doc)
    assert api_server_errors(schema, doc), f"the CRD accepts hostPath {path!r}"


@pytest.mark.parametrize("path", ["/var/lib/sluice/cache", "/mnt/nvme0/models..old"])
def test_hostpath_cache_directories_are_accepted(path: str, schema: dict[str, Any]) -> None:
    doc = copy.deepcopy(BASE)
    doc["spec"]["model"]["cache"] = {"type": "hostPath", "path": path}
    parse_endpoint(doc)
    assert api_server_errors(schema, doc) == []


CUSTOM_POD = {
    "serviceAccountName": "model-reader",  # e.g. bound to an IAM role (IRSA)
    "runtimeClassName": "nvidia",
    "schedulerName": "volcano",
    "labels": {"team": "search", "app.kubernetes.io/part-of": "search"},
    "annotations": {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"},
    "topologySpreadConstraints": [SPREAD],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [NODE_TERM]}}},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
    "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
    "resources": {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "8Gi"}},
    "volumes": [{"name": "prompts", "configMap": {"name": "system-prompts"}},
                {"name": "scratch", "ephemeral": {"volumeClaimTemplate": {"spec": {
                    "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "10Gi"}}}}}}],
    "volumeMounts": [{"name": "prompts", "mountPath": "/etc/prompts", "readOnly": True},
                     {"name": "scratch", "mountPath": "/scratch"}],
}


def _custom_manifests() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    doc = with_pod(**CUSTOM_POD)
    doc["spec"]["scaling"] = {"minReplicas": 0, "maxReplicas": 2, "warmPool": {"replicas": 1}}
    return doc, reconcile(parse_endpoint(doc))


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_customized_pod_renders_and_validates(version: str, schema: dict[str, Any]) -> None:
    doc, manifests = _custom_manifests()
    assert api_server_errors(schema, doc) == []
    deployments = [m for m in manifests if m["kind"] == "Deployment"]
    assert len(deployments) == 2  # serving and warm pool: both customized
    for dep in deployments:
        kubernetes_validate.validate(dep, version, strict=True)
        template = dep["spec"]["template"]
        pod = template["spec"]
        assert pod["serviceAccountName"] == "model-reader"
        assert pod["runtimeClassName"] == "nvidia" and pod["schedulerName"] == "volcano"
        assert pod["topologySpreadConstraints"] == [SPREAD]
        assert pod["affinity"] == CUSTOM_POD["affinity"]
        assert pod["automountServiceAccountToken"] is False  # identity webhooks project their own token
        names = [v["name"] for v in pod["volumes"]]
        assert names[-2:] == ["prompts", "scratch"] and "model-cache" in names and len(set(names)) == len(names)
        (engine,) = [c for c in pod["containers"] if c["name"] == "engine"]
        assert engine["volumeMounts"][-2:] == CUSTOM_POD["volumeMounts"]
        for init in pod.get("initContainers", []):  # the fetch container gets none of the extra volumes
            assert not {"prompts", "scratch"} & {m["name"] for m in init["volumeMounts"]}
        labels = template["metadata"]["labels"]
        assert labels["team"] == "search" and labels["app.kubernetes.io/part-of"] == "search"
        # The workload's selector still selects its pods: the operator's labels are untouched.
        assert all(labels[k] == v for k, v in dep["spec"]["selector"]["matchLabels"].items())
        annotations = template["metadata"]["annotations"]
        assert annotations["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"
        assert "sluice.dev/config-hash" in annotations
        assert "labels" not in CUSTOM_POD or dep["metadata"]["labels"].get("team") is None  # pods only


def test_reserved_names_are_what_reconcile_renders() -> None:
    """The CRD's rules keep OPERATOR_* for the operator: they must name what the operator really sets."""
    seen_volumes, seen_paths, seen_labels, seen_annotations = set(), set(), set(), set()
    docs = [load_yaml(p) for p in EXAMPLES]
    # A pvc:// adapter on a claim the pods mount for nothing else: its volume and mount (adapters.py).
    adapters = [{"name": "a", "source": "hf://org/a"}, {"name": "b", "source": "pvc://other-claim/b"}]
    for path in EXAMPLES:  # every model source: hf (config), pvc (model), s3; GPUs (dshm); with adapters
        for uri in ("hf://org/m", "pvc://claim/m", "s3://bucket/m"):
            for with_adapters in (False, True):
                doc = load_yaml(path)
                doc["spec"]["model"] = {**doc["spec"]["model"], "uri": uri}
                doc["spec"]["model"].pop("revision", None)
                if with_adapters:
                    doc["spec"]["adapters"] = adapters
                    par, acc = doc["spec"].get("parallelism", {}), doc["spec"].get("accelerator", {})
                    ranks = par.get("tensor", 1) * par.get("pipeline", 1)
                    if par.get("nodes", 1) > 1 or ranks > acc.get("gpusPerNode", ranks):  # LoRA: one pod a replica
                        continue
                docs.append(doc)
    for doc in docs:
        for m in reconcile(parse_endpoint(doc)):
            if m["kind"] == "Deployment":
                templates = [m["spec"]["template"]]
            elif m["kind"] == "LeaderWorkerSet":
                templates = [m["spec"]["leaderWorkerTemplate"][k] for k in ("leaderTemplate", "workerTemplate")]
            else:
                continue
            for t in templates:
                seen_volumes |= {v["name"] for v in t["spec"]["volumes"]}
                for c in [*t["spec"]["containers"], *t["spec"].get("initContainers", [])]:
                    seen_paths |= {vm["mountPath"] for vm in c.get("volumeMounts", [])}
                seen_labels |= set(t["metadata"]["labels"])
                seen_annotations |= set(t["metadata"].get("annotations", {}))
    assert {v for v in seen_volumes if not v.startswith(OPERATOR_VOLUME_PREFIX)} == set(OPERATOR_VOLUMES)
    assert any(v.startswith(OPERATOR_VOLUME_PREFIX) for v in seen_volumes)
    assert {CLAIMS_DIR if p.startswith(CLAIMS_DIR + "/") else p for p in seen_paths} == set(OPERATOR_MOUNT_PATHS)
    assert {k for k in seen_labels if not k.startswith(OPERATOR_LABEL_PREFIX)} == set(OPERATOR_LABELS)
    assert all(k.startswith(OPERATOR_LABEL_PREFIX) for k in seen_annotations)


def test_core_schemas_are_fresh() -> None:
    assert json.loads(core_schemas.SCHEMA_FILE.read_text()) == core_schemas.extract(), (
        "operator/sluice_operator/core_v1_schemas.json is stale; regenerate it with\n"
        "  python -m sluice_operator.core_schemas > operator/sluice_operator/core_v1_schemas.json")


def test_crd_fits_a_client_side_apply() -> None:
    # kubectl apply (client-side) stores the whole object in an annotation, limited to 256 KiB.
    crd = load_yaml(CRD_FILE)
    assert len(json.dumps(crd, separators=(",", ":"))) < 200 * 1024
