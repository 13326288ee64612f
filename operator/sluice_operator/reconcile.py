"""reconcile: one InferenceEndpoint -> the list of objects that serve it. Pure: no I/O, no clock.

The kopf handlers apply exactly this list (server-side apply, one field manager); `sluice render` prints it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from . import adapters
from .autoscaling import check_scaling, scaled_object, trigger_authentication
from .config import OperatorConfig
from .disaggregation import decode_parts, pool_scaled_object, prefill_name, prefill_parts
from .layout import Layout, plan_layout
from .meta import (
    ENDPOINT_LABEL,
    PREFILL,
    ROLE_LABEL,
    SERVES_LABEL,
    SERVING,
    STANDBY,
    monitoring_meta,
    object_meta,
    standby_name,
)
from .model_cache import KEDA_PAUSED_REPLICAS
from .model_source import FETCH_HF_SCRIPT, OBJECTIVES_KEY, shared_cache_manifests
from .monitoring import prometheus_rule
from .network_policy import network_policies
from .routing import routing_manifests
from .spec import InferenceEndpoint
from .workload import CONTAINER_SECURITY, POD_SECURITY, component_of, serve_args, workload

SERVICE_PORT = 80


def layout_of(ep: InferenceEndpoint) -> Layout:
    acc, par = ep.spec.accelerator, ep.spec.parallelism
    return plan_layout(par.tensor, par.pipeline, acc.gpus_per_node, cpu=acc.type == "cpu", nodes=par.nodes)


def service_url(ep: InferenceEndpoint, cfg: OperatorConfig) -> str:
    """The serving Service's OpenAI base URL."""
    return f"http://{ep.name}.{ep.namespace}.svc.{cfg.cluster_domain}/v1"


def endpoint_url(ep: InferenceEndpoint, cfg: OperatorConfig) -> str:
    """Where clients should send requests (status.url).

    An autoscaled endpoint is reached through the gateway when one is configured: it holds requests while
    replicas start (the Service has no backend at zero) and routes to the warm pool while serving pods are
    cold. Clients then name the model by its served name.
    """
    if ep.spec.scaling is not None and cfg.gateway_url:
        return cfg.gateway_url
    return service_url(ep, cfg)


def has_warm_pool(ep: InferenceEndpoint) -> bool:
    scaling = ep.spec.scaling
    return bool(scaling and scaling.warm_pool and scaling.warm_pool.replicas > 0)


def objectives(ep: InferenceEndpoint) -> str:
    """spec.slo and spec.cost as the engine's --objectives-file (every key, null when unset)."""
    slo, cost = ep.spec.slo, ep.spec.cost
    return json.dumps({"slo-ttft-ms": slo.ttft_ms if slo else None, "slo-tpot-ms": slo.tpot_ms if slo else None,
                       "gpu-hour-usd": cost.gpu_hour_usd if cost else None}, sort_keys=True)


def config_map(ep: InferenceEndpoint, name: str) -> dict[str, Any]:
    data = {"served-model-name": ep.spec.model.name, "model-uri": ep.spec.model.uri,
            OBJECTIVES_KEY: objectives(ep)}
    if ep.spec.model.scheme == "hf":
        data["fetch-hf.py"] = FETCH_HF_SCRIPT
    data.update(adapters.config_data(ep))
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": object_meta(ep, name, "config"), "data": data}


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def service(ep: InferenceEndpoint, role: str = SERVING) -> dict[str, Any]:
    """The serving pods' Service (`<name>`), or the warm pool's (`<name>-warm`).

    Each selects one role only: the gateway tells serving and standby backends apart by the Service their
    EndpointSlices belong to, and a client of `<name>` never lands on a standby pod. LWS workers (pipeline
    stages) do not answer HTTP and are left out of both.
    """
    name = {SERVING: ep.name, PREFILL: prefill_name(ep)}.get(role) or standby_name(ep)
    meta = object_meta(ep, name, component_of(role))
    meta["labels"][ROLE_LABEL] = role  # the EndpointSlice controller copies it onto the slices the gateway reads
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": "ClusterIP",
            "selector": {ENDPOINT_LABEL: ep.name, ROLE_LABEL: role, SERVES_LABEL: "true"},
            "ports": [{"name": "http", "port": SERVICE_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def pod_disruption_budget(ep: InferenceEndpoint, role: str = SERVING) -> dict[str, Any]:
    name = prefill_name(ep) if role == PREFILL else ep.name
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(ep, name, component_of(role)),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": {ENDPOINT_LABEL: ep.name, ROLE_LABEL: role}},
            # A pod still loading (not Ready) protects nothing; let drains evict it.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def service_monitor(ep: InferenceEndpoint, cfg: OperatorConfig | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": monitoring_meta(ep, cfg or OperatorConfig()),
        "spec": {
            # Both Services: a standby pod's queue is demand too (the gateway sends it requests while serving
            # replicas are cold), and the autoscaler's query sums it in.
            "selector": {"matchLabels": {ENDPOINT_LABEL: ep.name},
                         "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In",
                                               "values": [component_of(SERVING), component_of(STANDBY),
                                                          component_of(PREFILL)]}]},
            "namespaceSelector": {"matchNames": [ep.namespace]},
            # sluice_dev_endpoint (the autoscaler's query and the rules select by it) and sluice_dev_role
            # (serving or standby: the dashboards' replica counts).
            "targetLabels": [ENDPOINT_LABEL, ROLE_LABEL],
            "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s", "scrapeTimeout": "10s"}],
        },
    }


def reconcile(ep: InferenceEndpoint, cfg: OperatorConfig | None = None, *,
              awaiting_model: bool = False) -> list[dict[str, Any]]:
    """Every object the endpoint owns or shares (its shared model cache), in apply order (config before the
    pods that mount it). Not the KV Secret of a disaggregated endpoint, which the pods name: it holds a random
    key, created once by the loop (disaggregation.kv_secret).

    `awaiting_model`: the shared model cache is still downloading and nothing serves yet (cache_sync.py
    decides): the workloads are held at zero replicas and KEDA is paused, so no pod waits on a GPU and no
    Deployment runs into its progress deadline while the model downloads.

    Raises SpecError (ScalingNeedsGateway) for an endpoint this operator's settings cannot serve.
    """
    cfg = cfg or OperatorConfig()
    check_scaling(ep, cfg)
    layout = layout_of(ep)
    cm = config_map(ep, f"{ep.name}-engine")
    # Pods roll when what they read from the ConfigMap at start or their flags change; not for the objectives
    # and the adapters' lists, which the engines and the fetch sidecars re-read while they run.
    live = {OBJECTIVES_KEY, *adapters.LIVE_KEYS}
    config_hash = _hash([{k: v for k, v in cm["data"].items() if k not in live}, serve_args(ep, "")])
    scaling = ep.spec.scaling
    split = ep.spec.disaggregation  # a prefill pool beside the serving (decode) one: disaggregation.py
    decode = decode_parts(ep, split.decode, cfg) if split else None
    serving = workload(ep, layout, cfg, name=ep.name, role=SERVING,
                       replicas=0 if awaiting_model else ep.spec.fixed_replicas,
                       config_map=cm["metadata"]["name"],
                       config_hash=_hash([config_hash, decode.args]) if decode else config_hash, pool=decode)
    pool_selector = service(ep)["spec"]["selector"]  # an InferencePool's pods are its Service's (routing.py)
    # The NetworkPolicies before the workloads: the pods start behind them.
    out = [*shared_cache_manifests(ep, cfg, CONTAINER_SECURITY, POD_SECURITY), cm,
           *network_policies(ep, cfg, layout, pool_selector), serving]
    prefill = None
    if split:
        parts = prefill_parts(ep, split.prefill)
        prefill = workload(ep, layout, cfg, name=prefill_name(ep), role=PREFILL,
                           replicas=0 if awaiting_model else split.prefill.fixed_replicas,
                           config_map=cm["metadata"]["name"], config_hash=_hash([config_hash, parts.args]),
                           pool=parts)
        out.append(prefill)
    warm = has_warm_pool(ep)
    if warm:  # a fixed count, outside the ScaledObject: the pool stays filled whatever the autoscaler does
        out.append(workload(ep, layout, cfg, name=standby_name(ep), role=STANDBY,
                            replicas=0 if awaiting_model else scaling.warm_pool.replicas,
                            config_map=cm["metadata"]["name"],
                            config_hash=config_hash))
    out.append(service(ep))
    if warm:
        out.append(service(ep, STANDBY))
    if prefill is not None:
        out.append(service(ep, PREFILL))
    out.append(pod_disruption_budget(ep))
    if prefill is not None:
        out.append(pod_disruption_budget(ep, PREFILL))
    if split:  # one ScaledObject per autoscaled pool, each on its own signal
        for pool, role, target in ((split.decode, SERVING, serving), (split.prefill, PREFILL, prefill)):
            if pool.scaling is not None:
                autoscaler = pool_scaled_object(ep, cfg, target, role)
                if awaiting_model:
                    autoscaler["metadata"].setdefault("annotations", {})[KEDA_PAUSED_REPLICAS] = "0"
                out.append(autoscaler)
    if scaling:
        if cfg.gateway_scaler_address and cfg.gateway_scaler_tls_secret:  # before the ScaledObject naming it
            out.append(trigger_authentication(ep, cfg))
        autoscaler = scaled_object(ep, cfg, serving)
        if awaiting_model:
            autoscaler["metadata"].setdefault("annotations", {})[KEDA_PAUSED_REPLICAS] = "0"
        out.append(autoscaler)
    out += routing_manifests(ep, cfg, pool_selector)
    out.append(service_monitor(ep, cfg))
    if cfg.endpoint_rules:
        out.append(prometheus_rule(ep, cfg))
    # A JSON round trip: plain data with no shared sub-objects, so callers may mutate one manifest freely.
    return json.loads(json.dumps(out))
