"""The KEDA external scaler answers a real gRPC client the way KEDA calls it: ScaledObjectRef with the
trigger's metadata; IsActive flips with held requests; StreamIsActive pushes without being polled."""

from __future__ import annotations

import asyncio
import base64
import shutil
import subprocess
import time

import grpc
import httpx
import pytest
import yaml
from gateway_fakes import FakeBackend, chat, start_gateway, wait_until

from sluice_autoscaler import externalscaler_pb2 as pb
from sluice_autoscaler import externalscaler_pb2_grpc as pb_grpc
from sluice_autoscaler.scaler import METRIC_NAME, QUEUE_METRIC_NAME

pytestmark = pytest.mark.asyncio


def ref(endpoint: str | None = "ns/chat", **extra: str) -> pb.ScaledObjectRef:
    meta = {"scalerAddress": "gateway:9090", "model": "chat", **extra}
    if endpoint:
        meta["endpoint"] = endpoint
    return pb.ScaledObjectRef(name="chat", namespace="ns", scalerMetadata=meta)


async def test_external_scaler_per_keda_contract(tmp_path):
    backend = await FakeBackend("A", model="chat", delay=0.5).start()
    backend.ready = False  # scaled to zero: nothing answers
    path = tmp_path / "backends.yaml"
    path.write_text(f"endpoints: [{{model: chat, name: ns/chat, serving: [{backend.url}]}}]\n")
    gw = await start_gateway(backends_file=str(path), scaler_target=4)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.scaler_port}")
    stub = pb_grpc.ExternalScalerStub(channel)
    try:
        spec = await stub.GetMetricSpec(ref())
        assert [(m.metricName, m.targetSize, m.targetSizeFloat) for m in spec.metricSpecs] == [(METRIC_NAME, 4, 4.0)]
        spec = await stub.GetMetricSpec(ref(targetValue="2.5"))
        assert (spec.metricSpecs[0].targetSize, spec.metricSpecs[0].targetSizeFloat) == (3, 2.5)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.GetMetricSpec(ref(targetValue="lots"))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        assert (await stub.IsActive(ref())).result is False
        stream = stub.StreamIsActive(ref())
        assert (await stream.read()).result is False  # the state on connect

        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
            t0 = time.monotonic()
            request = asyncio.create_task(c.post("/v1/chat/completions", json=chat("chat", "wake up")))
            pushed = await asyncio.wait_for(stream.read(), 2)  # pushed: nobody polled
            latency = time.monotonic() - t0
            assert pushed.result is True and latency < 1.0
            assert (await stub.IsActive(ref())).result is True
            metrics = await stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref(), metricName="s0-" + METRIC_NAME))
            assert [(v.metricName, v.metricValue, v.metricValueFloat) for v in metrics.metricValues] == [
                ("s0-" + METRIC_NAME, 1, 1.0)]
            # Without `endpoint` metadata the ScaledObject's namespace/name is the key (here the same).
            assert (await stub.IsActive(ref(endpoint=None))).result is True
            # Another endpoint is not active.
            assert (await stub.IsActive(ref(endpoint="ns/other", model="other"))).result is False

            backend.ready = True  # KEDA scaled 0 -> 1 and the replica is ready: the request goes in flight
            await wait_until(lambda: gw.demand["ns/chat"].inflight == 1)
            assert (await stub.IsActive(ref())).result is True  # in flight still counts as demand
            r = await request
            assert r.status_code == 200
        assert (await asyncio.wait_for(stream.read(), 2)).result is False  # pushed when demand went away
        assert (await stub.IsActive(ref())).result is False
        metrics = await stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref(), metricName=METRIC_NAME))
        assert metrics.metricValues[0].metricValueFloat == 0.0
        stream.cancel()
        await wait_until(lambda: not gw.demand.subscribers("ns/chat"))
    finally:
        await channel.close()
        await gw.stop()
        await backend.stop()


async def test_every_new_hold_is_pushed_even_while_active(tmp_path):
    """A second cold start while requests are still in flight (e.g. the last replica died) is signalled again."""
    gw = await start_gateway(backends=["chat=http://127.0.0.1:9"])  # local key: the model name
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.scaler_port}")
    stub = pb_grpc.ExternalScalerStub(channel)
    try:
        # `endpoint` names a key this gateway does not know; `model` resolves it.
        stream = stub.StreamIsActive(ref(endpoint="default/chat"))
        assert (await stream.read()).result is False
        demand = gw.demand["chat"]
        demand.add(inflight=1)
        assert (await asyncio.wait_for(stream.read(), 2)).result is True
        demand.add(held=1)
        assert (await asyncio.wait_for(stream.read(), 2)).result is True
        demand.add(held=-1, inflight=-1)
        assert (await asyncio.wait_for(stream.read(), 2)).result is False
        stream.cancel()
    finally:
        await channel.close()
        await gw.stop()


async def test_unknown_endpoints_create_nothing_and_streams_are_bounded():
    gw = await start_gateway(backends=["chat=http://127.0.0.1:9"], scaler_max_streams=2)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.scaler_port}")
    stub = pb_grpc.ExternalScalerStub(channel)
    try:
        before = gw.demand.items()
        for i in range(50):  # made-up endpoints: inactive, demand 0, and no entry each
            made_up = ref(endpoint=f"ns/made-up-{i}", model=f"nope-{i}")
            assert (await stub.IsActive(made_up)).result is False
            metrics = await stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=made_up, metricName=METRIC_NAME))
            assert metrics.metricValues[0].metricValue == 0
        assert gw.demand.items() == before
        streams = [stub.StreamIsActive(ref(endpoint=None, model="chat")) for _ in range(2)]
        for st in streams:
            assert (await st.read()).result is False
        extra = stub.StreamIsActive(ref(endpoint=None, model="chat"))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await extra.read()
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        streams[0].cancel()
        await wait_until(lambda: gw.demand.subscriber_count == 1)
        again = stub.StreamIsActive(ref(endpoint=None, model="chat"))
        assert (await again.read()).result is False  # a slot freed is a slot to take
        # A subscriber that does not read holds a bounded queue, not one state per flip.
        demand = gw.demand["chat"]
        for _ in range(100):
            demand.add(held=1)
            demand.add(held=-1)
        assert all(q.qsize() <= 8 for q in gw.demand.subscribers("chat"))
        for st in (streams[1], again):
            st.cancel()
    finally:
        await channel.close()
        await gw.stop()


async def test_unauthenticated_scaler_calls_are_refused_when_a_token_is_set(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    gw = await start_gateway(backends=["chat=http://127.0.0.1:9"], scaler_token_file=str(token))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.scaler_port}")
    stub = pb_grpc.ExternalScalerStub(channel)
    try:
        calls = [
            lambda r, **kw: stub.IsActive(r, **kw),
            lambda r, **kw: stub.GetMetricSpec(r, **kw),
            lambda r, **kw: stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=r, metricName=METRIC_NAME), **kw),
        ]
        for call in calls:
            for bad in (ref(), ref(scalerToken="wrong")):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call(bad)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            await call(ref(scalerToken="s3cret-token"))  # the trigger's metadata carries it
            await call(ref(), metadata=(("authorization", "Bearer s3cret-token"),))  # or the call's metadata
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.StreamIsActive(ref()).read()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert gw.demand.subscriber_count == 0
        stream = stub.StreamIsActive(ref(scalerToken="s3cret-token"))
        assert (await stream.read()).result is False
        stream.cancel()
        token.write_text("rotated\n")  # re-read on change: no restart
        await asyncio.sleep(0.01)
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.IsActive(ref(scalerToken="s3cret-token"))
        assert (await stub.IsActive(ref(scalerToken="rotated"))).result is False
    finally:
        await channel.close()
        await gw.stop()


async def test_the_trigger_picks_its_count_and_target(tmp_path):
    """The operator's trigger: `metric: queue` (held requests, the unit of targetQueueDepth) against the
    endpoint's own `targetValue`; --scaler-target is only the default for triggers without one."""
    backend = await FakeBackend("A", model="chat", delay=0.5).start()
    backend.ready = False
    path = tmp_path / "backends.yaml"
    path.write_text(f"endpoints: [{{model: chat, name: ns/chat, serving: [{backend.url}]}}]\n")
    gw = await start_gateway(backends_file=str(path), scaler_target=16)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.scaler_port}")
    stub = pb_grpc.ExternalScalerStub(channel)
    queue = ref(metric="queue", targetValue="4")  # what the operator renders for targetQueueDepth 4

    async def values() -> tuple[float, float]:
        out = []
        for r in (queue, ref()):
            m = await stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=r, metricName="s1-x"))
            out.append(m.metricValues[0].metricValueFloat)
        return out[0], out[1]

    try:
        spec = await stub.GetMetricSpec(queue)
        assert [(m.metricName, m.targetSize, m.targetSizeFloat) for m in spec.metricSpecs] == [
            (QUEUE_METRIC_NAME, 4, 4.0)]
        spec = await stub.GetMetricSpec(ref())
        assert [(m.metricName, m.targetSizeFloat) for m in spec.metricSpecs] == [(METRIC_NAME, 16.0)]
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.GetMetricSpec(ref(metric="latency"))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "queue" in e.value.details()
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
            request = asyncio.create_task(c.post("/v1/chat/completions", json=chat("chat", "wake up")))
            await wait_until(lambda: gw.demand["ns/chat"].held == 1)
            assert await values() == (1.0, 1.0)  # held: waiting, and owed an answer
            backend.ready = True
            await wait_until(lambda: gw.demand["ns/chat"].inflight == 1)
            assert await values() == (0.0, 1.0)  # in flight: owed an answer, but no longer waiting
            assert (await request).status_code == 200
    finally:
        await channel.close()
        await gw.stop()
        await backend.stop()


# -- client certificates: how KEDA authenticates (TriggerAuthentication -> caCert, tlsClientCert, tlsClientKey) --
def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(directory, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.crt", cwd=directory)


def make_cert(directory, name: str, ca: str, dns: str = "localhost") -> None:
    """A certificate for both ends (serverAuth and clientAuth), as one Secret serves KEDA and the gateway."""
    (directory / f"{name}.ext").write_text(f"subjectAltName=DNS:{dns}\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={dns}", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", cwd=directory)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=directory)


@pytest.fixture
def pki(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl not found: cannot make test certificates")
    make_ca(tmp_path, "ca")
    make_cert(tmp_path, "scaler", "ca")  # the Secret's tls.crt/tls.key, signed by its ca.crt
    make_ca(tmp_path, "rogue-ca")
    make_cert(tmp_path, "rogue", "rogue-ca")
    return tmp_path


def keda_channel(port: int, pki, client: str | None) -> grpc.aio.Channel:
    """The connection KEDA's external scaler opens with the TriggerAuthentication's caCert (to verify the
    server) and, when given, tlsClientCert/tlsClientKey (its identity)."""
    ca = (pki / "ca.crt").read_bytes()
    if client is None:
        creds = grpc.ssl_channel_credentials(root_certificates=ca)
    else:
        creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=(pki / f"{client}.key").read_bytes(),
                                             certificate_chain=(pki / f"{client}.crt").read_bytes())
    return grpc.aio.secure_channel(f"localhost:{port}", creds)


async def test_only_kedas_client_certificate_gets_in(pki):
    """Acceptance (issue 13): a call without a client certificate, or with one another CA signed, is refused
    in the handshake; KEDA's, as a TriggerAuthentication delivers it, is served."""
    gw = await start_gateway(backends=["chat=http://127.0.0.1:9"], scaler_tls_cert=str(pki / "scaler.crt"),
                             scaler_tls_key=str(pki / "scaler.key"), scaler_tls_client_ca=str(pki / "ca.crt"))
    channels = {who: keda_channel(gw.scaler_port, pki, who) for who in (None, "rogue", "scaler")}
    plaintext = grpc.aio.insecure_channel(f"127.0.0.1:{gw.scaler_port}")
    try:
        for who in (None, "rogue"):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await pb_grpc.ExternalScalerStub(channels[who]).IsActive(ref(endpoint="chat"), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, who  # the handshake failed: nothing served
        with pytest.raises(grpc.aio.AioRpcError):
            await pb_grpc.ExternalScalerStub(plaintext).IsActive(ref(endpoint="chat"), timeout=5)
        keda = pb_grpc.ExternalScalerStub(channels["scaler"])
        assert (await keda.IsActive(ref(endpoint="chat"), timeout=5)).result is False
        stream = keda.StreamIsActive(ref(endpoint="chat"))
        assert (await stream.read()).result is False
        stream.cancel()
    finally:
        for channel in (*channels.values(), plaintext):
            await channel.close()
        await gw.stop()


async def test_tls_flags_go_together():
    from sluice_autoscaler.config import GatewayConfig

    with pytest.raises(ValueError, match="--scaler-tls-cert and --scaler-tls-key go together"):
        GatewayConfig(scaler_tls_cert="/c.pem")
    with pytest.raises(ValueError, match="--scaler-tls-client-ca needs --scaler-tls-cert"):
        GatewayConfig(scaler_tls_client_ca="/ca.pem")


async def test_the_charts_certificate_lets_keda_in(helm, tmp_path):  # noqa: F811 - helm is a fixture
    """End to end with what the chart generates (gateway.scalerTLS.generate): the gateway serves the Secret's
    tls.crt and requires ca.crt's clients; KEDA, given the same Secret through the TriggerAuthentication,
    verifies the server by the name in scalerAddress and is let in."""
    from helm import CHART, RELEASE, RELEASE_NS, run_helm

    from sluice_operator.config import GATEWAY_HOST

    text = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", RELEASE_NS,
                    "--set", "gateway.scalerTLS.generate=true", "--show-only", "templates/scaler-tls.yaml")
    (secret,) = [d for d in yaml.safe_load_all(text) if d]
    for key, value in secret["data"].items():
        (tmp_path / key).write_bytes(base64.b64decode(value))
    gw = await start_gateway(backends=["chat=http://127.0.0.1:9"], scaler_tls_cert=str(tmp_path / "tls.crt"),
                             scaler_tls_key=str(tmp_path / "tls.key"), scaler_tls_client_ca=str(tmp_path / "ca.crt"))
    files = {k: (tmp_path / k).read_bytes() for k in ("ca.crt", "tls.crt", "tls.key")}
    # The operator's default scalerAddress names the Service; here it resolves to loopback.
    override = (("grpc.ssl_target_name_override", GATEWAY_HOST),)
    keda = grpc.aio.secure_channel(f"127.0.0.1:{gw.scaler_port}", grpc.ssl_channel_credentials(
        root_certificates=files["ca.crt"], private_key=files["tls.key"], certificate_chain=files["tls.crt"]),
        options=override)
    anonymous = grpc.aio.secure_channel(f"127.0.0.1:{gw.scaler_port}", grpc.ssl_channel_credentials(
        root_certificates=files["ca.crt"]), options=override)
    try:
        assert (await pb_grpc.ExternalScalerStub(keda).IsActive(ref(endpoint="chat"), timeout=5)).result is False
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await pb_grpc.ExternalScalerStub(anonymous).IsActive(ref(endpoint="chat"), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await keda.close()
        await anonymous.close()
        await gw.stop()
