"""The endpoint's own pod settings (spec.pod), laid over the engine pod template the operator renders.

Additive only: the user's labels, annotations, volumes and mounts join the operator's, never replace them
(the CRD's rules refuse the operator's names; here the operator's win as well, should one get through).
"""

from __future__ import annotations

import copy
from typing import Any

from .spec import InferenceEndpoint

ENGINE_CONTAINER = "engine"


def customize_pod(template: dict[str, Any], ep: InferenceEndpoint) -> dict[str, Any]:
    """`template` (a pod template: metadata and spec) with spec.pod's identity, placement and volumes."""
    pod = ep.spec.pod
    meta, spec = template["metadata"], template["spec"]
    if pod.labels:
        meta["labels"] = {**pod.labels, **meta.get("labels", {})}
    if pod.annotations:
        meta["annotations"] = {**pod.annotations, **meta.get("annotations", {})}
    # Identity and placement.
    for key, value in (("serviceAccountName", pod.service_account_name),
                       ("runtimeClassName", pod.runtime_class_name),
                       ("schedulerName", pod.scheduler_name)):
        if value is not None:
            spec[key] = value
    if pod.topology_spread_constraints:
        spec["topologySpreadConstraints"] = copy.deepcopy(pod.topology_spread_constraints)
    # Extra volumes, mounted into the serving container only (never into the model fetch container).
    if pod.volumes:
        spec["volumes"] = [*spec.get("volumes", []), *copy.deepcopy(pod.volumes)]
    if pod.volume_mounts:
        engine = next(c for c in spec["containers"] if c["name"] == ENGINE_CONTAINER)
        engine["volumeMounts"] = [*engine.get("volumeMounts", []), *copy.deepcopy(pod.volume_mounts)]
    return template
