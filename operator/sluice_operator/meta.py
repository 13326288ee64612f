"""Names, labels and ownership shared by every object an endpoint owns."""

from __future__ import annotations

from typing import Any

from .spec import API_VERSION, KIND, InferenceEndpoint

ENDPOINT_LABEL = "sluice.dev/endpoint"
POOL_LABEL = "sluice.dev/pool"  # serving | standby (the warm pool)
SERVES_LABEL = "sluice.dev/serves"  # "true" on pods that answer HTTP (LWS workers do not)
MANAGED_BY = "sluice-operator"
PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"  # `sluice render` of an object never applied


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
