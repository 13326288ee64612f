"""`sluice operator`: run the kopf loop, cluster-wide or over named namespaces."""

from __future__ import annotations

import kopf

from .config import OperatorConfig
from .handlers import Loop, build_registry, operator_settings


def run(namespaces: list[str], resync_seconds: float = 60.0, liveness: str | None = None,
        cfg: OperatorConfig | None = None) -> int:
    """Blocks until SIGINT/SIGTERM. No namespaces: every namespace (cluster-wide RBAC needed).

    Settings not given come from the SLUICE_* environment variables (config.ENV; the chart sets them)."""
    registry = build_registry(Loop(cfg or OperatorConfig.from_env()), namespaces=namespaces,
                              resync_seconds=resync_seconds)
    # standalone: one replica, no peering objects; run the Deployment with replicas 1 (Recreate).
    kopf.run(registry=registry, settings=operator_settings(), standalone=True,
             clusterwide=not namespaces, namespaces=namespaces, liveness_endpoint=liveness)
    return 0
