"""LoRA adapters at the gateway (issue 26; docs/gateway.md, "LoRA adapters"): an adapter's name routes, holds and
counts in its endpoint's demand like the endpoint's model name, scoped by namespace the same way; the prefix key
includes the adapter; the backends that answered an adapter lately are preferred within the bounded load.
(Through a real `sluice serve --enable-lora`: test_gateway_engine.py.)"""

from __future__ import annotations

import asyncio
import importlib.util
import random
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest
from aiohttp import web
from gateway_fakes import (
    FakeBackend,
    add_sluice_resources,
    chat,
    endpoint_slice,
    kube_call,
    start_gateway,
    wait_until,
)

from sluice_autoscaler import externalscaler_pb2 as pb
from sluice_autoscaler import externalscaler_pb2_grpc as pb_grpc
from sluice_autoscaler.config import GatewayConfig
from sluice_autoscaler.kube import endpoint_specs
from sluice_autoscaler.prefix import routing_key
from sluice_autoscaler.registry import AdapterUse, Registry
from sluice_autoscaler.router import Router, load_bound
from sluice_autoscaler.static import build_specs, parse_backends_file


def ie(namespace: str, name: str, served: str = "llama", adapters: Any = None, scope: str | None = None,
       created: str = "2025-01-01T00:00:00Z") -> dict[str, Any]:
    model: dict[str, Any] = {"uri": f"hf://org/{name}-weights", "servedName": served}
    if scope:
        model["nameScope"] = scope
    spec: dict[str, Any] = {"model": model}
    if adapters is not None:
        spec["adapters"] = adapters
    return {"metadata": {"name": name, "namespace": namespace, "creationTimestamp": created}, "spec": spec}


def lora(*names: str) -> list[dict[str, str]]:
    return [{"name": n, "source": f"hf://org/{n}-lora"} for n in names]


def registry_of(*endpoints: dict[str, Any], only_namespace: bool = False) -> Registry:
    reg = Registry(GatewayConfig())
    reg.apply(endpoint_specs(endpoints, [], only_namespace))  # no backends: no health tasks
    return reg


def route_of(reg: Registry, name: str) -> tuple[str, str, str | None] | None:
    r = reg.route(name)
    return None if r is None else (r.endpoint.key, r.model, r.adapter)


# -- names: Kubernetes ------------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_adapters_are_published_by_the_served_names_rule():
    reg = registry_of(ie("team-a", "chat", adapters=lora("sql", "legal")), ie("team-b", "chat", adapters=lora("sql")))
    assert route_of(reg, "team-a/sql") == ("team-a/chat", "sql", "sql")
    assert route_of(reg, "team-a/legal") == ("team-a/chat", "legal", "legal")
    assert route_of(reg, "team-b/sql") == ("team-b/chat", "sql", "sql")  # same adapter name, its own namespace
    assert route_of(reg, "team-a/llama") == ("team-a/chat", "llama", None)
    assert reg.route("sql") is None and reg.route("team-b/legal") is None  # nothing published plain
    assert reg.conflicts == []
    assert reg.route("team-a/sql").parent == "team-a/llama"
    # Cluster-wide models publish their adapters plain too; so does a one-namespace gateway.
    reg = registry_of(ie("team-a", "chat", adapters=lora("sql"), scope="Cluster"))
    assert route_of(reg, "sql") == ("team-a/chat", "sql", "sql") and reg.route("sql").parent == "llama"
    reg = registry_of(ie("team-a", "chat", adapters=lora("sql")), only_namespace=True)
    assert route_of(reg, "sql") == route_of(reg, "team-a/sql") == ("team-a/chat", "sql", "sql")
    # An unknown nameScope falls back to the namespaced names, for the adapters too.
    reg = registry_of(ie("team-a", "chat", adapters=lora("sql"), scope="Everywhere"))
    assert [n for n, _ in reg.names()] == ["team-a/llama", "team-a/sql"]


@pytest.mark.asyncio
async def test_crs_without_adapters_or_with_odd_ones_are_tolerated():
    odd = [{"name": "ok"}, {"name": ""}, {"source": "hf://x/y"}, "bare", {"name": 7}, {"name": "a/b"},
           {"name": "m3"}, {"name": "ok"}]  # the CRD refuses all but the first; an older one might not
    reg = registry_of(ie("ns", "none"), ie("ns", "null", served="m2", adapters=None),
                      ie("ns", "odd", served="m3", adapters=odd), ie("ns", "notalist", served="m4", adapters="sql"))
    assert [n for n, _ in reg.names()] == ["ns/llama", "ns/m2", "ns/m3", "ns/m4", "ns/ok"]
    assert route_of(reg, "ns/ok") == ("ns/odd", "ok", "ok")
    # Adapters come and go with the CR (engines load them while running): the names follow.
    reg.apply(endpoint_specs([ie("ns", "none", adapters=lora("new"))], []))
    assert [n for n, _ in reg.names()] == ["ns/llama", "ns/new"]


@pytest.mark.asyncio
async def test_an_adapter_never_takes_a_models_name():
    """The rule: namespaced names before plain ones; within each, models before adapters; then first created."""
    # Same namespace: endpoint `old` has adapter `qwen`, endpoint `new` serves the model `qwen`. The model keeps
    # the name, though its endpoint is younger; the conflict is reported (old's other names still route).
    old = ie("ns", "old", adapters=lora("qwen", "sql"), created="2024-01-01T00:00:00Z")
    new = ie("ns", "new", served="qwen", created="2025-01-01T00:00:00Z")
    reg = registry_of(old, new)
    assert route_of(reg, "ns/qwen") == ("ns/new", "qwen", None)
    assert route_of(reg, "ns/sql") == ("ns/old", "sql", "sql")
    assert [(c.name, c.endpoint, c.holder, c.model) for c in reg.conflicts] == [("ns/qwen", "ns/old", "ns/new", "qwen")]
    # Two endpoints with the same adapter name in one namespace: the one created first keeps it.
    a = ie("ns", "a", adapters=lora("sql"), created="2025-02-01T00:00:00Z")
    b = ie("ns", "b", served="other", adapters=lora("sql"), created="2025-01-01T00:00:00Z")
    reg = registry_of(a, b)
    assert route_of(reg, "ns/sql") == ("ns/b", "sql", "sql")
    assert [(c.name, c.endpoint, c.holder) for c in reg.conflicts] == [("ns/sql", "ns/a", "ns/b")]
    # Plain names: a cluster-wide model name beats a cluster-wide adapter of another namespace, whatever its age.
    adapter = ie("team-a", "chat", adapters=lora("qwen"), scope="Cluster", created="2020-01-01T00:00:00Z")
    model = ie("team-b", "qwen", served="qwen", scope="Cluster", created="2025-01-01T00:00:00Z")
    reg = registry_of(adapter, model)
    assert route_of(reg, "qwen") == ("team-b/qwen", "qwen", None)
    assert route_of(reg, "team-a/qwen") == ("team-a/chat", "qwen", "qwen")  # its namespaced name stays
    # ... and a namespaced adapter name beats another namespace's cluster-wide model that looks like it.
    squatter = ie("team-b", "x", served="team-a/sql", scope="Cluster", created="2020-01-01T00:00:00Z")
    owner = ie("team-a", "chat", adapters=lora("sql"))
    reg = registry_of(squatter, owner)
    assert route_of(reg, "team-a/sql") == ("team-a/chat", "sql", "sql")


@pytest.mark.asyncio
async def test_scaler_refs_resolve_an_adapter_name_within_their_namespace():
    reg = registry_of(ie("team-a", "chat", adapters=lora("sql"), scope="Cluster"))
    assert reg.resolve_key(None, "sql", "team-a/so") == "team-a/chat"
    assert reg.resolve_key(None, "sql", "team-b/so") == "team-b/so"


# -- names: static ----------------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_static_adapters_from_the_file_and_flags():
    entries = parse_backends_file("""
endpoints:
  - model: big
    name: prod/big
    serving: [http://10.0.0.1:8000]
    adapters: [sql, {name: legal, source: "hf://org/legal"}, sql]
""")
    specs = build_specs(["m=http://a:1"], [], entries, ["m=chat", "m=tools"])
    assert [(s.key, s.model, s.claimed_adapters()) for s in specs] == [
        ("m", "m", {"chat": ("chat",), "tools": ("tools",)}),
        ("prod/big", "big", {"sql": ("sql",), "legal": ("legal",)}),
    ]
    reg = Registry(GatewayConfig())
    reg.apply([s.__class__(s.key, s.model, adapters=s.adapters) for s in specs])  # no backends: no health tasks
    assert route_of(reg, "sql") == ("prod/big", "sql", "sql") and route_of(reg, "chat") == ("m", "chat", "chat")
    assert reg.route("sql").parent == "big"
    for bad, match in ((["x=chat"], "no --backend or --standby serves 'x'"), (["m"], "MODEL=NAME"),
                       (["m=m"], "the model's")):
        with pytest.raises(ValueError, match=match):
            build_specs(["m=http://a:1"], [], [], bad)
    with pytest.raises(ValueError, match="adapter 'big' is the model's own name"):
        parse_backends_file("endpoints: [{model: big, adapters: [big]}]")
    with pytest.raises(ValueError, match="adapter names"):
        parse_backends_file("endpoints: [{model: big, adapters: sql}]")
    with pytest.raises(ValueError, match="--adapter"):
        GatewayConfig(kubernetes=True, adapters=["m=sql"])


# -- the routing key and the preference -------------------------------------------------------------------------
def test_the_affinity_key_includes_the_adapter():
    body = {"messages": [{"role": "system", "content": "You answer in SQL. " * 20}, {"role": "user", "content": "q"}]}
    base, sql, legal = (routing_key(body, 256, a) for a in (None, "sql", "legal"))
    assert base == routing_key(body, 256)  # the base model's keys are what they were
    assert len({base, sql, legal}) == 3
    assert sql == routing_key({**body, "messages": body["messages"][:1]}, 256, "sql")  # same prefix, same key
    assert routing_key({}, 256, "sql") is None  # no prompt: least-loaded (among the preferred)


@dataclass
class B:
    url: str
    inflight: int = 0


def test_preferred_backends_take_the_request_within_the_bound():
    backends = [B(f"http://10.0.0.{i}:8000") for i in range(1, 5)]
    router = Router("prefix", 1.25)
    keys = [f"sql\0prompt {i}" for i in range(200)]
    warm = {backends[2].url}
    assert {router.pick(backends, k, warm).url for k in keys} == warm  # idle: every key on the warm one
    # Two warm ones: the walk spreads the keys over both, each key always on the same one.
    warm = {backends[0].url, backends[3].url}
    first = {k: router.pick(backends, k, warm).url for k in keys}
    assert set(first.values()) == warm and all(router.pick(backends, k, warm).url == first[k] for k in keys)
    # The warm ones full (at the bound of all four): the request goes where it would without a preference.
    backends[0].inflight = backends[3].inflight = 3
    for k in keys[:20]:
        assert router.pick(backends, k, warm).url == router.pick(backends, k).url
    # Least-loaded mode prefers too; round-robin (the baseline) does not.
    backends[0].inflight, backends[3].inflight = 2, 1  # bound ceil(1.25 * 4 / 4) = 2: room on backends[3]
    assert Router("least-loaded").pick(backends, None, {backends[3].url}).url == backends[3].url
    assert Router("least-loaded").pick(backends, None).url in (backends[1].url, backends[2].url)
    rr = Router("round-robin")
    assert {rr.pick(backends, "k", warm).url for _ in range(4)} == {b.url for b in backends}


def test_the_preference_never_breaks_the_bound():
    rng = random.Random(3)
    urls = [f"http://10.0.1.{i}:8000" for i in range(6)]
    for _ in range(500):
        backends = [B(u, rng.randint(0, 12)) for u in urls]
        c = rng.choice([1.0, 1.25, 2.0])
        prefer = set(rng.sample(urls, rng.randint(1, 6)))
        chosen = Router("prefix", c).pick(backends, f"a\0{rng.random()}", prefer)
        bound = load_bound(sum(b.inflight for b in backends), len(backends), c)
        assert chosen.inflight + 1 <= bound
        if any(b.inflight + 1 <= bound for b in backends if b.url in prefer):
            assert chosen.url in prefer


def test_adapter_use_remembers_for_a_while():
    now = [0.0]
    use = AdapterUse(ttl=10, clock=lambda: now[0])
    use.served("sql", "a")
    now[0] = 5
    use.served("sql", "b")
    use.served("legal", "a")
    assert use.warm("sql") == {"a", "b"} and use.warm("legal") == {"a"} and use.warm("other") == set()
    now[0] = 12
    assert use.warm("sql") == {"b"}  # a answered sql 12 s ago: it may have swapped it out since
    use.missing("sql", "b")  # b said it does not serve it
    assert use.warm("sql") == set()
    use.keep(["sql"])  # legal left the endpoint's list
    assert use.warm("legal") == set()


# -- through the gateway ----------------------------------------------------------------------------------------
class LoraBackend(FakeBackend):
    """A fake engine that serves `adapters` beside its model: any other model is a 404 model_not_found."""

    def __init__(self, name: str, model: str = "m", adapters: tuple[str, ...] = ()):
        super().__init__(name, model)
        self.adapters = set(adapters)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("model") not in (self.model, *self.adapters):
            self.requests.append(body)
            return web.json_response({"error": {"message": f"model '{body.get('model')}' does not exist",
                                                "type": "not_found_error", "param": "model",
                                                "code": "model_not_found"}}, status=404)
        return await super()._complete(request)


@pytest.mark.asyncio
async def test_static_adapter_routes_holds_from_zero_and_counts_for_keda(tmp_path):
    backend = await LoraBackend("A", model="chat", adapters=("sql",)).start()
    backend.ready = False  # scaled to zero: nothing answers
    path = tmp_path / "backends.yaml"
    path.write_text(f"endpoints: [{{model: chat, name: ns/chat, serving: [{backend.url}], adapters: [sql]}}]\n")
    gw = await start_gateway(backends_file=str(path))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.scaler_port}")
    stub = pb_grpc.ExternalScalerStub(channel)
    ref = pb.ScaledObjectRef(name="chat", namespace="ns", scalerMetadata={"endpoint": "ns/chat", "model": "chat"})
    try:
        stream = stub.StreamIsActive(ref)
        assert (await stream.read()).result is False
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
            held = asyncio.create_task(c.post("/v1/chat/completions", json=chat("sql", "SELECT")))
            # Held as a request for the model would be, and KEDA hears of it at once: the endpoint's demand.
            assert (await asyncio.wait_for(stream.read(), 2)).result is True
            assert gw.demand["ns/chat"].held == 1
            assert 'sluice_gateway_pending_requests{endpoint="ns/chat"} 1.0' in (await c.get("/metrics")).text
            assert not held.done()
            backend.ready = True  # KEDA scaled 0 -> 1
            r = await asyncio.wait_for(held, 5)
            assert r.status_code == 200 and r.json()["backend"] == "A"
            assert backend.requests[-1]["model"] == "sql"  # the engine gets the adapter's name
            assert gw.metrics.hold_seconds.labels("ns/chat")._sum.get() > 0
            listed = {m["id"]: (m["served_name"], m["parent"], m["endpoint"])
                      for m in (await c.get("/v1/models")).json()["data"]}
            assert listed == {"chat": ("chat", None, "ns/chat"), "sql": ("sql", "chat", "ns/chat")}
            r = await c.post("/v1/chat/completions", json=chat("legal", "hi"))
            assert r.status_code == 404 and "chat, sql" in r.json()["error"]["message"]
        assert (await asyncio.wait_for(stream.read(), 2)).result is False
        stream.cancel()
    finally:
        await channel.close()
        await gw.stop()
        await backend.stop()


@pytest.mark.asyncio
async def test_replicas_that_served_the_adapter_are_preferred_and_one_without_it_is_skipped():
    # Backend C answered `sql` a minute ago and has unloaded it since (removed from its adapters file and added
    # back, still downloading): it answers 404 model_not_found now.
    a, b = [await LoraBackend(n, adapters=("sql",)).start() for n in "AB"]
    c = await LoraBackend("C").start()
    gw = await start_gateway(backends=[f"m={x.url}" for x in (a, b, c)], adapters=["m=sql"])
    try:
        ep = gw.registry.by_model("m")
        await wait_until(lambda: len(ep.candidates()[0]) == 3)
        by_url = {x.url: x.name for x in (a, b, c)}
        ep.adapter_use.served("sql", c.url)
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
            # Different prompts, one after another: the first goes to C (preferred), is refused there and moves
            # on; every later one goes to the backend that answered sql, whatever its prompt hashes to.
            served = []
            for i in range(12):
                r = await client.post("/v1/chat/completions", json=chat("sql", f"question {i} " * 5))
                assert r.status_code == 200
                served.append(r.headers["x-sluice-backend"])
            assert len(set(served)) == 1 and by_url[served[0]] in "AB"
            assert ep.adapter_use.warm("sql") == {served[0]}  # C forgotten
            # The 404 was the backend's, not the request's: retried, not relayed.
            assert [r["model"] for r in c.requests] == ["sql"]
            assert gw.metrics.retries.labels("m")._value.get() == 1
            assert gw.metrics.requests.labels("m", "ok")._value.get() == 12
            # The base model's requests still spread by their prefix over all three.
            base = set()
            for i in range(30):
                r = await client.post("/v1/chat/completions", json=chat("m", f"question {i} " * 5))
                base.add(r.headers["x-sluice-backend"])
            assert len(base) == 3
            # Forced onto C (A and B gone cold): C says no, and with nothing left the 404 reaches the client.
            a.ready = b.ready = False
            await wait_until(lambda: [x.url for x in ep.candidates()[0]] == [c.url])
            r = await client.post("/v1/chat/completions", json=chat("sql", "question"))
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            assert gw.metrics.requests.labels("m", "client_error")._value.get() == 1
            assert served[0] in ep.adapter_use.warm("sql")  # C's answer does not make A or B forget it
    finally:
        await gw.stop()
        for x in (a, b, c):
            await x.stop()


@pytest.mark.asyncio
async def test_a_busy_adapter_spills_onto_other_replicas():
    """The preference is soft: concurrent requests for one adapter spread by the bounded load."""
    backends = [await FakeBackend(n, delay=0.3).start() for n in "ABCD"]
    gw = await start_gateway(backends=[f"m={x.url}" for x in backends], adapters=["m=sql"])
    try:
        ep = gw.registry.by_model("m")
        await wait_until(lambda: len(ep.candidates()[0]) == 4)
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
            r = await client.post("/v1/chat/completions", json=chat("sql", "warm up"))
            first = r.headers["x-sluice-backend"]
            rs = await asyncio.gather(*(client.post("/v1/chat/completions", json=chat("sql", "same prompt"))
                                        for _ in range(8)))
        spread = [r.headers["x-sluice-backend"] for r in rs]
        # 8 at once over 4: at most ceil(1.25 * 8 / 4) = 3 each. The warm one takes its share, not all.
        assert spread.count(first) >= 2 and len(set(spread)) >= 3
        assert max(spread.count(u) for u in set(spread)) <= load_bound(7, 4, 1.25)
        assert ep.adapter_use.warm("sql") == set(spread)  # each one it spilled onto holds it now
    finally:
        await gw.stop()
        for x in backends:
            await x.stop()


# -- Kubernetes: kmock --------------------------------------------------------------------------------------------
@pytest.fixture
def k8s(kmock: Any) -> Any:
    return add_sluice_resources(kmock)


@pytest.mark.asyncio
@pytest.mark.skipif(importlib.util.find_spec("kmock") is None, reason="kmock (an in-memory Kubernetes API) missing")
async def test_kubernetes_adapters_route_by_namespace_and_follow_the_cr(k8s):
    a = await LoraBackend("team-a", model="llama", adapters=("sql", "legal")).start()
    b = await LoraBackend("team-b", model="llama", adapters=("sql",)).start()
    api = "/apis/sluice.dev/v1alpha1/namespaces/{}/inferenceendpoints"
    for ns, backend, adapters in (("team-a", a, lora("sql")), ("team-b", b, lora("sql"))):
        body = ie(ns, "chat", adapters=adapters)
        del body["metadata"]["creationTimestamp"]
        await kube_call(k8s, "POST", api.format(ns), {"apiVersion": "sluice.dev/v1alpha1",
                                                      "kind": "InferenceEndpoint", **body})
        labels = {"kubernetes.io/service-name": "chat", "sluice.dev/endpoint": "chat", "sluice.dev/role": "serving"}
        await kube_call(k8s, "POST", f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
                        endpoint_slice("chat-abcde", ns, labels, backend.url))
    gw = await start_gateway(kubernetes=True, kube_api=str(k8s.url))
    try:
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
            await wait_until(lambda: gw.ready.is_set() and all(
                e.candidates()[0] for e in gw.registry.endpoints.values()) and len(gw.registry.endpoints) == 2)
            for ns, backend in (("team-a", a), ("team-b", b)):
                r = await c.post("/v1/chat/completions", json=chat(f"{ns}/sql", "SELECT 1"))
                assert r.status_code == 200 and r.json()["backend"] == ns
                assert backend.requests[-1]["model"] == "sql"  # the namespace is dropped, as for the model
                assert gw.demand[f"{ns}/chat"].inflight == 0
            assert gw.metrics.requests.labels("team-a/chat", "ok")._value.get() == 1
            r = await c.post("/v1/chat/completions", json=chat("sql", "SELECT 1"))
            assert r.status_code == 404  # Namespace scope: no plain name, for adapters as for models
            r = await c.post("/v1/chat/completions", json=chat("team-a/legal", "hi"))
            assert r.status_code == 404  # not in the CR (whatever the engine may have loaded)

            # An adapter added to the CR routes at once; one removed stops routing.
            await kube_call(k8s, "PATCH", api.format("team-a") + "/chat", {"spec": {"adapters": lora("legal")}})
            await wait_until(lambda: gw.registry.route("team-a/legal") is not None, timeout=5)
            assert gw.registry.route("team-a/sql") is None and gw.registry.route("team-b/sql") is not None
            r = await c.post("/v1/chat/completions", json=chat("team-a/legal", "hi"))
            assert r.status_code == 200 and a.requests[-1]["model"] == "legal"
            listed = {m["id"]: m["parent"] for m in (await c.get("/v1/models")).json()["data"]}
            assert listed == {"team-a/llama": None, "team-a/legal": "team-a/llama", "team-b/llama": None,
                              "team-b/sql": "team-b/llama"}
    finally:
        await gw.stop()
        await a.stop()
        await b.stop()
