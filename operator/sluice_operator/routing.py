"""Gateway API Inference Extension routing (spec.routing.inferencePool): what lets a Gateway the platform runs
(Envoy Gateway, Istio, GKE, ...) route to the endpoint's engines through Sluice's endpoint picker. Pure.

- InferencePool `<name>` (inference.networking.k8s.io/v1): the serving engine pods (the endpoint's Service's
  selector), their HTTP port, and the picker the gateway asks over ext-proc gRPC (endpointPickerRef).
- The picker (EPP): ServiceAccount, Role and RoleBinding, Deployment and Service `<name>-epp`, running
  `sluice gateway --endpoint-picker`: gRPC ext-proc on 9002; /metrics, /health and /ready on 8080. It finds the
  endpoint's ready pods as the Sluice gateway does in --kubernetes mode, so its Role grants, in this namespace,
  what the chart's gateway role grants (DISCOVERY_RULES; a test compares them), and the InferenceObjectives
  that name its pool (their priorities).
- HTTPRoute `<name>` (gateway.networking.k8s.io/v1), with httpRoute: the listeners' traffic (path prefix /) to
  the pool.

The NetworkPolicies that admit the gateway's data plane are network_policy.py's, with the endpoint's others.
docs/gateway-api.md describes the whole arrangement.
"""

from __future__ import annotations

import copy
from typing import Any

from .config import OperatorConfig
from .meta import labels, object_meta
from .spec import InferenceEndpoint, InferencePoolRouting
from .workload import CONTAINER_SECURITY, POD_SECURITY, PORT

POOL_GROUP = "inference.networking.k8s.io"
POOL_API_VERSION = f"{POOL_GROUP}/v1"  # GIE v1.x (scripts/get-gateway-crds.sh)
ROUTE_GROUP = "gateway.networking.k8s.io"
ROUTE_API_VERSION = f"{ROUTE_GROUP}/v1"
RBAC_API_VERSION = "rbac.authorization.k8s.io/v1"
COMPONENT = "endpoint-picker"
PICKER_GRPC_PORT = 9002  # ext-proc (the Inference Extension's conventional EPP port)
PICKER_HTTP_PORT = 8080  # /metrics, /health, /ready
H2C = "kubernetes.io/h2c"  # gRPC without TLS: what a gateway's ext-proc client speaks to the picker
# What `sluice gateway --kubernetes` reads (the chart's sluice.gateway.rules): the InferenceEndpoint (its served
# name and scaling), the Services labelled with it, and their EndpointSlices (the ready pods, by role).
DISCOVERY_RULES = (
    {"apiGroups": ["sluice.dev"], "resources": ["inferenceendpoints", "servedmodels"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "list", "watch"]},
)
# The picker's own: the InferenceObjectives whose poolRef names its pool, for their priorities (picker.py,
# ObjectiveWatch).
OBJECTIVE_RULE = {"apiGroups": ["inference.networking.x-k8s.io"], "resources": ["inferenceobjectives"],
                  "verbs": ["get", "list", "watch"]}
PICKER_RULES = (*DISCOVERY_RULES, OBJECTIVE_RULE)
PICKER_RESOURCES = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}
PICKER_GRACE_S = 30
ENGINE_MAX_NUM_SEQS = 64  # the engine's --max-num-seqs default (sluice_engine.config; test_operator_routing checks)


def pool_of(ep: InferenceEndpoint) -> InferencePoolRouting | None:
    return ep.spec.routing.inference_pool if ep.spec.routing is not None else None


def picker_name(ep: InferenceEndpoint) -> str:
    return f"{ep.name}-epp"


def picker_labels(ep: InferenceEndpoint) -> dict[str, str]:
    """The picker pods' labels (its Deployment's and Service's selector, its NetworkPolicy's podSelector).

    NOTE: not the endpoint label (sluice.dev/endpoint) that its objects carry: the endpoint's own NetworkPolicy
    (`<name>`) selects every pod that has it and admits the engines' peers to their `http` port; the picker's
    pods admit only what their own policy says. The endpoint's status reads engine pods by that label too.
    """
    return {key: value for key, value in labels(ep, COMPONENT).items()
            if key.startswith("app.kubernetes.io/") and key != "app.kubernetes.io/managed-by"}


def inference_pool(ep: InferenceEndpoint, routing: InferencePoolRouting, selector: dict[str, str]) -> dict[str, Any]:
    """`selector`: the endpoint's Service's (reconcile.service). The serving pods that answer HTTP: with
    disaggregation the decode pool (clients talk to it; it sends prompts to the prefill pool itself), never the
    warm pool (standby pods are the Sluice gateway's to use while serving pods are cold) nor LeaderWorkerSet
    workers (they serve /health only)."""
    return {
        "apiVersion": POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": object_meta(ep, ep.name, COMPONENT),
        "spec": {
            "selector": {"matchLabels": dict(selector)},
            "targetPorts": [{"number": PORT}],
            "endpointPickerRef": {"group": "", "kind": "Service", "name": picker_name(ep),
                                  "port": {"number": PICKER_GRPC_PORT}, "failureMode": routing.failure_mode},
        },
    }


def http_route(ep: InferenceEndpoint, routing: InferencePoolRouting) -> dict[str, Any] | None:
    route = routing.http_route
    if route is None:
        return None
    parents = []
    for ref in route.parent_refs:
        parent: dict[str, Any] = {"group": ROUTE_GROUP, "kind": "Gateway", "name": ref.name}
        for key, value in (("namespace", ref.namespace), ("sectionName", ref.section_name), ("port", ref.port)):
            if value is not None:
                parent[key] = value
        parents.append(parent)
    spec: dict[str, Any] = {"parentRefs": parents}
    if route.hostnames:
        spec["hostnames"] = list(route.hostnames)
    spec["rules"] = [{
        "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
        "backendRefs": [{"group": POOL_GROUP, "kind": "InferencePool", "name": ep.name}],
    }]
    return {"apiVersion": ROUTE_API_VERSION, "kind": "HTTPRoute", "metadata": object_meta(ep, ep.name, COMPONENT),
            "spec": spec}


def picker_args(ep: InferenceEndpoint) -> list[str]:
    args = ["--endpoint-picker", "--picker-port", str(PICKER_GRPC_PORT), "--port", str(PICKER_HTTP_PORT),
            "--kubernetes", "-n", ep.namespace, "--pool", f"{ep.namespace}/{ep.name}"]
    # Prefix affinity holds until a pod runs half the batch its engine takes (--max-num-seqs): below that a
    # spill to another pod only costs a cache miss (benchmarks/gie_pickers.py: 41% -> 72% prefix-cache hits).
    args += ["--load-floor", str(max(1, engine_batch(ep) // 2))]
    routing = pool_of(ep)
    if routing is not None and routing.max_inflight_per_pod:
        args += ["--picker-max-inflight", str(routing.max_inflight_per_pod)]
    return args


def engine_batch(ep: InferenceEndpoint) -> int:
    """The engines' --max-num-seqs (engine.args, else the engine's default)."""
    value = ep.spec.engine.args.get("max-num-seqs", ENGINE_MAX_NUM_SEQS)
    try:
        return int(value)
    except (TypeError, ValueError):
        return ENGINE_MAX_NUM_SEQS



def picker_deployment(ep: InferenceEndpoint, routing: InferencePoolRouting, cfg: OperatorConfig) -> dict[str, Any]:
    name, selector = picker_name(ep), picker_labels(ep)
    container = {
        "name": "picker",
        # NOTE: the operator's engine image, never spec.engine.image: the picker reads the operator's objects
        # and labels (sluice_contract), so it must be of the operator's version, and an endpoint's own engine
        # build need not hold the gateway at all. The policy (policy.py) always allows the operator's images.
        "image": cfg.engine_image,
        "command": ["sluice", "gateway"],
        "args": picker_args(ep),
        "env": [{"name": "PYTHONDONTWRITEBYTECODE", "value": "1"}],
        "ports": [{"name": "grpc", "containerPort": PICKER_GRPC_PORT, "protocol": "TCP"},
                  {"name": "http", "containerPort": PICKER_HTTP_PORT, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5, "timeoutSeconds": 3},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "timeoutSeconds": 5,
                          "failureThreshold": 3},
        "securityContext": copy.deepcopy(CONTAINER_SECURITY),
        "resources": copy.deepcopy(routing.picker.resources or PICKER_RESOURCES),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": name,
        "automountServiceAccountToken": True,  # it watches the API server (its Role)
        "enableServiceLinks": False,
        "securityContext": copy.deepcopy(POD_SECURITY),
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
        "terminationGracePeriodSeconds": PICKER_GRACE_S,
    }
    if ep.spec.pod.image_pull_secrets:  # the engines' registry is the picker's too
        pod_spec["imagePullSecrets"] = [{"name": s.name} for s in ep.spec.pod.image_pull_secrets]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(ep, name, COMPONENT),
        "spec": {
            "replicas": routing.picker.replicas,
            "selector": {"matchLabels": selector},
            # A new picker is ready before an old one goes: with FailClose no request meets no picker.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 3,
            "template": {"metadata": {"labels": selector}, "spec": pod_spec},
        },
    }


def picker_service(ep: InferenceEndpoint) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(ep, picker_name(ep), COMPONENT),
        "spec": {
            "type": "ClusterIP",
            "selector": picker_labels(ep),
            "ports": [
                {"name": "grpc", "port": PICKER_GRPC_PORT, "targetPort": "grpc", "protocol": "TCP", "appProtocol": H2C},
                {"name": "http", "port": PICKER_HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
            ],
        },
    }


def picker_rbac(ep: InferenceEndpoint) -> list[dict[str, Any]]:
    """ServiceAccount, Role and RoleBinding `<name>-epp`: read access to what discovery reads, in the endpoint's
    namespace only. The operator holds these permissions itself (the chart's rules): the API server lets it
    create a Role granting only what it may do (RBAC escalation prevention)."""
    name = picker_name(ep)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": object_meta(ep, name, COMPONENT),
         "automountServiceAccountToken": False},  # the picker's pod asks for its token itself
        {"apiVersion": RBAC_API_VERSION, "kind": "Role", "metadata": object_meta(ep, name, COMPONENT),
         "rules": [copy.deepcopy(rule) for rule in PICKER_RULES]},
        {"apiVersion": RBAC_API_VERSION, "kind": "RoleBinding", "metadata": object_meta(ep, name, COMPONENT),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ep.namespace}]},
    ]


def routing_manifests(ep: InferenceEndpoint, cfg: OperatorConfig, selector: dict[str, str]) -> list[dict[str, Any]]:
    """The routing objects, in apply order (the picker's RBAC before its pods, the pool before the route
    naming it); none without spec.routing.inferencePool."""
    routing = pool_of(ep)
    if routing is None:
        return []
    out = [*picker_rbac(ep), picker_deployment(ep, routing, cfg), picker_service(ep),
           inference_pool(ep, routing, selector)]
    route = http_route(ep, routing)
    if route is not None:
        out.append(route)
    return out
