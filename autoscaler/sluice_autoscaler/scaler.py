"""KEDA's external scaler (gRPC, externalscaler.proto), served from the gateway's demand board.

The operator's ScaledObject carries an `external-push` trigger whose metadata names the endpoint:

    - type: external-push
      metadata: {scalerAddress: sluice-gateway.<ns>:9090, endpoint: <namespace>/<name>, model: <servedName>}

- IsActive: the endpoint has held or in-flight requests. KEDA polls it; false (after the cooldown) lets
  KEDA scale the serving workload to zero.
- StreamIsActive: the same, pushed: the current state on connect, then on every flip and whenever a hold
  begins. A request arriving at zero replicas reaches KEDA in milliseconds, not a polling interval.
- GetMetricSpec / GetMetrics: `sluice-gateway-demand` = held + in-flight requests, against a target per
  replica (`targetValue` in the metadata, else --scaler-target); the HPA scales 1 <-> N on it.
"""

from __future__ import annotations

import logging
import math

import grpc

from . import externalscaler_pb2 as pb
from . import externalscaler_pb2_grpc as pb_grpc
from .demand import DemandBoard
from .registry import Registry

log = logging.getLogger("sluice.gateway")
METRIC_NAME = "sluice-gateway-demand"


class ExternalScaler(pb_grpc.ExternalScalerServicer):
    def __init__(self, registry: Registry, demand: DemandBoard, default_target: float):
        self.registry, self.demand, self.default_target = registry, demand, default_target

    def endpoint_key(self, ref: pb.ScaledObjectRef) -> str:
        meta = ref.scalerMetadata
        return self.registry.resolve_key(meta.get("endpoint"), meta.get("model"), f"{ref.namespace}/{ref.name}")

    async def IsActive(self, request: pb.ScaledObjectRef, context) -> pb.IsActiveResponse:
        return pb.IsActiveResponse(result=self.demand[self.endpoint_key(request)].active)

    async def StreamIsActive(self, request: pb.ScaledObjectRef, context):
        key = self.endpoint_key(request)
        q = self.demand.subscribe(key)
        log.info("KEDA subscribed to activity of %s (ScaledObject %s/%s)", key, request.namespace, request.name)
        try:
            yield pb.IsActiveResponse(result=self.demand[key].active)
            while True:
                yield pb.IsActiveResponse(result=await q.get())
        finally:
            self.demand.unsubscribe(key, q)

    async def GetMetricSpec(self, request: pb.ScaledObjectRef, context) -> pb.GetMetricSpecResponse:
        text = request.scalerMetadata.get("targetValue")
        try:
            target = float(text) if text else self.default_target
            if not target > 0:
                raise ValueError
        except ValueError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"targetValue must be a number > 0, got {text!r}")
        return pb.GetMetricSpecResponse(metricSpecs=[
            pb.MetricSpec(metricName=METRIC_NAME, targetSize=math.ceil(target), targetSizeFloat=target)])

    async def GetMetrics(self, request: pb.GetMetricsRequest, context) -> pb.GetMetricsResponse:
        value = self.demand[self.endpoint_key(request.scaledObjectRef)].value
        return pb.GetMetricsResponse(metricValues=[
            pb.MetricValue(metricName=request.metricName or METRIC_NAME, metricValue=value,
                           metricValueFloat=float(value))])


async def start_scaler(service: ExternalScaler, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(options=[
        # Ping KEDA's long-lived StreamIsActive connection so idle-timeouts in between do not cut it.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
    ])
    pb_grpc.add_ExternalScalerServicer_to_server(service, server)
    bound = server.add_insecure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    if bound == 0:
        raise ValueError(f"cannot listen on {host}:{port} for the external scaler")
    await server.start()
    return server, bound
