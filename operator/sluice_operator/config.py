"""Operator-wide settings: what no single endpoint decides (images, where Prometheus and the gateway are).

Defaults are the release images at this version and the chart's default install (release `sluice` in
namespace `sluice-system`). The chart passes its values to the operator as the SLUICE_* environment
variables in `ENV`; `sluice render` reads the same variables, so it previews what that operator applies.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

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

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorConfig:
        """Defaults, overridden by the SLUICE_* variables that are set (an empty one counts for the gateway)."""
        env = os.environ if env is None else env
        changes: dict[str, str | bool] = {}
        for field, var in ENV.items():
            value = env.get(var)
            if value is None or (value == "" and not field.startswith("gateway_")):
                continue
            value = value.strip()
            changes[field] = _flag(var, value) if field in BOOL_FIELDS else value
        return dataclasses.replace(cls(), **changes)


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
}
BOOL_FIELDS = frozenset({"endpoint_rules"})
