"""Names, labels and ownership shared by every object an endpoint owns."""

from __future__ import annotations

from typing import Any

# Labels are a contract with the gateway (sluice_contract): it finds backends through the Services the operator
# labels with the endpoint, and tells serving from standby pods by the role. Re-exported for the operator.
from sluice_contract import ENDPOINT_LABEL as ENDPOINT_LABEL
from sluice_contract import PREFILL as PREFILL
from sluice_contract import ROLE_LABEL as ROLE_LABEL
from sluice_contract import SERVES_LABEL as SERVES_LABEL
from sluice_contract import SERVING as SERVING
from sluice_contract import STANDBY as STANDBY

from .config import OperatorConfig
from .spec import API_VERSION, KIND, InferenceEndpoint

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
