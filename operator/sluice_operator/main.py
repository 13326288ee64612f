"""`sluice operator`: run the kopf loop, cluster-wide or over named namespaces, optionally as one of
several replicas that elect a leader (leader.py): only the leader runs kopf at all, so kopf's own
bookkeeping on the endpoints is written by one process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from urllib.parse import urlparse

import kopf
from aiohttp import web

from .config import OperatorConfig
from .handlers import LoginFn, Loop, build_registry, default_login, operator_settings
from .leader import LeaseElector

log = logging.getLogger("sluice.operator")
LEASE_NAME = "sluice-operator"


def run(namespaces: list[str], resync_seconds: float = 60.0, liveness: str | None = None,
        cfg: OperatorConfig | None = None, *, leader_election: bool = False, lease_namespace: str | None = None,
        metrics_port: int | None = None) -> int:
    """Blocks until SIGINT/SIGTERM (0), or until leadership is lost (1: the pod restarts as a candidate).
    No namespaces: every namespace (cluster-wide RBAC needed).

    Settings not given come from the SLUICE_* environment variables (config.ENV; the chart sets them)."""
    loop = Loop(cfg or OperatorConfig.from_env())
    registry = build_registry(loop, namespaces=namespaces, resync_seconds=resync_seconds)
    if metrics_port is not None:
        loop.metrics.serve(metrics_port)
    elector = None
    if leader_election:
        # The pod's namespace (the chart sets POD_NAMESPACE), and the pod's name as its identity.
        namespace = lease_namespace or os.environ.get("POD_NAMESPACE") or "default"
        identity = os.environ.get("POD_NAME") or socket.gethostname()
        elector = LeaseElector(loop.api, namespace, LEASE_NAME, identity)
    return asyncio.run(serve(loop, registry, namespaces, liveness=liveness, elector=elector))


async def serve(loop: Loop, registry: kopf.OperatorRegistry, namespaces: list[str], *, liveness: str | None = None,
                elector: LeaseElector | None = None, login: LoginFn = default_login,
                stop: asyncio.Event | None = None, ready: asyncio.Event | None = None) -> int:
    """Wait for leadership (when electing), then run kopf until `stop` is set, a signal arrives, or the
    lead is lost. Returns the exit code."""
    stop = stop or asyncio.Event()
    if elector is not None:
        if loop.credentials is None:
            # kopf's login handlers take its settings (keyword-only): kopf passes them when it logs in itself.
            info = login(logger=log, settings=operator_settings())
            loop.credentials = (await info) if asyncio.iscoroutine(info) else info
        # A candidate is alive while it waits: its liveness probe must pass, or Kubernetes would keep
        # restarting every standby replica.
        async with _liveness_while_waiting(liveness):
            acquiring = asyncio.create_task(elector.acquire())
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait({acquiring, stopping}, return_when=asyncio.FIRST_COMPLETED)
            for t in (acquiring, stopping):
                t.cancel()
            if not elector.is_leader:
                return 0  # stopped while waiting
    loop.metrics.leader.set(1)
    holding = asyncio.create_task(_hold(elector, stop)) if elector is not None else None
    try:
        await kopf.operator(registry=registry, settings=operator_settings(), standalone=True,
                            clusterwide=not namespaces, namespaces=namespaces, liveness_endpoint=liveness,
                            stop_flag=stop, ready_flag=ready)
    finally:
        loop.metrics.leader.set(0)
        if holding is not None:
            holding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await holding
    if elector is None:
        return 0
    if not elector.is_leader:
        return 1
    await elector.release()
    return 0


async def _hold(elector: LeaseElector, stop: asyncio.Event) -> None:
    await elector.hold()  # returns when the lead is lost
    stop.set()


@contextlib.asynccontextmanager
async def _liveness_while_waiting(url: str | None):
    if url is None:
        yield
        return
    parsed = urlparse(url)
    app = web.Application()
    app.router.add_get(parsed.path or "/", lambda _: web.json_response({"status": "standby"}))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, parsed.hostname, parsed.port)
    await site.start()
    try:
        yield
    finally:
        await runner.cleanup()  # kopf serves the same URL from here on
