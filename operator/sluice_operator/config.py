"""Operator-wide settings: what no single endpoint decides (images, where Prometheus is)."""

from __future__ import annotations

from dataclasses import dataclass

from . import __version__

ENGINE_IMAGE = f"ghcr.io/sluice-dev/sluice-engine:v{__version__}"
S3_FETCH_IMAGE = "docker.io/amazon/aws-cli:2.27.50"
PROMETHEUS_URL = "http://prometheus-operated.monitoring.svc:9090"


@dataclass(frozen=True, slots=True)
class OperatorConfig:
    engine_image: str = ENGINE_IMAGE  # used when spec.engine.image is unset
    s3_fetch_image: str = S3_FETCH_IMAGE  # init container that syncs s3:// models into the cache
    prometheus_url: str = PROMETHEUS_URL  # KEDA's Prometheus trigger queries it
    cluster_domain: str = "cluster.local"
