"""The endpoint's NetworkPolicies: who may open a connection to its engine pods, port by port.

The pod network is not a trust boundary: without a policy any pod of the cluster reaches an engine's API
(around the gateway's API keys), a decode engine's KV receiver (and writes blocks into its cache) and a
multi-node group's rendezvous. NetworkPolicies are a union: a pod selected by several admits what any of them
admits, so each one here admits only what its pods need, and nothing broader may select the same pods (the
chart renders no namespace-wide engine policy any more). Ingress only; with `cfg.network_policy` off, or the
endpoint named in `cfg.network_policy_except`, there are none (the chart's opt-out).

- `<name>`, every pod of the endpoint: the API port (`http`, which also serves /metrics) from the gateway,
  the operator (GET /v1/models) and Prometheus (the chart's peers, config.py), plus the chart's extra rules;
  for a disaggregated endpoint, the KV port (`kv`, declared by the decode pods only) from its prefill pods.
- `<name>-prefill` (disaggregated): the prefill pods' API port from the endpoint's decode pods, which send each
  prompt there first (the prefill hop).
- `<workload>-group-<i>` (a replica spread over pods, a LeaderWorkerSet): every port of group i's pods from
  group i's pods only. The rendezvous is TCP 29500 on the leader, but gloo and NCCL then connect on ports each
  rank picks, in both directions, so the ports are left open within the group. NetworkPolicy cannot say "the
  same group as me", so there is one policy per group index LWS may create: the most replicas (maxReplicas when
  autoscaled) plus the rollout's surge. LWS labels each group's pods with the LeaderWorkerSet's name and the
  group's index (leaderworkerset.sigs.k8s.io/name, /group-index).
"""

from __future__ import annotations

import math
from typing import Any

from .config import OperatorConfig
from .disaggregation import prefill_name
from .layout import Layout
from .meta import ENDPOINT_LABEL, PREFILL, ROLE_LABEL, SERVING, object_meta, standby_name
from .routing import picker_labels, picker_name, pool_of
from .spec import InferenceEndpoint

API_VERSION = "networking.k8s.io/v1"
COMPONENT = "network"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace


def _port(name: str) -> list[dict[str, str]]:
    return [{"port": name, "protocol": "TCP"}]


def _policy(ep: InferenceEndpoint, name: str, selector: dict[str, str], ingress: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "NetworkPolicy", "metadata": object_meta(ep, name, COMPONENT),
            "spec": {"podSelector": {"matchLabels": selector}, "policyTypes": ["Ingress"], "ingress": ingress}}


def group_count(replicas: int, max_surge: int | str) -> int:
    """The group indices a LeaderWorkerSet of `replicas` may use: its count plus a rollout's surge (a count, or a
    percentage of the count rounded up)."""
    if isinstance(max_surge, str):
        surge = math.ceil(replicas * int(max_surge.rstrip("%")) / 100)
    else:
        surge = max_surge
    return replicas + surge


def lws_groups(ep: InferenceEndpoint) -> list[tuple[str, int]]:
    """(LeaderWorkerSet name, the most groups it may have) of each multi-node workload of the endpoint."""
    spec = ep.spec
    serving = spec.scaling.max_replicas if spec.scaling is not None else (spec.fixed_replicas or 1)
    out = [(ep.name, serving)]
    if spec.scaling is not None and spec.scaling.warm_pool is not None and spec.scaling.warm_pool.replicas > 0:
        out.append((standby_name(ep), spec.scaling.warm_pool.replicas))
    return [(name, group_count(n, spec.rollout.max_surge)) for name, n in out]


def routing_policies(ep: InferenceEndpoint, cfg: OperatorConfig, pool_selector: dict[str, str]) -> list[dict[str, Any]]:
    """The pool's pods and the picker's, as the gateway's data plane reaches them (spec.routing.inferencePool)."""
    routing = pool_of(ep)
    if routing is None:
        return []
    gateways = [{"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: ns}}}
                for ns in routing.admitted_namespaces(ep.namespace)]
    picker = {"podSelector": {"matchLabels": picker_labels(ep)}}
    out = [_policy(ep, f"{ep.name}-inference-pool", pool_selector,
                   [{"from": [*gateways, picker], "ports": _port("http")}])]
    ingress = [{"from": gateways, "ports": _port("grpc")}]
    if cfg.network_policy_prometheus:
        ingress.append({"from": list(cfg.network_policy_prometheus), "ports": _port("http")})
    out.append(_policy(ep, picker_name(ep), picker_labels(ep), ingress))
    return out


def network_policies(ep: InferenceEndpoint, cfg: OperatorConfig, layout: Layout,
                     pool_selector: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """`pool_selector`: the endpoint's Service's selector (the InferencePool's), with spec.routing only."""
    if not cfg.network_policy or ep.name in cfg.network_policy_except:
        return []
    api_peers = [*cfg.network_policy_gateway, *cfg.network_policy_operator, *cfg.network_policy_prometheus]
    # NOTE: never a rule with an empty `from`: Kubernetes reads it as "from anywhere".
    ingress = [{"from": api_peers, "ports": _port("http")}] if api_peers else []
    ingress += [dict(rule) for rule in cfg.network_policy_extra_ingress]
    split = ep.spec.disaggregation is not None
    if split:
        ingress.append({"from": [{"podSelector": {"matchLabels": {ENDPOINT_LABEL: ep.name, ROLE_LABEL: PREFILL}}}],
                        "ports": _port("kv")})
    out = [_policy(ep, ep.name, {ENDPOINT_LABEL: ep.name}, ingress)]
    if split:
        decode = {"podSelector": {"matchLabels": {ENDPOINT_LABEL: ep.name, ROLE_LABEL: SERVING}}}
        out.append(_policy(ep, prefill_name(ep), {ENDPOINT_LABEL: ep.name, ROLE_LABEL: PREFILL},
                           [{"from": [decode], "ports": _port("http")}]))
    if layout.multi_node:
        for workload, groups in lws_groups(ep):
            for i in range(groups):
                group = {ENDPOINT_LABEL: ep.name, LWS_NAME_LABEL: workload, LWS_GROUP_INDEX_LABEL: str(i)}
                out.append(_policy(ep, f"{workload}-group-{i}", group, [{"from": [{"podSelector": {"matchLabels": group}}]}]))
    if pool_selector is not None:
        out += routing_policies(ep, cfg, pool_selector)
    return out
