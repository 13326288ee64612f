"""KEDA's external scaler (gRPC, externalscaler.proto), served from the gateway's demand board.

The operator's ScaledObject carries an `external-push` trigger whose metadata names the endpoint:

    - type: external-push
      metadata: {scalerAddress: sluice-gateway.<ns>:9090, endpoint: <namespace>/<name>, model: <servedName>}

- IsActive: the endpoint has held or in-flight requests. KEDA polls it; false (after the cooldown) lets
  KEDA scale the serving workload to zero.
- StreamIsActive: the same, pushed: the current state on connect, then on every flip and whenever a hold
  begins. A request arriving at zero replicas reaches KEDA in milliseconds, not a polling interval.
- GetMetricSpec / GetMetrics: the trigger metadata `metric` picks the count: `demand` (the default) =
  held + in-flight requests, `queue` = held requests only (waiting, the unit of an endpoint's
  targetQueueDepth, which the operator renders). Its target per replica is the trigger's `targetValue`,
  else --scaler-target; the HPA scales on it. Counts are summed over every gateway replica (demand.py,
  peers.py): KEDA reaches one of them only.

Hardening (it listens inside the cluster; the chart's NetworkPolicy lets only KEDA reach it):
- Only endpoints discovery listed have demand. A ref naming another endpoint is inactive with demand 0 and
  creates nothing; before discovery has listed the endpoints once, calls fail UNAVAILABLE (KEDA then keeps
  the replicas it has instead of acting on a 0 the gateway does not know yet).
- StreamIsActive subscriptions are bounded (--scaler-max-streams; more: RESOURCE_EXHAUSTED), and so are
  concurrent calls.
- Client certificates (--scaler-tls-cert/-key/-client-ca, scaler_tls.py): what KEDA presents from a
  TriggerAuthentication (caCert, tlsClientCert, tlsClientKey); the operator renders that one.
- With --scaler-token-file every call must carry the token: the trigger metadata `scalerToken` (KEDA passes
  the trigger's metadata along, so it is as readable as the ScaledObject) or gRPC metadata
  `authorization: Bearer <token>` (KEDA sends none: for other clients); else UNAUTHENTICATED. KEDA passes no
  TriggerAuthentication parameter to an external scaler except the TLS ones above, so a token from a Secret
  cannot reach this scaler through KEDA.
"""

from __future__ import annotations

import asyncio
import logging
import math

import grpc

from sluice_contract import SCALER_METRIC_NAME

from . import externalscaler_pb2 as pb
from . import externalscaler_pb2_grpc as pb_grpc
from .auth import SharedToken, bearer
from .demand import DemandBoard
from .registry import Registry
from .scaler_tls import ScalerTLS, add_port

log = logging.getLogger("sluice.gateway")
METRIC_NAME = SCALER_METRIC_NAME
QUEUE_METRIC_NAME = "sluice-gateway-queue"
# trigger metadata `metric` -> (metric name, the count it reports from (held, in-flight))
METRICS = {
    "demand": (METRIC_NAME, lambda held, inflight: held + inflight),
    "queue": (QUEUE_METRIC_NAME, lambda held, inflight: held),
}
TOKEN_METADATA = "scalerToken"
EXTRA_CALLS = 64  # concurrent unary calls beyond the stream bound


class ExternalScaler(pb_grpc.ExternalScalerServicer):
    def __init__(self, registry: Registry, demand: DemandBoard, default_target: float,
                 token: SharedToken | None = None, ready: asyncio.Event | None = None):
        self.registry, self.demand, self.default_target = registry, demand, default_target
        self.token = token or SharedToken(None)
        self.ready = ready

    async def _admit(self, ref: pb.ScaledObjectRef, context) -> str:
        """The endpoint key this call is about. Aborts the call when its token is missing or wrong, or when
        discovery has not listed the endpoints yet."""
        if self.token.enabled:
            candidates = [ref.scalerMetadata.get(TOKEN_METADATA, "")]
            for k, v in context.invocation_metadata() or ():
                if k == "authorization" and isinstance(v, str):
                    candidates.append(bearer(v) or "")
            if not self.token.accepts([c for c in candidates if c]):
                log.warning("external scaler: refused a call for ScaledObject %s/%s without a valid token",
                            ref.namespace, ref.name)
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "this scaler requires its token: set the "
                                    f"trigger metadata {TOKEN_METADATA!r}")
        if self.ready is not None and not self.ready.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the gateway has not listed its endpoints yet")
        meta = ref.scalerMetadata
        return self.registry.resolve_key(meta.get("endpoint"), meta.get("model"), f"{ref.namespace}/{ref.name}")

    def _demand(self, key: str, metric: str = "demand") -> tuple[bool, int]:
        """(active, count) of a served endpoint, summed over every gateway replica (KEDA reaches only this
        one); an endpoint this gateway does not serve has none (and gets no entry)."""
        if key not in self.registry.endpoints:
            return False, 0
        held, inflight = self.demand.totals(key)
        return held + inflight > 0, METRICS[metric][1](held, inflight)

    async def _metric(self, ref: pb.ScaledObjectRef, context) -> str:
        metric = ref.scalerMetadata.get("metric") or "demand"
        if metric not in METRICS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
        return metric

    async def IsActive(self, request: pb.ScaledObjectRef, context) -> pb.IsActiveResponse:
        key = await self._admit(request, context)
        return pb.IsActiveResponse(result=self._demand(key)[0])

    async def StreamIsActive(self, request: pb.ScaledObjectRef, context):
        key = await self._admit(request, context)  # maybe not served yet: its first hold is pushed all the same
        q = self.demand.subscribe(key)
        if q is None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.demand.max_subscribers} StreamIsActive streams are open (--scaler-max-streams)")
        assert q is not None
        log.info("KEDA subscribed to activity of %s (ScaledObject %s/%s)", key, request.namespace, request.name)
        try:
            yield pb.IsActiveResponse(result=self._demand(key)[0])
            while True:
                yield pb.IsActiveResponse(result=await q.get())
        finally:
            self.demand.unsubscribe(key, q)

    async def GetMetricSpec(self, request: pb.ScaledObjectRef, context) -> pb.GetMetricSpecResponse:
        await self._admit(request, context)
        metric = await self._metric(request, context)
        text = request.scalerMetadata.get("targetValue")
        try:
            target = float(text) if text else self.default_target
            if not target > 0 or math.isinf(target):
                raise ValueError
        except ValueError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"targetValue must be a number > 0, got {text!r}")
        return pb.GetMetricSpecResponse(metricSpecs=[
            pb.MetricSpec(metricName=METRICS[metric][0], targetSize=math.ceil(target), targetSizeFloat=target)])

    async def GetMetrics(self, request: pb.GetMetricsRequest, context) -> pb.GetMetricsResponse:
        key = await self._admit(request.scaledObjectRef, context)
        metric = await self._metric(request.scaledObjectRef, context)
        value = self._demand(key, metric)[1]
        return pb.GetMetricsResponse(metricValues=[
            pb.MetricValue(metricName=request.metricName or METRICS[metric][0], metricValue=value,
                           metricValueFloat=float(value))])


async def start_scaler(service: ExternalScaler, host: str, port: int,
                       tls: ScalerTLS | None = None) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(maximum_concurrent_rpcs=service.demand.max_subscribers + EXTRA_CALLS, options=[
        # Ping KEDA's long-lived StreamIsActive connection so idle-timeouts in between do not cut it.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
    ])
    pb_grpc.add_ExternalScalerServicer_to_server(service, server)
    bound = add_port(server, host, port, tls, "the external scaler")
    await server.start()
    return server, bound
