"""Request priorities by objective (the Gateway API Inference Extension's InferenceObjective, or an endpoint's
spec.routing.objectives): the header that names one, and how its priority reaches the engine. Pure.

GIE's convention is higher-is-more-important (below 0: sheddable); the engine's (vLLM's `priority` field) is
lower-is-sooner. Where an endpoint declares objectives, the gateway or the picker sets the field and a client's
own value is dropped: a tenant may not jump the queue by writing `priority: -1000000`."""

from __future__ import annotations

from typing import Any

OBJECTIVE_HEADER = "x-gateway-inference-objective"


def set_engine_priority(body: dict[str, Any], priority: int) -> bool:
    """Replace the request's `priority` with the objective's, in the engine's convention (0 is left out: the
    engine's default, accepted under any scheduling policy). True when the body changed."""
    changed = "priority" in body
    body.pop("priority", None)
    if priority:
        body["priority"] = -priority
        changed = True
    return changed
