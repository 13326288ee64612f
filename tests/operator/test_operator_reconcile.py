"""reconcile(): every manifest for every example is valid Kubernetes, and the layout invariants hold."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import kubernetes_validate
import pytest
from operator_schemas import EXAMPLES, crd_schema, load_yaml, reference_crd, schema_errors

from sluice_operator.config import OperatorConfig
from sluice_operator.meta import PLACEHOLDER_UID
from sluice_operator.reconcile import layout_of, reconcile, service_url
from sluice_operator.spec import parse_endpoint

K8S_VERSIONS = ["1.30", kubernetes_validate.latest_version()]
CUSTOM_KINDS = {  # kind -> (reference CRD file, version)
    "ScaledObject": ("keda.sh_scaledobjects.yaml", "v1alpha1"),
    "TriggerAuthentication": ("keda.sh_triggerauthentications.yaml", "v1alpha1"),
    "LeaderWorkerSet": ("leaderworkerset.x-k8s.io_leaderworkersets.yaml", "v1"),
    "ServiceMonitor": ("monitoring.coreos.com_servicemonitors.yaml", "v1"),
    "PrometheusRule": ("monitoring.coreos.com_prometheusrules.yaml", "v1"),
}
BUILTIN_KINDS = {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy", "ServiceAccount", "Role",
                 "RoleBinding"}
# Gateway API (Inference Extension) kinds: validated against the projects' own CRDs (scripts/get-gateway-crds.sh)
# in test_operator_routing.py and, in a real API server, test_cluster_routing.py.
GATEWAY_KINDS = {"InferencePool", "HTTPRoute"}


def rendered(name: str, **spec_changes: Any) -> tuple[Any, list[dict[str, Any]]]:
    doc = load_yaml(next(p for p in EXAMPLES if p.name == name))
    doc["metadata"]["uid"] = "4f9a51c6-8f0e-4a44-9c1e-2b8d3c1d0e11"
    doc["spec"].update(copy.deepcopy(spec_changes))
    ep = parse_endpoint(doc)
    return ep, reconcile(ep)


def by_kind(manifests: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [m for m in manifests if m["kind"] == kind]


def one(manifests: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (m,) = by_kind(manifests, kind)
    return m


def pod_templates(workload: dict[str, Any]) -> list[dict[str, Any]]:
    if workload["kind"] == "Deployment":
        return [workload["spec"]["template"]]
    lwt = workload["spec"]["leaderWorkerTemplate"]
    return [lwt["leaderTemplate"], lwt["workerTemplate"]]


def workloads(manifests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The engine workloads (not the endpoint picker's Deployment: test_operator_routing.py)."""
    return [m for m in manifests if m["kind"] in ("Deployment", "LeaderWorkerSet")
            and m["metadata"]["labels"]["app.kubernetes.io/component"] != "endpoint-picker"]


# An operator installed for a stock kube-prometheus-stack, with KEDA authenticated to the gateway's scaler.
STOCK_STACK = OperatorConfig(monitoring_labels={"release": "kube-prometheus-stack"},
                             monitoring_annotations={"team": "ml-platform"},
                             gateway_scaler_tls_secret="sluice-gateway-scaler-tls")
ALL = [(path.name, m) for path in EXAMPLES for m in reconcile(parse_endpoint(load_yaml(path)))]
# Its custom resources (the TriggerAuthentication among them) are validated like the defaults' ones.
ALL_CUSTOM = ALL + [(f"{path.name}+stock-stack", m) for path in EXAMPLES
                    for m in reconcile(parse_endpoint(load_yaml(path)), STOCK_STACK) if m["kind"] in CUSTOM_KINDS]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(("example", "manifest"), [a for a in ALL if a[1]["kind"] in BUILTIN_KINDS],
                         ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_builtin_manifests_validate_strictly(example, manifest, version):
    kubernetes_validate.validate(manifest, version, strict=True)


@pytest.mark.parametrize(("example", "manifest"), [a for a in ALL_CUSTOM if a[1]["kind"] in CUSTOM_KINDS],
                         ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_custom_resources_validate_against_reference_crds(example, manifest):
    filename, version = CUSTOM_KINDS[manifest["kind"]]
    reference = reference_crd(filename)
    assert manifest["apiVersion"] == f"{reference['spec']['group']}/{version}"
    assert schema_errors(crd_schema(reference, version), manifest) == []
    if manifest["kind"] == "LeaderWorkerSet":  # its pod templates, as strictly as a Deployment's
        lwt = manifest["spec"]["leaderWorkerTemplate"]
        for role in ("leaderTemplate", "workerTemplate"):
            as_pod_template = {"apiVersion": "v1", "kind": "PodTemplate",
                               "metadata": {"name": f"{manifest['metadata']['name']}-{role}"}, "template": lwt[role]}
            for k8s in K8S_VERSIONS:
                kubernetes_validate.validate(as_pod_template, k8s, strict=True)


def test_every_kind_is_covered():
    kinds = {m["kind"] for _, m in ALL_CUSTOM}
    assert kinds == BUILTIN_KINDS | set(CUSTOM_KINDS) | GATEWAY_KINDS


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_ownership_labels_and_names(path):
    ep = parse_endpoint(load_yaml(path))
    manifests = reconcile(ep)
    keys = {(m["kind"], m["metadata"]["name"]) for m in manifests}
    assert len(keys) == len(manifests)
    for m in manifests:
        meta = m["metadata"]
        assert meta["namespace"] == ep.namespace
        assert meta["ownerReferences"] == [{
            "apiVersion": "sluice.dev/v1alpha1", "kind": "InferenceEndpoint", "name": ep.name,
            "uid": PLACEHOLDER_UID, "controller": True, "blockOwnerDeletion": True}]
        labels = meta["labels"]
        assert labels["app.kubernetes.io/name"] == "sluice"
        assert labels["app.kubernetes.io/instance"] == ep.name
        assert labels["app.kubernetes.io/managed-by"] == "sluice-operator"
        assert labels["sluice.dev/endpoint"] == ep.name
        assert labels["app.kubernetes.io/component"]
        assert len(meta["name"]) <= 63


def test_uid_flows_into_owner_references():
    ep, manifests = rendered("gpu-8b.yaml")
    assert {m["metadata"]["ownerReferences"][0]["uid"] for m in manifests} == {ep.metadata.uid}


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_pods_are_hardened_probed_and_wired(path):
    ep = parse_endpoint(load_yaml(path))
    manifests = reconcile(ep)
    layout = layout_of(ep)
    services = {m["metadata"]["name"]: m for m in by_kind(manifests, "Service")}
    for wl in workloads(manifests):
        for template in pod_templates(wl):
            pod = template["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True
            assert pod["securityContext"]["runAsUser"] != 0
            (engine,) = pod["containers"]
            for c in [engine, *pod.get("initContainers", [])]:
                assert c["securityContext"]["readOnlyRootFilesystem"] is True
                assert c["securityContext"]["allowPrivilegeEscalation"] is False
                mounts = {m["mountPath"] for m in c["volumeMounts"]}
                assert {"/tmp", "/models-cache"} <= mounts
            env = {e["name"]: e.get("value") for e in engine["env"]}
            assert env["SLUICE_CACHE_DIR"] == "/models-cache"
            volumes = {v["name"] for v in pod["volumes"]}
            for c in [engine, *pod.get("initContainers", [])]:
                assert {m["name"] for m in c["volumeMounts"]} <= volumes
            # probes
            startup = engine["startupProbe"]
            assert startup["httpGet"]["path"] == "/health"
            budget = startup["periodSeconds"] * startup["failureThreshold"]
            assert ep.spec.startup_grace_seconds <= budget < ep.spec.startup_grace_seconds + startup["periodSeconds"]
            assert engine["livenessProbe"]["httpGet"]["path"] == "/health"
            serves = template["metadata"]["labels"]["sluice.dev/serves"] == "true"
            # A pod that serves is ready to take requests; an LWS worker (ranks only) while its group lives.
            assert engine["readinessProbe"]["httpGet"]["path"] == ("/ready" if serves else "/health")
            # Each Service selects the pods of its own role that answer HTTP, and no other pod.
            role = template["metadata"]["labels"]["sluice.dev/role"]
            own = {"serving": ep.name, "prefill": f"{ep.name}-prefill"}.get(role, f"{ep.name}-warm")
            for name, svc in services.items():
                assert _selects(svc["spec"]["selector"], template["metadata"]["labels"]) == (serves and name == own)
            # flags
            args = engine["args"]
            flag = dict(zip(args[::2], args[1::2], strict=False))
            assert engine["command"] == ["sluice", "serve"]
            assert flag["--host"] == "0.0.0.0" and flag["--port"] == "8000"
            assert flag["--served-model-name"] == ep.spec.model.name
            assert flag["--dtype"] == ep.spec.engine.dtype
            assert flag["--device"] == ("cpu" if ep.spec.accelerator.type == "cpu" else "cuda")
            if ep.spec.engine.max_model_len:
                assert flag["--max-model-len"] == str(ep.spec.engine.max_model_len)
            for name, value in ep.spec.engine.args.items():
                assert flag[f"--{name}"] == str(value)
            assert flag.get("--tensor-parallel-size", "1") == str(ep.spec.parallelism.tensor)
            assert flag.get("--pipeline-parallel-size", "1") == str(ep.spec.parallelism.pipeline)
            assert flag.get("--nnodes", "1") == str(layout.pods_per_replica)
            # shared memory for NCCL and the rank processes, wherever the engine runs more than one process
            # or a GPU
            dshm = {v["name"]: v for v in pod["volumes"]}.get("dshm")
            assert (dshm is not None) == (layout.gpus_per_pod > 0 or layout.distributed)
            # GPUs
            gpu = ep.spec.accelerator.resource_name
            limits = engine.get("resources", {}).get("limits", {})
            if layout.gpus_per_pod:
                assert limits[gpu] == layout.gpus_per_pod
                assert engine["resources"]["requests"][gpu] == layout.gpus_per_pod
                assert {"key": gpu, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
                if ep.spec.accelerator.product:
                    assert pod["nodeSelector"][ep.spec.accelerator.product_label] == ep.spec.accelerator.product
            else:
                assert gpu not in limits and "tolerations" not in pod


def test_cpu_example():
    ep, manifests = rendered("cpu-smollm2.yaml")
    (deployment,) = workloads(manifests)
    assert deployment["kind"] == "Deployment" and deployment["spec"]["replicas"] == 1
    assert not by_kind(manifests, "ScaledObject")
    engine = deployment["spec"]["template"]["spec"]["containers"][0]
    assert engine["args"][:8] == ["--model", "/models-cache/hub/HuggingFaceTB/SmolLM2-135M-Instruct/main",
                                  "--served-model-name", "smollm2", "--device", "cpu", "--dtype", "float32"]
    assert engine["resources"] == {"requests": {"cpu": "2", "memory": "3Gi"}, "limits": {"memory": "4Gi"}}
    (fetch,) = deployment["spec"]["template"]["spec"]["initContainers"]
    assert fetch["command"] == ["python", "/etc/sluice/fetch-hf.py"]
    cm = one(manifests, "ConfigMap")
    assert "snapshot_download" in cm["data"]["fetch-hf.py"]
    assert service_url(ep, OperatorConfig()) == "http://smollm2.default.svc.cluster.local/v1"


def test_tracing_renders_the_engines_otlp_flags():
    """spec.tracing -> --otlp-traces-endpoint and --trace-sample-ratio (docs/metrics.md, Tracing); unset: none."""
    _, manifests = rendered("cpu-smollm2.yaml", tracing={"otlpEndpoint": "http://otel.observability:4318",
                                                         "sampleRatio": 0.25})
    args = workloads(manifests)[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--otlp-traces-endpoint") + 1] == "http://otel.observability:4318"
    assert args[args.index("--trace-sample-ratio") + 1] == "0.25"
    _, plain = rendered("cpu-smollm2.yaml")
    assert "--otlp-traces-endpoint" not in workloads(plain)[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    for bad in ({"otlpEndpoint": "collector:4318"}, {"otlpEndpoint": "http://c:4318", "sampleRatio": 2}):
        with pytest.raises(ValueError):
            rendered("cpu-smollm2.yaml", tracing=bad)


def test_single_gpu_example():
    ep, manifests = rendered("gpu-8b.yaml")
    (deployment,) = workloads(manifests)
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "envFrom" not in pod["containers"][0]  # model credentials reach the fetch container only
    assert pod["initContainers"][0]["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "model-cache"}} in pod["volumes"]
    args = pod["containers"][0]["args"]
    flag = dict(zip(args[::2], args[1::2], strict=False))
    # slo and cost reach the engine through the ConfigMap (a file it re-reads), not through flags.
    assert flag["--objectives-file"] == "/etc/sluice/objectives.json"
    assert not {"--slo-ttft-ms", "--slo-tpot-ms", "--gpu-hour-usd"} & set(args)
    cm = one(manifests, "ConfigMap")
    assert json.loads(cm["data"]["objectives.json"]) == {"slo-ttft-ms": 500, "slo-tpot-ms": 50, "gpu-hour-usd": 1.2}
    config = next(v for v in pod["volumes"] if v["name"] == "config")
    assert config["configMap"]["name"] == cm["metadata"]["name"]
    assert {"key": "objectives.json", "path": "objectives.json"} in config["configMap"]["items"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "config")
    assert mount == {"name": "config", "mountPath": "/etc/sluice", "readOnly": True}  # no subPath: updated live
    pdb = one(manifests, "PodDisruptionBudget")
    assert _selects(pdb["spec"]["selector"]["matchLabels"], deployment["spec"]["template"]["metadata"]["labels"])
    assert _selects(deployment["spec"]["selector"]["matchLabels"],
                    deployment["spec"]["template"]["metadata"]["labels"])


def test_multinode_example_is_a_leaderworkerset_of_two():
    ep, manifests = rendered("multinode-70b.yaml")
    (lws,) = workloads(manifests)
    assert lws["kind"] == "LeaderWorkerSet"
    assert "replicas" not in lws["spec"]  # the autoscaler owns the count
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    for template in pod_templates(lws):
        engine = template["spec"]["containers"][0]
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert template["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
        assert template["spec"]["priorityClassName"] == "inference-high"
        assert "--model" in engine["args"] and "/models/Llama-3.1-70B-Instruct" in engine["args"]
        # pvc:// is mounted, not fetched; the hostPath cache (the engine's scratch) is made the engine user's.
        assert [c["name"] for c in template["spec"]["initContainers"]] == ["own-model-cache"]
        args = engine["args"]
        flag = dict(zip(args[::2], args[1::2], strict=True))
        assert (flag["--tensor-parallel-size"], flag["--pipeline-parallel-size"], flag["--nnodes"]) == ("8", "2", "2")
        assert flag["--master-addr"] == "$(LWS_LEADER_ADDRESS)"
    lwt = lws["spec"]["leaderWorkerTemplate"]
    assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert "--node-rank" in lwt["leaderTemplate"]["spec"]["containers"][0]["args"]
    so = one(manifests, "ScaledObject")
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": "leaderworkerset.x-k8s.io/v1",
                                            "kind": "LeaderWorkerSet", "name": "llama-70b"}
    assert so["spec"]["fallback"] == {"failureThreshold": 3, "replicas": 2, "behavior": "currentReplicasIfHigher"}


def test_scale_to_zero_example():
    ep, manifests = rendered("scale-to-zero.yaml")
    serving, warm = workloads(manifests)
    assert serving["metadata"]["name"] == "qwen-7b" and "replicas" not in serving["spec"]
    assert warm["metadata"]["name"] == "qwen-7b-warm" and warm["spec"]["replicas"] == 1
    assert serving["spec"]["template"]["metadata"]["labels"]["sluice.dev/role"] == "serving"
    assert warm["spec"]["template"]["metadata"]["labels"]["sluice.dev/role"] == "standby"
    assert not _selects(serving["spec"]["selector"]["matchLabels"], warm["spec"]["template"]["metadata"]["labels"])
    assert warm["spec"]["template"]["spec"] == serving["spec"]["template"]["spec"]  # the same pods, loaded
    # Two Services: the gateway reads serving and standby backends apart, by the role label the EndpointSlice
    # controller copies from each Service onto its slices.
    service, standby = by_kind(manifests, "Service")
    assert (service["metadata"]["name"], standby["metadata"]["name"]) == ("qwen-7b", "qwen-7b-warm")
    assert service["metadata"]["labels"]["sluice.dev/role"] == "serving"
    assert standby["metadata"]["labels"]["sluice.dev/role"] == "standby"
    assert _selects(service["spec"]["selector"], serving["spec"]["template"]["metadata"]["labels"])
    assert not _selects(service["spec"]["selector"], warm["spec"]["template"]["metadata"]["labels"])
    assert _selects(standby["spec"]["selector"], warm["spec"]["template"]["metadata"]["labels"])
    assert not _selects(standby["spec"]["selector"], serving["spec"]["template"]["metadata"]["labels"])
    pdb = one(manifests, "PodDisruptionBudget")
    assert not _selects(pdb["spec"]["selector"]["matchLabels"], warm["spec"]["template"]["metadata"]["labels"])
    # The ScaledObject scales the serving Deployment only; the warm pool keeps its fixed count.
    so = one(manifests, "ScaledObject")["spec"]
    assert so["minReplicaCount"] == 0 and so["maxReplicaCount"] == 4
    assert so["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "qwen-7b"}
    assert so["initialCooldownPeriod"] == 600 and so["cooldownPeriod"] == 600
    assert so["fallback"]["replicas"] == 1  # max(minReplicas, 1) without onMetricsOutage
    behavior = so["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 600
    prometheus, push = so["triggers"]
    assert prometheus["type"] == "prometheus" and prometheus["metricType"] == "AverageValue"
    assert prometheus["metadata"]["threshold"] == "4"
    # No `or vector(0)`: a queue nobody scrapes is an error for KEDA (its fallback), not an empty queue. The
    # engines' side reads 0 only while the gateway sees no ready backend (zero replicas, or loading).
    assert prometheus["metadata"]["query"] == (
        'sum(sluice_gateway_pending_requests{endpoint="inference/qwen-7b"})'
        ' + (sum(sluice_num_requests_waiting{namespace="inference",sluice_dev_endpoint="qwen-7b"})'
        ' or on() (sum(sluice_gateway_backends{endpoint="inference/qwen-7b",state="ready"}) == 0))')
    assert prometheus["metadata"]["ignoreNullValues"] == "false"
    # One target, the endpoint's targetQueueDepth, on both triggers; the gateway reports its held requests.
    assert push == {"type": "external-push", "name": "gateway", "metricType": "AverageValue", "metadata": {
        "scalerAddress": "sluice-gateway.sluice-system.svc:9090", "endpoint": "inference/qwen-7b",
        "model": "qwen2.5-7b-instruct", "metric": "queue", "targetValue": "4"}}
    own, fetch = serving["spec"]["template"]["spec"]["initContainers"]
    assert own["name"] == "own-model-cache" and fetch["name"] == "fetch-model"  # hostPath: owned, then filled
    assert fetch["command"][:2] == ["sh", "-c"] and "aws s3 sync" in fetch["command"][2]
    assert "s3://models/qwen2.5-7b-instruct/" in fetch["command"]
    monitor = one(manifests, "ServiceMonitor")["spec"]
    for svc in (service, standby):  # both pools' queues are demand
        labels = svc["metadata"]["labels"]
        assert _selects(monitor["selector"]["matchLabels"], labels)
        (expr,) = monitor["selector"]["matchExpressions"]
        assert labels[expr["key"]] in expr["values"]
    # -> the query's sluice_dev_endpoint, and sluice_dev_role (serving or standby) for the dashboards
    assert monitor["targetLabels"] == ["sluice.dev/endpoint", "sluice.dev/role"]


def test_queue_query_is_promql():
    promql_parser = pytest.importorskip("promql_parser")
    _, manifests = rendered("scale-to-zero.yaml")
    query = one(manifests, "ScaledObject")["spec"]["triggers"][0]["metadata"]["query"]
    promql_parser.parse(query)  # raises on a syntax error


def test_without_a_gateway_there_is_no_push_trigger():
    ep, _ = rendered("scale-to-zero.yaml", scaling={"minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 6})
    cfg = OperatorConfig(gateway_scaler_address="", gateway_url="")
    (trigger,) = one(reconcile(ep, cfg), "ScaledObject")["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    # The engines' queue alone: no gateway series to add, and none to excuse a missing queue.
    assert trigger["metadata"]["query"] == (
        'sum(sluice_num_requests_waiting{namespace="inference",sluice_dev_endpoint="qwen-7b"})')
    assert (trigger["metadata"]["threshold"], trigger["metadata"]["ignoreNullValues"]) == ("6", "false")
    so = one(reconcile(ep, OperatorConfig(gateway_scaler_address="gw.ops.svc:9090")), "ScaledObject")
    assert so["spec"]["triggers"][1]["metadata"]["scalerAddress"] == "gw.ops.svc:9090"
    assert so["spec"]["triggers"][1]["metadata"]["targetValue"] == "6"


def test_scale_to_zero_without_a_gateway_is_refused():
    """KEDA could never wake it: at zero replicas only the gateway sees a request arrive."""
    from sluice_operator.autoscaling import ScalingNeedsGateway

    ep, _ = rendered("scale-to-zero.yaml")
    assert ep.spec.scaling.min_replicas == 0
    with pytest.raises(ScalingNeedsGateway, match="scaling.minReplicas is 0, but this operator has no gateway"):
        reconcile(ep, OperatorConfig(gateway_scaler_address="", gateway_url=""))
    assert ScalingNeedsGateway.reason == "ScaleToZeroNeedsGateway"


def test_scaler_authentication_goes_through_a_trigger_authentication():
    """KEDA takes an external scaler's client certificate (and nothing else) from a TriggerAuthentication."""
    ep, _ = rendered("scale-to-zero.yaml")
    manifests = reconcile(ep, STOCK_STACK)
    auth = one(manifests, "TriggerAuthentication")
    assert auth["metadata"]["name"] == "qwen-7b-gateway-scaler" and auth["metadata"]["namespace"] == "inference"
    assert auth["spec"] == {"secretTargetRef": [
        {"parameter": "caCert", "name": "sluice-gateway-scaler-tls", "key": "ca.crt"},
        {"parameter": "tlsClientCert", "name": "sluice-gateway-scaler-tls", "key": "tls.crt"},
        {"parameter": "tlsClientKey", "name": "sluice-gateway-scaler-tls", "key": "tls.key"}]}
    kinds = [m["kind"] for m in manifests]
    assert kinds.index("TriggerAuthentication") < kinds.index("ScaledObject")  # applied before it is named
    prometheus, push = one(manifests, "ScaledObject")["spec"]["triggers"]
    assert push["authenticationRef"] == {"name": "qwen-7b-gateway-scaler"}
    assert "authenticationRef" not in prometheus
    for schema_file, kind in (("keda.sh_triggerauthentications.yaml", "TriggerAuthentication"),
                              ("keda.sh_scaledobjects.yaml", "ScaledObject")):
        assert schema_errors(crd_schema(reference_crd(schema_file), "v1alpha1"), one(manifests, kind)) == []
    # Without a gateway there is no external trigger to authenticate, so no TriggerAuthentication either.
    ep, _ = rendered("scale-to-zero.yaml", scaling={"minReplicas": 1, "maxReplicas": 4})
    no_gateway = OperatorConfig(gateway_scaler_address="", gateway_url="", gateway_scaler_tls_secret="tls")
    assert not by_kind(reconcile(ep, no_gateway), "TriggerAuthentication")
    assert not by_kind(reconcile(ep), "TriggerAuthentication")  # nor without the Secret's name


def test_stock_prometheus_stack_labels_reach_the_monitoring_objects():
    """kube-prometheus-stack selects ServiceMonitors and PrometheusRules by `release: <its release>`."""
    ep, _ = rendered("scale-to-zero.yaml")
    manifests = reconcile(ep, STOCK_STACK)
    for kind in ("ServiceMonitor", "PrometheusRule"):
        meta = one(manifests, kind)["metadata"]
        assert meta["labels"]["release"] == "kube-prometheus-stack"
        assert meta["labels"]["sluice.dev/endpoint"] == "qwen-7b"  # the operator's own labels stay
        assert meta["annotations"] == {"team": "ml-platform"}
    for m in manifests:  # and only there
        if m["kind"] not in ("ServiceMonitor", "PrometheusRule"):
            assert "release" not in m["metadata"]["labels"] and "annotations" not in m["metadata"]


def test_every_autoscaled_variant_validates_against_keda():
    """minReplicas 0 or not, warm pool or not, gateway or not, multi-node: every ScaledObject is valid."""
    schema = crd_schema(reference_crd("keda.sh_scaledobjects.yaml"), "v1alpha1")
    for example, changes in [("scale-to-zero.yaml", {}),
                             ("scale-to-zero.yaml", {"scaling": {"minReplicas": 2, "maxReplicas": 3}}),
                             ("multinode-70b.yaml", {}),
                             ("gpu-8b.yaml", {"replicas": None, "scaling": {
                                 "minReplicas": 0, "maxReplicas": 2, "warmPool": {"replicas": 2},
                                 "onMetricsOutage": {"replicas": 1}, "scaleDownDelaySeconds": 0}})]:
        ep, _ = rendered(example, **changes)
        for cfg in (OperatorConfig(), OperatorConfig(gateway_scaler_address=""), STOCK_STACK):
            if ep.spec.scaling.min_replicas == 0 and not cfg.gateway_scaler_address:
                continue  # refused (test_scale_to_zero_without_a_gateway_is_refused)
            so = one(reconcile(ep, cfg), "ScaledObject")
            assert schema_errors(schema, so) == [], (example, changes)
            assert so["spec"]["minReplicaCount"] == ep.spec.scaling.min_replicas


def test_replica_counts_follow_the_spec():
    for replicas in (0, 1, 5):
        _, manifests = rendered("gpu-8b.yaml", replicas=replicas)
        assert workloads(manifests)[0]["spec"]["replicas"] == replicas
    _, manifests = rendered("gpu-8b.yaml", replicas=None, scaling={"minReplicas": 2, "maxReplicas": 6})
    assert "replicas" not in workloads(manifests)[0]["spec"]
    assert one(manifests, "ScaledObject")["spec"]["minReplicaCount"] == 2


def test_startup_probe_scales_with_grace():
    for grace in (10, 95, 3600):
        _, manifests = rendered("gpu-8b.yaml", startupGraceSeconds=grace)
        probe = workloads(manifests)[0]["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
        assert probe["failureThreshold"] == math.ceil(grace / probe["periodSeconds"])


def test_pods_roll_when_flags_change_and_only_then():
    def config_hash(**changes: Any) -> str:
        _, manifests = rendered("gpu-8b.yaml", **changes)
        return workloads(manifests)[0]["spec"]["template"]["metadata"]["annotations"]["sluice.dev/config-hash"]

    assert config_hash() == config_hash()
    assert config_hash() != config_hash(engine={"args": {"max-num-seqs": 64}})
    assert config_hash() == config_hash(replicas=7)


def test_slo_and_cost_edits_leave_the_pod_template_alone():
    """Only the ConfigMap (and rules) change: no rollout, no model reloaded on every GPU."""
    def rendered_with(**changes: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        _, manifests = rendered("gpu-8b.yaml", **changes)
        return workloads(manifests)[0]["spec"]["template"], one(manifests, "ConfigMap")["data"]

    template, data = rendered_with()
    for changes in ({"slo": {"ttftMs": 200, "tpotMs": 20, "target": 0.95}}, {"cost": {"gpuHourUSD": 4.5}},
                    {"slo": None, "cost": None}):
        edited_template, edited_data = rendered_with(**changes)
        assert edited_template == template, changes
        assert edited_data["objectives.json"] != data["objectives.json"], changes


def test_rollout_reaches_deployment_and_leaderworkerset():
    for example in ("gpu-8b.yaml", "multinode-70b.yaml"):
        _, default = rendered(example)
        _, surge = rendered(example, rollout={"maxSurge": "25%", "maxUnavailable": 0})
        (before,), (after,) = workloads(default), workloads(surge)
        if before["kind"] == "Deployment":
            strategy = lambda w: w["spec"]["strategy"]["rollingUpdate"]  # noqa: E731
        else:
            strategy = lambda w: w["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]  # noqa: E731
        assert strategy(before) == {"maxSurge": 0, "maxUnavailable": 1}, example  # no spare GPUs by default
        assert strategy(after) == {"maxSurge": "25%", "maxUnavailable": 0}, example
        if after["kind"] == "Deployment":  # the API's own schemas, strictly (a percentage is int-or-string)
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(after, version, strict=True)
        else:
            lws = crd_schema(reference_crd("leaderworkerset.x-k8s.io_leaderworkersets.yaml"), "v1")
            assert schema_errors(lws, after) == []


def test_reconcile_is_pure():
    ep = parse_endpoint(load_yaml(next(p for p in EXAMPLES if p.name == "cpu-smollm2.yaml")))
    before = ep.model_dump()
    first = reconcile(ep)
    one(first, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"].append("--mutated")
    assert reconcile(ep) != first and ep.model_dump() == before


def test_pod_escape_hatches_pass_through():
    _, manifests = rendered("gpu-8b.yaml", pod={
        "nodeSelector": {"pool": "gpu"},
        "tolerations": [{"key": "spot", "operator": "Exists"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
        "priorityClassName": "high",
        "env": [{"name": "LOG_FORMAT", "value": "json"}],
        "imagePullSecrets": [{"name": "registry"}],
        "resources": {"limits": {"memory": "40Gi", "nvidia.com/gpu": 4}},
    })
    (deployment,) = workloads(manifests)
    pod = deployment["spec"]["template"]["spec"]
    engine = pod["containers"][0]
    assert pod["nodeSelector"] == {"pool": "gpu", "nvidia.com/gpu.product": "NVIDIA-L40S"}
    assert {"key": "spot", "operator": "Exists"} in pod["tolerations"]
    assert pod["affinity"]["nodeAffinity"]
    assert pod["priorityClassName"] == "high" and pod["imagePullSecrets"] == [{"name": "registry"}]
    assert {"name": "LOG_FORMAT", "value": "json"} in engine["env"]
    assert engine["resources"]["limits"] == {"memory": "40Gi", "nvidia.com/gpu": 1}  # the layout decides GPUs
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(deployment, version, strict=True)


def test_validators_catch_mistakes():
    """Controls: the validators above do reject an unknown field, so their passing means something."""
    _, manifests = rendered("multinode-70b.yaml")
    deployment = copy.deepcopy(one(rendered("gpu-8b.yaml")[1], "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["periodSecond"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)
    so = copy.deepcopy(one(manifests, "ScaledObject"))
    so["spec"]["fallback"]["behaviour"] = "static"
    assert schema_errors(crd_schema(reference_crd("keda.sh_scaledobjects.yaml"), "v1alpha1"), so)
    lws = copy.deepcopy(one(manifests, "LeaderWorkerSet"))
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["imagePolicy"] = "Always"
    assert schema_errors(crd_schema(reference_crd("leaderworkerset.x-k8s.io_leaderworkersets.yaml"), "v1"), lws)
