"""Operator-wide settings: what no single endpoint decides (images, where Prometheus and the gateway are).

Defaults are the release images at this version and the chart's default install (release `sluice` in
namespace `sluice-system`), with a policy that allows any image and Secret but hostPaths only under
HOST_PATH_PREFIXES (policy.py), and NetworkPolicies that admit that install's gateway and operator and the
Prometheus operator's pods (network_policy.py). The chart passes its values to the operator as the SLUICE_*
environment variables in `ENV`; `sluice render` reads the same variables, so it previews what that operator
applies.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import __version__

IMAGE_REGISTRY = "ghcr.io/sluice-dev"
RELEASE_TAG = f"v{__version__}"  # the chart's default image tag: "v" + its appVersion (the same version)
ENGINE_IMAGE = f"{IMAGE_REGISTRY}/sluice-engine:{RELEASE_TAG}"  # engine_image/Dockerfile
S3_FETCH_IMAGE = "docker.io/amazon/aws-cli:2.27.50"
PROMETHEUS_URL = "http://prometheus-operated.monitoring.svc:9090"
# The gateway (`sluice gateway`, chart: Deployment and Service `<release>-gateway` in the operator's namespace).
GATEWAY_HOST = "sluice-gateway.sluice-system.svc"
GATEWAY_HTTP_PORT = 8080  # the OpenAI proxy and /metrics
GATEWAY_SCALER_PORT = 9090  # KEDA's external scaler (gRPC)
# Where hostPath model caches and volumes may be by default (policy.py). A root init container hands a hostPath
# cache directory to the engine's user: without a limit an endpoint could make /etc the engine's.
HOST_PATH_PREFIXES = ("/var/lib/sluice", "/mnt/sluice")
# Who the per-endpoint NetworkPolicies (network_policy.py) admit to the engines' API port: the pods of the
# chart's default install (release `sluice` in `sluice-system`) and the Prometheus operator's in `monitoring`.
RELEASE_NAMESPACE = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "sluice-system"}}}
GATEWAY_PEERS = ({**RELEASE_NAMESPACE, "podSelector": {"matchLabels": {
    "app.kubernetes.io/name": "sluice", "app.kubernetes.io/instance": "sluice",
    "app.kubernetes.io/component": "gateway"}}},)
OPERATOR_PEERS = ({**RELEASE_NAMESPACE, "podSelector": {"matchLabels": {
    "app.kubernetes.io/name": "sluice", "app.kubernetes.io/instance": "sluice",
    "app.kubernetes.io/component": "operator"}}},)
PROMETHEUS_PEERS = ({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                     "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}},)


@dataclass(frozen=True, slots=True)
class OperatorConfig:
    engine_image: str = ENGINE_IMAGE  # used when spec.engine.image is unset
    s3_fetch_image: str = S3_FETCH_IMAGE  # init container that syncs s3:// models into the cache
    prometheus_url: str = PROMETHEUS_URL  # KEDA's Prometheus trigger queries it
    cluster_domain: str = "cluster.local"
    # KEDA's external-push trigger connects here; "" leaves that trigger out (no gateway installed).
    gateway_scaler_address: str = f"{GATEWAY_HOST}:{GATEWAY_SCALER_PORT}"
    # Where clients reach autoscaled endpoints (status.url): the gateway holds requests while replicas start.
    # "" reports the endpoint's own Service instead.
    gateway_url: str = f"http://{GATEWAY_HOST}:{GATEWAY_HTTP_PORT}/v1"
    # A PrometheusRule per endpoint (monitoring.py). Off where the chart's generic rules replace them: both
    # would record the same series.
    endpoint_rules: bool = True
    # Extra labels and annotations on the ServiceMonitor and PrometheusRule of every endpoint: a Prometheus
    # picks these objects by label (kube-prometheus-stack: `release: <its release>`), so without the label it
    # wants nothing is scraped and no rule is loaded.
    monitoring_labels: dict[str, str] = field(default_factory=dict)
    monitoring_annotations: dict[str, str] = field(default_factory=dict)
    # A Secret (kubernetes.io/tls, with ca.crt) that must exist in each autoscaled endpoint's namespace: KEDA's
    # client certificate for the gateway's scaler. Set: every ScaledObject's external-push trigger authenticates
    # through a TriggerAuthentication that reads it. "": no TriggerAuthentication (plaintext gRPC).
    gateway_scaler_tls_secret: str = ""

    def __post_init__(self) -> None:
        for var, labels in (("SLUICE_MONITORING_LABELS", self.monitoring_labels),
                            ("SLUICE_MONITORING_ANNOTATIONS", self.monitoring_annotations)):
            for key, value in labels.items():
                if not isinstance(key, str) or not QUALIFIED_NAME.fullmatch(key):
                    raise ValueError(f"{var}: {key!r} is not a valid label or annotation key")
                if labels is self.monitoring_labels and key.startswith(RESERVED_PREFIXES):
                    raise ValueError(f"{var}: {key!r} is set by the operator itself; pick another key")
                if not isinstance(value, str):
                    raise ValueError(f"{var}: the value of {key!r} must be a string, got {value!r}")
                if labels is self.monitoring_labels and not LABEL_VALUE.fullmatch(value):
                    raise ValueError(f"{var}: {value!r} (of {key!r}) is not a valid label value: at most 63 "
                                     "letters, digits, '-', '_' or '.', starting and ending with a letter or digit")
    # Multi-tenancy policy (policy.py): what an endpoint's author may make the operator run. Empty lists
    # allow anything; the operator's own images (above) are always allowed.
    allowed_image_prefixes: tuple[str, ...] = ()  # spec.engine.image must start with one of these
    host_path_allowed: bool = True  # hostPath volumes (model cache, pod.volumes) at all
    host_path_prefixes: tuple[str, ...] = HOST_PATH_PREFIXES  # ... and only at or under these (empty: anywhere)
    pod_secret_refs_allowed: bool = True  # pod.env secretKeyRef and secret volumes at all
    allowed_secrets: tuple[str, ...] = ()  # every Secret an endpoint names must be one of these
    # A NetworkPolicy per endpoint (network_policy.py): its engines' API port admits only these peers
    # (NetworkPolicyPeers) and the extra rules; the KV and rendezvous ports only the endpoint's own pods.
    network_policy: bool = True
    network_policy_gateway: tuple[dict, ...] = GATEWAY_PEERS  # the gateway's pods; empty: no gateway
    network_policy_operator: tuple[dict, ...] = OPERATOR_PEERS  # the operator's (GET /v1/models)
    network_policy_prometheus: tuple[dict, ...] = PROMETHEUS_PEERS  # scrapes /metrics on the API port
    network_policy_extra_ingress: tuple[dict, ...] = ()  # NetworkPolicyIngressRules added as they are
    network_policy_except: tuple[str, ...] = ()  # endpoint names that get no NetworkPolicy (opt-out)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorConfig:
        """Defaults, overridden by the SLUICE_* variables that are set (an empty one counts for the gateway)."""
        env = os.environ if env is None else env
        changes: dict[str, str | bool | dict[str, str] | tuple[Any, ...]] = {}
        for name, var in ENV.items():
            value = env.get(var)
            if value is None or (value == "" and not name.startswith("gateway_")):
                continue
            value = value.strip()
            if name in BOOL_FIELDS:
                changes[name] = _flag(var, value)
            elif name in MAP_FIELDS:
                changes[name] = _string_map(var, value)
            elif name in JSON_LIST_FIELDS:
                changes[name] = _object_list(var, value)
            elif name in LIST_FIELDS:
                changes[name] = tuple(item.strip() for item in value.split(",") if item.strip())
            else:
                changes[name] = value
        return dataclasses.replace(cls(), **changes)


def _string_map(var: str, value: str) -> dict[str, str]:
    """A JSON object of strings (the chart writes `toJson` of a values map); "" is an empty one."""
    if not value:
        return {}
    try:
        doc = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{var} must be a JSON object of strings, e.g. {{\"release\": \"kps\"}}: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{var} must be a JSON object of strings, got {type(doc).__name__}")
    return doc


def _object_list(var: str, value: str) -> tuple[dict[str, Any], ...]:
    """A JSON list of objects (the chart writes `toJson` of a values list); "" is an empty one."""
    if not value:
        return ()
    try:
        doc = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{var} must be a JSON list of objects: {e}") from None
    if not isinstance(doc, list) or not all(isinstance(item, dict) for item in doc):
        raise ValueError(f"{var} must be a JSON list of objects, got {value[:80]!r}")
    return tuple(doc)


def _flag(var: str, value: str) -> bool:
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise ValueError(f"{var} must be true or false, got {value!r}")


# OperatorConfig field -> the environment variable that sets it.
ENV = {
    "engine_image": "SLUICE_ENGINE_IMAGE",
    "s3_fetch_image": "SLUICE_S3_FETCH_IMAGE",
    "prometheus_url": "SLUICE_PROMETHEUS_URL",
    "cluster_domain": "SLUICE_CLUSTER_DOMAIN",
    "gateway_scaler_address": "SLUICE_GATEWAY_SCALER_ADDRESS",
    "gateway_url": "SLUICE_GATEWAY_URL",
    "endpoint_rules": "SLUICE_ENDPOINT_RULES",
    "monitoring_labels": "SLUICE_MONITORING_LABELS",
    "monitoring_annotations": "SLUICE_MONITORING_ANNOTATIONS",
    "gateway_scaler_tls_secret": "SLUICE_GATEWAY_SCALER_TLS_SECRET",
    "allowed_image_prefixes": "SLUICE_ALLOWED_IMAGE_PREFIXES",
    "host_path_allowed": "SLUICE_HOST_PATH_ALLOWED",
    "host_path_prefixes": "SLUICE_HOST_PATH_PREFIXES",
    "pod_secret_refs_allowed": "SLUICE_POD_SECRET_REFS_ALLOWED",
    "allowed_secrets": "SLUICE_ALLOWED_SECRETS",
    "network_policy": "SLUICE_NETWORK_POLICY",
    "network_policy_gateway": "SLUICE_NETWORK_POLICY_GATEWAY",
    "network_policy_operator": "SLUICE_NETWORK_POLICY_OPERATOR",
    "network_policy_prometheus": "SLUICE_NETWORK_POLICY_PROMETHEUS",
    "network_policy_extra_ingress": "SLUICE_NETWORK_POLICY_EXTRA_INGRESS",
    "network_policy_except": "SLUICE_NETWORK_POLICY_EXCEPT",
}
BOOL_FIELDS = frozenset({"endpoint_rules", "host_path_allowed", "pod_secret_refs_allowed", "network_policy"})
MAP_FIELDS = frozenset({"monitoring_labels", "monitoring_annotations"})
LIST_FIELDS = frozenset({"allowed_image_prefixes", "host_path_prefixes", "allowed_secrets",
                         "network_policy_except"})  # comma-separated
JSON_LIST_FIELDS = frozenset({"network_policy_gateway", "network_policy_operator", "network_policy_prometheus",
                              "network_policy_extra_ingress"})
# Kubernetes' syntax: an optional DNS-subdomain prefix and "/", then a name of at most 63 characters.
QUALIFIED_NAME = re.compile(r"([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
# The operator's own labels (meta.labels): an extra label must not change what selects or owns an object.
RESERVED_PREFIXES = ("app.kubernetes.io/", "sluice.dev/")
