"""The KEDA ScaledObject that scales the serving workload: queue depth per replica, and the gateway's demand.

Two triggers, one ScaledObject (KEDA is the only scaler; no second HPA), one target: the endpoint's
`scaling.targetQueueDepth`, waiting requests per replica.
- `prometheus` (1 <-> N): requests waiting in the engines plus requests the gateway holds for the endpoint,
  per replica. The engines' own queue vanishes at zero replicas; the gateway's count does not.
- `external-push` (0 -> N at once): the gateway's KEDA external scaler pushes IsActive the moment it holds a
  request for an endpoint with no ready serving replica, and reports the requests it holds (`metric: queue`)
  against the same target. Left out when no gateway is configured.

A metric that cannot be read is an error, never a 0: the query has no `or vector(0)` and `ignoreNullValues`
is false, so KEDA counts a failure and, after `failureThreshold` of them, holds the fallback replicas
(`scaling.onMetricsOutage`). The endpoint's PrometheusRule alerts on the same absence (monitoring.py).
"""

from __future__ import annotations

from typing import Any

from sluice_contract import (
    ENGINE_REQUESTS_WAITING_METRIC,
    GATEWAY_BACKENDS_METRIC,
    GATEWAY_PENDING_METRIC,
    TRIGGER_ENDPOINT,
    TRIGGER_MODEL,
)
from sluice_contract import endpoint_key as contract_endpoint_key

from .config import OperatorConfig
from .meta import object_meta
from .spec import InferenceEndpoint, Scaling, SpecError

# The KEDA releases whose ScaledObject this renders. 2.17 is the first with `fallback.behavior`; 2.11 the
# first that takes an external scaler's TLS client certificate from a TriggerAuthentication (caCert,
# tlsClientCert, tlsClientKey). Tests validate against the CRDs of KEDA_TESTED (../shared/reference-crds).
KEDA_MIN_VERSION = (2, 17)
KEDA_TESTED_VERSION = (2, 20)
KEDA_SUPPORTED = (f"KEDA >= {'.'.join(map(str, KEDA_MIN_VERSION))} (tested with "
                  f"{'.'.join(map(str, KEDA_TESTED_VERSION))})")

POLLING_INTERVAL_S = 15
FAILURE_THRESHOLD = 3  # failed reads of a trigger before KEDA holds the fallback replicas
QUEUE_METRIC = ENGINE_REQUESTS_WAITING_METRIC  # the engines' queue, the unit of targetQueueDepth
# The ServiceMonitor copies the Service's sluice.dev/endpoint label onto every series under this name.
ENDPOINT_METRIC_LABEL = "sluice_dev_endpoint"
# The external scaler's metadata: which of the gateway's counts to report ("queue": the requests it holds,
# the unit of targetQueueDepth), and the TLS parameters KEDA reads from the TriggerAuthentication.
GATEWAY_METRIC = "queue"
TLS_PARAMETERS = (("caCert", "ca.crt"), ("tlsClientCert", "tls.crt"), ("tlsClientKey", "tls.key"))


class ScalingNeedsGateway(SpecError):
    """An endpoint this operator cannot scale as written: it asks for scale to zero and no gateway is set."""

    reason = "ScaleToZeroNeedsGateway"


def endpoint_key(ep: InferenceEndpoint) -> str:
    """How the gateway names an endpoint: in its metrics, and in the external scaler's metadata."""
    return contract_endpoint_key(ep.namespace, ep.name)


def check_scaling(ep: InferenceEndpoint, cfg: OperatorConfig) -> None:
    """Refuse what KEDA could never wake: at zero replicas no engine reports a queue, so only the gateway's
    external scaler sees a request arrive."""
    scaling = ep.spec.scaling
    if scaling is not None and scaling.min_replicas == 0 and not cfg.gateway_scaler_address:
        raise ScalingNeedsGateway(
            f"InferenceEndpoint {ep.name!r}: scaling.minReplicas is 0, but this operator has no gateway "
            "(SLUICE_GATEWAY_SCALER_ADDRESS is empty; chart: gateway.enabled=false), and without one nothing "
            "sees a request at zero replicas, so the endpoint would never scale up again. Set "
            "scaling.minReplicas to 1 or more, or install the gateway.")


def engines_waiting(ep: InferenceEndpoint) -> str:
    """Requests waiting in the endpoint's pods (warm pool included: its queue is demand too)."""
    return f'sum({QUEUE_METRIC}{{namespace="{ep.namespace}",{ENDPOINT_METRIC_LABEL}="{ep.name}"}})'


def queue_query(ep: InferenceEndpoint, gateway: bool = True) -> str:
    """The endpoint's queue: empty (an error for KEDA, and the absent-metric alert) when a series it needs is
    not scraped.

    With a gateway: the requests it holds plus the engines' queue. The gateway reports every endpoint it
    serves, held requests or not, so its side is missing only when the gateway is not scraped. The engines'
    side may legitimately be missing while the gateway sees no ready backend (scaled to zero, or still
    loading): then, and only then, it counts as 0. Without a gateway: the engines' queue alone (minReplicas
    is then at least 1, see check_scaling)."""
    if not gateway:
        return engines_waiting(ep)
    held = f'sum({GATEWAY_PENDING_METRIC}{{endpoint="{endpoint_key(ep)}"}})'
    no_ready = f'(sum({GATEWAY_BACKENDS_METRIC}{{endpoint="{endpoint_key(ep)}",state="ready"}}) == 0)'
    return f"{held} + ({engines_waiting(ep)} or on() {no_ready})"


def trigger_authentication_name(ep: InferenceEndpoint) -> str:
    return f"{ep.name}-gateway-scaler"


def trigger_authentication(ep: InferenceEndpoint, cfg: OperatorConfig) -> dict[str, Any]:
    """KEDA's client certificate for the gateway's scaler, from the Secret the operator is told about.

    NOTE: KEDA hands an external scaler nothing from a TriggerAuthentication but these TLS parameters (its
    external_scaler.go reads caCert, tlsClientCert and tlsClientKey from the auth params and forwards only
    the trigger's metadata as ScaledObjectRef.scalerMetadata). A shared token in a Secret can therefore not
    reach the scaler; a client certificate can, and the gateway requires one (--scaler-tls-client-ca)."""
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "TriggerAuthentication",
        "metadata": object_meta(ep, trigger_authentication_name(ep), "autoscaler"),
        "spec": {"secretTargetRef": [{"parameter": parameter, "name": cfg.gateway_scaler_tls_secret, "key": key}
                                     for parameter, key in TLS_PARAMETERS]},
    }


def triggers(ep: InferenceEndpoint, cfg: OperatorConfig, scaling: Scaling) -> list[dict[str, Any]]:
    target = str(scaling.target_queue_depth)
    gateway = bool(cfg.gateway_scaler_address)
    out: list[dict[str, Any]] = [{
        "type": "prometheus",
        "name": "queue-depth",
        "metricType": "AverageValue",  # the HPA divides by the replica count: depth per replica
        "metadata": {
            "serverAddress": cfg.prometheus_url,
            "query": queue_query(ep, gateway),
            "threshold": target,
            "activationThreshold": "0",
            # An empty result is an error, so KEDA's fallback applies; "true" (KEDA's default) would read a
            # Prometheus that scrapes nothing as an empty queue, and autoscaling would be silently dead.
            "ignoreNullValues": "false",
        },
    }]
    if gateway:
        trigger: dict[str, Any] = {
            "type": "external-push",
            "name": "gateway",
            "metricType": "AverageValue",
            # KEDA hands these to the gateway's scaler as ScaledObjectRef.scalerMetadata: the requests the
            # gateway holds for the endpoint, against the endpoint's own target (not --scaler-target).
            "metadata": {
                "scalerAddress": cfg.gateway_scaler_address,
                TRIGGER_ENDPOINT: endpoint_key(ep),
                TRIGGER_MODEL: ep.spec.model.name,
                "metric": GATEWAY_METRIC,
                "targetValue": target,
            },
        }
        if cfg.gateway_scaler_tls_secret:
            trigger["authenticationRef"] = {"name": trigger_authentication_name(ep)}
        out.append(trigger)
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


def scaled_object_of(ep: InferenceEndpoint, name: str, target: dict[str, Any], scaling: Any, outage: int,
                     trigger_list: list[dict[str, Any]]) -> dict[str, Any]:
    """A ScaledObject `name` scaling `target` within scaling's min/max replicas (`scaling`: a Scaling or a
    disaggregated pool's scaling), holding `outage` replicas when its triggers cannot be read."""
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": object_meta(ep, name, "autoscaler"),
        "spec": {
            "scaleTargetRef": {"apiVersion": target["apiVersion"], "kind": target["kind"],
                               "name": target["metadata"]["name"]},
            "minReplicaCount": scaling.min_replicas,
            "maxReplicaCount": scaling.max_replicas,
            "pollingInterval": POLLING_INTERVAL_S,
            "cooldownPeriod": scaling.scale_down_delay_seconds,  # idle time before scaling to zero
            "initialCooldownPeriod": ep.spec.startup_grace_seconds,  # no scale-to-zero while first loading
            # behavior needs KEDA >= 2.17 (KEDA_MIN_VERSION): never scale in below the current count on an outage.
            "fallback": {"failureThreshold": FAILURE_THRESHOLD, "replicas": outage,
                         "behavior": "currentReplicasIfHigher"},
            "advanced": {"horizontalPodAutoscalerConfig": {"name": name, "behavior": hpa_behavior(scaling)}},
            "triggers": trigger_list,
        },
    }


def scaled_object(ep: InferenceEndpoint, cfg: OperatorConfig, target: dict[str, Any]) -> dict[str, Any]:
    scaling = ep.spec.scaling
    assert scaling is not None
    outage = scaling.on_metrics_outage.replicas if scaling.on_metrics_outage else max(scaling.min_replicas, 1)
    return scaled_object_of(ep, ep.name, target, scaling, outage, triggers(ep, cfg, scaling))
