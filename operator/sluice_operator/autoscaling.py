"""The KEDA ScaledObject that scales the serving workload on queue depth per replica."""

from __future__ import annotations

from typing import Any

from .config import OperatorConfig
from .meta import object_meta
from .spec import InferenceEndpoint, Scaling

POLLING_INTERVAL_S = 15
QUEUE_METRIC = "sluice_num_requests_waiting"  # an engine metric: a contract (docs/engine-flags.md)
# The ServiceMonitor copies the Service's sluice.dev/endpoint label onto every series under this name.
ENDPOINT_METRIC_LABEL = "sluice_dev_endpoint"


def queue_query(ep: InferenceEndpoint) -> str:
    """Waiting requests across the endpoint's pods (warm pool included: its queue is demand too)."""
    return f'sum({QUEUE_METRIC}{{namespace="{ep.namespace}",{ENDPOINT_METRIC_LABEL}="{ep.name}"}})'


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
            "triggers": [{
                "type": "prometheus",
                "name": "queue-depth",
                "metricType": "AverageValue",  # the HPA divides by the replica count: depth per replica
                "metadata": {
                    "serverAddress": cfg.prometheus_url,
                    "query": queue_query(ep),
                    "threshold": str(scaling.target_queue_depth),
                    "activationThreshold": "0",
                    "ignoreNullValues": "true",  # no pods yet (scaled to zero) reads as an empty queue
                },
            }],
        },
    }
