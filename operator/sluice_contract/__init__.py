"""The names the operator and the gateway agree on: labels, the endpoint key, the served-name rule, the
names clients send, and the metric names the operator's queries read. Standard library only: the gateway
imports it without pulling in pydantic, and the operator without pulling in aiohttp or grpc.

Change a value here deliberately: objects already in a cluster carry the old labels, and the rules,
dashboards and ScaledObjects of running endpoints query the old metric names (docs/gateway.md,
docs/operator.md).
"""

from __future__ import annotations

# -- the resource ------------------------------------------------------------------------------------------
GROUP = "sluice.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceEndpoint"
PLURAL = "inferenceendpoints"

# -- labels on what the operator creates -------------------------------------------------------------------
# On every child object and pod: the InferenceEndpoint's name. The EndpointSlice controller copies a
# Service's labels onto its slices, which is how the gateway finds an endpoint's backends.
ENDPOINT_LABEL = f"{GROUP}/endpoint"
# "serving" on the autoscaled workload's pods and Service, "standby" on the warm pool's: the gateway tells the
# two classes of backend apart by it.
ROLE_LABEL = f"{GROUP}/role"
SERVING, STANDBY = "serving", "standby"
# Read by the gateway when a slice carries the pods' pool label instead of the role.
POOL_LABEL = f"{GROUP}/pool"
SERVES_LABEL = f"{GROUP}/serves"  # "true" on pods that answer HTTP (LeaderWorkerSet workers do not)
# Set by the EndpointSlice controller on every slice of a Service (Kubernetes' own label).
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def endpoint_key(namespace: str, name: str) -> str:
    """How the gateway names an endpoint: in its metrics (label `endpoint`), in the external scaler's
    trigger metadata (`endpoint`), and in API keys files."""
    return f"{namespace}/{name}"


# -- the model name ----------------------------------------------------------------------------------------
def served_name(served: str | None, uri: str) -> str:
    """The name the engine answers to: spec.model.servedName, else the last path component of the uri
    (hf://Org/Model-7B -> Model-7B). The operator passes it to the engine as --served-model-name."""
    if served:
        return served
    location = uri.split("://", 1)[-1].rstrip("/")
    return location.rsplit("/", 1)[-1]


# spec.model.nameScope: where the gateway publishes the served name.
NAME_SCOPE_NAMESPACE = "Namespace"  # clients send <namespace>/<servedName>
NAME_SCOPE_CLUSTER = "Cluster"  # ... or the plain <servedName>, from any namespace
NAME_SCOPES = (NAME_SCOPE_NAMESPACE, NAME_SCOPE_CLUSTER)


def namespaced_model(namespace: str, served: str) -> str:
    """The name a client sends to reach `served` in `namespace` through the gateway. It cannot collide
    across namespaces: the namespace is part of it (a namespace name holds no '/')."""
    return f"{namespace}/{served}"


def model_names(namespace: str, served: str, scope: str, only_namespace: bool) -> tuple[str, ...]:
    """Every name an endpoint claims at the gateway, the namespaced one first. The plain served name is
    claimed too when the endpoint publishes it cluster-wide (`scope` Cluster) or when the gateway serves
    this one namespace only (`only_namespace`: no other namespace can claim it)."""
    if scope not in NAME_SCOPES:
        raise ValueError(f"model name scope must be one of {', '.join(NAME_SCOPES)}, got {scope!r}")
    names = [namespaced_model(namespace, served)]
    if scope == NAME_SCOPE_CLUSTER or only_namespace:
        names.append(served)
    return tuple(names)


# -- metrics the operator's queries read ---------------------------------------------------------------------
GATEWAY_PENDING_METRIC = "sluice_gateway_pending_requests"  # gauge {endpoint}: held for a ready backend
GATEWAY_INFLIGHT_METRIC = "sluice_gateway_inflight_requests"  # gauge {endpoint}: sent, not finished
GATEWAY_BACKENDS_METRIC = "sluice_gateway_backends"  # gauge {endpoint, role, state}
# The external scaler's metric (GetMetricSpec / GetMetrics): held + in-flight requests over every gateway
# replica, per serving replica of the endpoint.
SCALER_METRIC_NAME = "sluice-gateway-demand"
# The external-push trigger's metadata keys the gateway reads.
TRIGGER_ENDPOINT = "endpoint"
TRIGGER_MODEL = "model"
