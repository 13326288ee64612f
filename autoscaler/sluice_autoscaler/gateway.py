"""`sluice gateway`: the pieces wired together on one event loop.

    discovery (static flags/file | Kubernetes) ──► registry (endpoints, backends, health polls)
                                                      │
    HTTP :8080  client ─► proxy (hold, route, stream) ─┤──► engine pods
                              │ held / in-flight        │
                              ▼                         │
                         demand board ──► KEDA external scaler gRPC :9090 (IsActive, StreamIsActive, ...)
                          ▲   │      └──► /metrics (sluice_gateway_pending_requests, ...)
      other replicas' ────┘   └──► peer port :9091 (this replica's own counts, long-polled by the others)
      counts (peers.py)
"""

from __future__ import annotations

import asyncio
import logging
import signal

import prometheus_client
from aiohttp import web

from .auth import ApiKeys, SharedToken
from .config import GatewayConfig
from .demand import DemandBoard
from .kube import KubeAPI, KubeDiscovery, KubePeerDiscovery, own_namespace
from .metrics import GatewayMetrics
from .peers import PeerSync, peer_app, replica_id
from .picker import EndpointPicker, ObjectiveWatch, start_picker
from .proxy import Proxy, build_app
from .quota import UsageBoard
from .registry import Registry
from .scaler import ExternalScaler, start_scaler
from .scaler_tls import ScalerTLS
from .static import StaticDiscovery

log = logging.getLogger("sluice.gateway")


class Gateway:
    def __init__(self, cfg: GatewayConfig):
        self.cfg = cfg
        self.registry = Registry(cfg)
        self.demand = DemandBoard(cfg.scaler_max_streams)
        self.metrics = GatewayMetrics(self.registry, self.demand)
        self.keys = ApiKeys(cfg.api_keys_file)
        self.scaler_token = SharedToken(cfg.scaler_token_file)
        self.peer_token = SharedToken(cfg.peer_token_file, "--peer-token-file")
        self.scaler_tls = (ScalerTLS(cfg.scaler_tls_cert, cfg.scaler_tls_key, cfg.scaler_tls_client_ca)
                           if cfg.scaler_tls_cert and cfg.scaler_tls_key else None)
        self.usage = UsageBoard()
        self.proxy = Proxy(cfg, self.registry, self.demand, self.metrics, self.keys, self.usage)
        self.replica = replica_id()
        self.peers = PeerSync(self.demand, self.replica, cfg.peer_interval, cfg.peer_timeout, cfg.connect_timeout,
                              lambda: self.registry.endpoints, self.usage, lambda: self.keys.tenants,
                              self.peer_token)
        self.discovery: StaticDiscovery | KubeDiscovery
        self.peer_discovery: KubePeerDiscovery | None = None
        self.kube_api: KubeAPI | None = None
        self.objective_watch: ObjectiveWatch | None = None
        if cfg.kubernetes:
            api = self.kube_api = KubeAPI(cfg.kube_api)
            self.discovery = KubeDiscovery(api, cfg.namespaces, self._apply)
            if cfg.peer_service:
                namespace = cfg.peer_namespace or own_namespace()
                if not namespace:
                    raise ValueError("--peer-service: pass --peer-namespace (no service account namespace here)")
                self.peer_discovery = KubePeerDiscovery(api, namespace, cfg.peer_service, self._set_peers)
        else:
            self.discovery = StaticDiscovery(cfg.backends, cfg.standby, cfg.backends_file, self._apply, cfg.adapters)
        # Ready (the /ready route, the scaler's calls): backends listed, and every peer known was asked once.
        self.ready = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._peer_runner: web.AppRunner | None = None
        self._ready_task: asyncio.Task | None = None
        self._grpc = None
        self.picker: EndpointPicker | None = None
        self._picker_grpc = None
        self.picker_port = cfg.picker_port
        self.port = cfg.port
        self.scaler_port = cfg.scaler_port
        self.peer_port = cfg.peer_port

    def _set_peers(self, urls: set[str]) -> None:
        self.peers.set_peers(urls | set(self.cfg.peers))

    def _apply(self, specs) -> None:
        if self.cfg.pool is not None:  # a pool's picker knows its endpoint only
            specs = [s for s in specs if s.key == self.cfg.pool]
        self.registry.apply(specs)
        self.demand.prune(set(self.registry.endpoints))

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.cfg.host in ("0.0.0.0", "::") else self.cfg.host
        return f"http://{host}:{self.port}"

    @property
    def peer_url(self) -> str:
        host = "127.0.0.1" if self.cfg.host in ("0.0.0.0", "::") else self.cfg.host
        return f"http://{host}:{self.peer_port}"

    async def _become_ready(self) -> None:
        if isinstance(self.discovery, KubeDiscovery):
            await self.discovery.ready.wait()
        await self.peers.synced.wait()
        self.ready.set()

    async def start(self) -> None:
        await self.registry.start()
        await self.proxy.start()
        await self.peers.start()
        # The peer port first: the other replicas may ask before this one has listed anything.
        self._peer_runner = web.AppRunner(peer_app(self.demand, self.replica, self.usage, self.peer_token), access_log=None, shutdown_timeout=1)
        await self._peer_runner.setup()
        await web.TCPSite(self._peer_runner, self.cfg.host, self.cfg.peer_port).start()
        self.peer_port = self._peer_runner.addresses[0][1]
        await self.discovery.start()
        if self.peer_discovery is not None:
            await self.peer_discovery.start()
        else:
            self._set_peers(set())
        self._ready_task = asyncio.get_running_loop().create_task(self._become_ready())
        # handler_cancellation: a client that leaves while held stops being held (and counted) at once.
        self._runner = web.AppRunner(build_app(self.proxy, self.ready), handler_cancellation=True,
                                     access_log=None, shutdown_timeout=self.cfg.shutdown_timeout)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        service = ExternalScaler(self.registry, self.demand, self.cfg.scaler_target, self.scaler_token, self.ready)
        self._grpc, self.scaler_port = await start_scaler(service, self.cfg.host, self.cfg.scaler_port,
                                                          self.scaler_tls)
        if self.cfg.endpoint_picker:
            cfg = self.cfg
            tls = (ScalerTLS(cfg.picker_tls_cert, cfg.picker_tls_key, cfg.picker_tls_client_ca, "--picker-tls")
                   if cfg.picker_tls_cert and cfg.picker_tls_key else None)
            self.picker = EndpointPicker(cfg, self.registry, self.demand, self.metrics, self.keys, self.proxy.router,
                                         self.proxy.budget, self.ready)
            self._picker_grpc, self.picker_port = await start_picker(self.picker, cfg.host, cfg.picker_port, tls)
            if self.kube_api is not None and cfg.pool:
                self.objective_watch = ObjectiveWatch(self.kube_api, cfg.pool, self.picker.objectives)
                self.objective_watch.start()
            log.info("endpoint picker (Envoy ext-proc) on %s:%d%s", cfg.host, self.picker_port,
                     f" for {cfg.pool}" if cfg.pool else "")
        log.info("gateway %s on %s/v1 (routing %s), KEDA external scaler on %s:%d, peer port %d", self.replica,
                 self.url, self.cfg.routing, self.cfg.host, self.scaler_port, self.peer_port)

    async def stop(self) -> None:
        self.registry.close()  # held requests get 503 + Retry-After now; streams in flight may finish
        if self._picker_grpc is not None:
            await self._picker_grpc.stop(grace=self.cfg.shutdown_timeout)
        if self.objective_watch is not None:
            await self.objective_watch.stop()
        if self._grpc is not None:
            await self._grpc.stop(grace=1)
        if self._runner is not None:
            await self._runner.cleanup()  # lets open streams finish, up to shutdown_timeout
        if self._ready_task is not None:
            self._ready_task.cancel()
        if self.peer_discovery is not None:
            await self.peer_discovery.stop()
        await self.peers.stop()
        if self._peer_runner is not None:
            await self._peer_runner.cleanup()
        await self.discovery.stop()
        await self.proxy.stop()
        await self.registry.stop()


async def serve(cfg: GatewayConfig) -> None:
    prometheus_client.disable_created_metrics()  # no *_created series beside every counter
    gateway = Gateway(cfg)
    await gateway.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("gateway stopping")
    await gateway.stop()


def run(cfg: GatewayConfig) -> int:
    asyncio.run(serve(cfg))
    return 0
