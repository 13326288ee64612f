"""Names, labels and ownership shared by every object an endpoint owns."""

from __future__ import annotations

from typing import Any

from .config import OperatorConfig
from .spec import API_VERSION, KIND, InferenceEndpoint

ENDPOINT_LABEL = "sluice.dev/endpoint"
# "serving" on the autoscaled workload's pods, "standby" on the warm pool's. A contract with the gateway: it
# finds backends through the Services below, and tells the two classes apart by this label.
ROLE_LABEL = "sluice.dev/role"
SERVING, STANDBY = "serving", "standby"
SERVES_LABEL = "sluice.dev/serves"  # "true" on pods that answer HTTP (LWS workers do not)
MANAGED_BY = "sluice-operator"
PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"  # `sluice render` of an object never applied


def standby_name(ep: InferenceEndpoint) -> str:
    """The warm pool's workload and Service."""
    return f"{ep.name}-warm"


def serving_selector(ep: InferenceEndpoint) -> str:
    """The serving pods, as a label selector string (status.selector, the scale subresource's)."""
    return f"{ENDPOINT_LABEL}={ep.name},{ROLE_LABEL}={SERVING}"


def labels(ep: InferenceEndpoint, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "sluice",
        "app.kubernetes.io/instance": ep.name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        ENDPOINT_LABEL: ep.name,
    }


def owner_reference(ep: InferenceEndpoint) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": ep.name,
        "uid": ep.metadata.uid or PLACEHOLDER_UID,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def object_meta(ep: InferenceEndpoint, name: str, component: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": ep.namespace,
        "labels": labels(ep, component),
        "ownerReferences": [owner_reference(ep)],
    }


def monitoring_meta(ep: InferenceEndpoint, cfg: OperatorConfig) -> dict[str, Any]:
    """The ServiceMonitor's and PrometheusRule's: named like the endpoint, plus the labels and annotations a
    Prometheus selects them by (SLUICE_MONITORING_LABELS; config.py refuses keys that would replace ours)."""
    meta = object_meta(ep, ep.name, "monitoring")
    meta["labels"] = {**cfg.monitoring_labels, **meta["labels"]}
    if cfg.monitoring_annotations:
        meta["annotations"] = dict(cfg.monitoring_annotations)
    return meta
