"""The KEDA ScaledObject that scales the serving workload: queue depth per replica, and the gateway's demand.

Two triggers, one ScaledObject (KEDA is the only scaler; no second HPA):
- `prometheus` (1 <-> N): requests waiting in the engines plus requests the gateway holds for the endpoint,
  per replica. The engines' own queue vanishes at zero replicas; the gateway's count does not.
- `external-push` (0 -> 1 at once): the gateway's KEDA external scaler pushes IsActive the moment it holds a
  request for an endpoint with no ready serving replica. Left out when no gateway is configured.
"""

from __future__ import annotations

from typing import Any

from sluice_contract import GATEWAY_PENDING_METRIC, TRIGGER_ENDPOINT, TRIGGER_MODEL
from sluice_contract import endpoint_key as contract_endpoint_key

from .config import OperatorConfig
from .meta import object_meta
from .spec import InferenceEndpoint, Scaling

POLLING_INTERVAL_S = 15
QUEUE_METRIC = "sluice_num_requests_waiting"  # an engine metric: a contract (docs/engine-flags.md)
# The ServiceMonitor copies the Service's sluice.dev/endpoint label onto every series under this name.
ENDPOINT_METRIC_LABEL = "sluice_dev_endpoint"


def endpoint_key(ep: InferenceEndpoint) -> str:
    """How the gateway names an endpoint: in its metrics, and in the external scaler's metadata."""
    return contract_endpoint_key(ep.namespace, ep.name)


def queue_query(ep: InferenceEndpoint) -> str:
    """Waiting requests in the endpoint's pods (warm pool included: its queue is demand too), plus the
    requests the gateway holds for it. `or vector(0)`: either side may have no series (no pods at zero, no
    gateway), and a sum with an empty side would be empty."""
    engines = f'sum({QUEUE_METRIC}{{namespace="{ep.namespace}",{ENDPOINT_METRIC_LABEL}="{ep.name}"}})'
    gateway = f'sum({GATEWAY_PENDING_METRIC}{{endpoint="{endpoint_key(ep)}"}})'
    return f"({engines} or vector(0)) + ({gateway} or vector(0))"


def triggers(ep: InferenceEndpoint, cfg: OperatorConfig, scaling: Scaling) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{
        "type": "prometheus",
        "name": "queue-depth",
        "metricType": "AverageValue",  # the HPA divides by the replica count: depth per replica
        "metadata": {
            "serverAddress": cfg.prometheus_url,
            "query": queue_query(ep),
            "threshold": str(scaling.target_queue_depth),
            "activationThreshold": "0",
            "ignoreNullValues": "true",  # no series yet reads as an empty queue
        },
    }]
    if cfg.gateway_scaler_address:
        out.append({
            "type": "external-push",
            "name": "gateway",
            "metricType": "AverageValue",
            # KEDA hands these to the gateway's scaler as ScaledObjectRef.scalerMetadata. The gateway's metric
            # (held + in-flight requests per replica) has its target from `sluice gateway --scaler-target`.
            "metadata": {
                "scalerAddress": cfg.gateway_scaler_address,
                TRIGGER_ENDPOINT: endpoint_key(ep),
                TRIGGER_MODEL: ep.spec.model.name,
            },
        })
    return out


def hpa_behavior(scaling: Scaling) -> dict[str, Any]:
    return {
        # Scale out at once: a queue at a cold model only grows, and new replicas take minutes to load.
        "scaleUp": {
            "stabilizationWindowSeconds": 0,
            "selectPolicy": "Max",
            "policies": [{"type": "Percent", "value": 100, "periodSeconds": 15},
                         {"type": "Pods", "value": 4, "periodSeconds": 15}],
        },
        # Scale in only after the queue has stayed low for scaleDownDelaySeconds, and gradually.
        "scaleDown": {
            "stabilizationWindowSeconds": scaling.scale_down_delay_seconds,
            "selectPolicy": "Max",
            "policies": [{"type": "Percent", "value": 50, "periodSeconds": 60}],
        },
    }


def scaled_object(ep: InferenceEndpoint, cfg: OperatorConfig, target: dict[str, Any]) -> dict[str, Any]:
    scaling = ep.spec.scaling
    assert scaling is not None
    outage = scaling.on_metrics_outage.replicas if scaling.on_metrics_outage else max(scaling.min_replicas, 1)
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": object_meta(ep, ep.name, "autoscaler"),
        "spec": {
            "scaleTargetRef": {"apiVersion": target["apiVersion"], "kind": target["kind"],
                               "name": target["metadata"]["name"]},
            "minReplicaCount": scaling.min_replicas,
            "maxReplicaCount": scaling.max_replicas,
            "pollingInterval": POLLING_INTERVAL_S,
            "cooldownPeriod": scaling.scale_down_delay_seconds,  # idle time before scaling to zero
            "initialCooldownPeriod": ep.spec.startup_grace_seconds,  # no scale-to-zero while first loading
            "fallback": {"failureThreshold": 3, "replicas": outage, "behavior": "currentReplicasIfHigher"},
            "advanced": {"horizontalPodAutoscalerConfig": {"name": ep.name, "behavior": hpa_behavior(scaling)}},
            "triggers": triggers(ep, cfg, scaling),
        },
    }
