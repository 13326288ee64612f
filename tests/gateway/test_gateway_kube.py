"""Kubernetes discovery against kmock (an in-memory Kubernetes API): the gateway lists and watches
InferenceEndpoints and EndpointSlices over HTTP, as in a cluster, and routes to what they list."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from gateway_fakes import (
    FakeBackend,
    add_sluice_resources,
    chat,
    endpoint_slice,
    kube_call,
    start_gateway,
    wait_until,
)

kmock = pytest.importorskip("kmock")
pytestmark = pytest.mark.asyncio

NS = "default"


@pytest.fixture
def k8s(kmock: Any) -> Any:
    return add_sluice_resources(kmock)


def slice_of(name: str, endpoint: str, role: str, url: str, ready: bool) -> dict[str, Any]:
    labels = {"kubernetes.io/service-name": name.rsplit("-", 1)[0], "sluice.dev/endpoint": endpoint,
              "sluice.dev/role": role}
    return endpoint_slice(name, NS, labels, url, ready)


async def test_backends_from_endpointslices_follow_the_cluster(k8s):
    serving = await FakeBackend("serving", model="smol").start()
    standby = await FakeBackend("standby", model="smol").start()
    slices = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"
    await kube_call(k8s, "POST", f"/apis/sluice.dev/v1alpha1/namespaces/{NS}/inferenceendpoints", {
        "apiVersion": "sluice.dev/v1alpha1", "kind": "InferenceEndpoint", "metadata": {"name": "chat", "namespace": NS},
        "spec": {"model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct", "servedName": "smol"}}})
    # Scaled to zero with a warm pool: the serving pod is still starting, the standby is ready.
    await kube_call(k8s, "POST", slices, slice_of("chat-abcde", "chat", "serving", serving.url, ready=False))
    await kube_call(k8s, "POST", slices, slice_of("chat-warm-fghij", "chat", "standby", standby.url, ready=True))
    # Something else's slice (no sluice.dev/endpoint label) is not ours.
    await kube_call(k8s, "POST", slices, {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                                    "metadata": {"name": "other-x", "namespace": NS, "labels": {}},
                                    "addressType": "IPv4", "ports": [{"port": 80}], "endpoints": []})

    gw = await start_gateway(kubernetes=True, kube_api=str(k8s.url))
    try:
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
            await wait_until(lambda: gw.ready.is_set())
            assert (await c.get("/ready")).status_code == 200
            # Watching every namespace: the model is `<namespace>/<servedName>` on the wire (the plain name is
            # not published: nameScope is Namespace by default).
            ep = gw.registry.by_model("default/smol")
            assert ep is not None and ep.key == "default/chat" and gw.registry.by_model("smol") is None
            await wait_until(lambda: ep.candidates()[0])
            r = await c.post("/v1/chat/completions", json=chat("default/smol", "hi"))
            assert r.status_code == 200 and r.json()["backend"] == "standby"
            assert standby.requests[-1]["model"] == "smol"  # the engine gets the name it answers to
            r = await c.post("/v1/chat/completions", json=chat("smol", "hi"))
            assert r.status_code == 404 and "default/smol" in r.json()["error"]["message"]

            # The serving pod turns ready: traffic moves to it (watch event, no relist).
            await kube_call(k8s, "PATCH", f"{slices}/chat-abcde",
                      {"endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True}}]})
            await wait_until(lambda: ep.candidates()[1] is False, timeout=5)
            r = await c.post("/v1/chat/completions", json=chat("default/smol", "hi"))
            assert r.json()["backend"] == "serving"

            # The endpoint is deleted: its model is gone.
            await kube_call(k8s, "DELETE", f"/apis/sluice.dev/v1alpha1/namespaces/{NS}/inferenceendpoints/chat")
            await wait_until(lambda: gw.registry.by_model("default/smol") is None, timeout=5)
            r = await c.post("/v1/chat/completions", json=chat("default/smol", "hi"))
            assert r.status_code == 404
    finally:
        await gw.stop()
        await serving.stop()
        await standby.stop()
