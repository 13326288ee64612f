"""Model versions by weight (issue 42, versions.py): the split itself, the registry's names for split models and
aliases, the backends file's `models:`, and the in-process gateway in front of fake backends (weights, stickiness,
readiness, a weight shift under load). The same against real engines: test_gateway_versions_engine.py."""

from __future__ import annotations

import asyncio
import collections
import json

import httpx
import pytest
from gateway_fakes import FakeBackend, start_gateway, wait_until

from sluice_autoscaler.config import GatewayConfig
from sluice_autoscaler.registry import Backend, EndpointSpec, Registry
from sluice_autoscaler.static import parse_backends_file, parse_models
from sluice_autoscaler.versions import (
    Split,
    SplitSpec,
    Version,
    VersionCollector,
    session_point,
    traffic_shares,
)


def split(*weights: int, **kw) -> Split:
    return Split(SplitSpec("chat", "chat", tuple(Version(f"v{i + 1}", w) for i, w in enumerate(weights)), **kw))


def all_ready(_: str) -> bool:
    return True


# -- the split ---------------------------------------------------------------------------------------------------
def test_smooth_round_robin_gives_the_weights_exactly_and_interleaved():
    s = split(90, 10)
    picks = [s.pick(all_ready) for _ in range(1000)]
    assert collections.Counter(picks) == {"v1": 900, "v2": 100}
    # Spread out, not in bursts: every run of 10 requests holds exactly one for v2.
    assert all(picks[i:i + 10].count("v2") == 1 for i in range(0, 1000, 10))
    s = split(1, 2, 3)
    assert collections.Counter(s.pick(all_ready) for _ in range(600)) == {"v1": 100, "v2": 200, "v3": 300}


def test_weights_need_not_add_to_100():
    s = split(9, 1)
    assert collections.Counter(s.pick(all_ready) for _ in range(1000)) == {"v1": 900, "v2": 100}


def test_weight_zero_and_unready_versions_get_nothing():
    s = split(50, 0, 50)
    assert set(s.pick(all_ready) for _ in range(100)) == {"v1", "v3"}
    assert set(s.pick(lambda v: v != "v3") for _ in range(100)) == {"v1"}  # renormalised over the ready ones
    assert set(s.pick(lambda v: v != "v3", session=f"user-{i}") for i in range(100)) == {"v1"}
    # A weight-0 version that is the only ready one still gets nothing: the weighted ones hold the requests.
    assert set(s.pick(lambda v: v == "v2") for _ in range(100)) == {"v1", "v3"}


def test_none_ready_goes_to_the_weighted_choice():
    s = split(90, 10)
    assert collections.Counter(s.pick(lambda _: False) for _ in range(100)) == {"v1": 90, "v2": 10}
    assert split(0, 100).pick(lambda _: False) == "v2"


def test_unknown_endpoints_take_nothing():
    s = split(50, 50)
    assert set(s.pick(all_ready, known=lambda v: v == "v2") for _ in range(10)) == {"v2"}
    assert s.pick(all_ready, known=lambda _: False) is None


def test_sessions_stick_and_a_shift_moves_the_fewest():
    keys = [f"session-{i}" for i in range(2000)]
    s = split(90, 10)
    before = {k: s.pick(all_ready, session=k) for k in keys}
    assert before == {k: s.pick(all_ready, session=k) for k in keys}  # same key, same version
    share = sum(v == "v2" for v in before.values()) / len(keys)
    assert 0.08 < share < 0.12
    s.update(SplitSpec("chat", "chat", (Version("v1", 80), Version("v2", 20))))
    after = {k: s.pick(all_ready, session=k) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == "v1" and after[k] == "v2" for k in moved)  # only v1 -> v2, never back
    assert 0.08 < len(moved) / len(keys) < 0.12  # about the tenth that changed hands
    # Scaling every weight alike moves nobody.
    s.update(SplitSpec("chat", "chat", (Version("v1", 8), Version("v2", 2))))
    assert after == {k: s.pick(all_ready, session=k) for k in keys}
    assert 0 <= session_point("x") < 1 and session_point("x") == session_point("x")


def test_traffic_shares():
    assert traffic_shares({"a": 90, "b": 10}, all_ready) == {"a": 0.9, "b": 0.1}
    assert traffic_shares({"a": 90, "b": 10}, lambda v: v == "b") == {"a": 0.0, "b": 1.0}
    assert traffic_shares({"a": 90, "b": 10}, lambda _: False) == {"a": 0.9, "b": 0.1}
    assert traffic_shares({"a": 0, "b": 10}, all_ready) == {"a": 0.0, "b": 1.0}


# -- the registry -------------------------------------------------------------------------------------------------
def registry_with(ready: dict[str, bool], splits: list[SplitSpec], served: str = "chat") -> Registry:
    """Endpoints with no health tasks: a backend marked as the poll would mark it."""
    reg = Registry(GatewayConfig())
    reg.apply([*(EndpointSpec(key, served) for key in ready), *splits])
    for key, ok in ready.items():
        reg.endpoints[key].backends["http://x"] = Backend("http://x", "serving", healthy=ok)
    return reg


def test_registry_routes_a_split_name_and_aliases():
    spec = SplitSpec("chat", "chat", (Version("v1", 90), Version("v2", 10)), aliases={"chat-canary": "v2"})
    reg = registry_with({"v1": True, "v2": True}, [spec])
    assert not reg.conflicts  # versions sharing the served name are no conflict
    picks = collections.Counter(reg.route("chat").endpoint.key for _ in range(1000))
    assert picks == {"v1": 900, "v2": 100}
    r = reg.route("chat-canary")
    assert r.endpoint.key == "v2" and r.model == "chat" and r.split == "chat"
    assert reg.version_requests == {("chat", "v1"): 900, ("chat", "v2"): 101}
    assert [n for n, _ in reg.routes()] == ["chat", "chat-canary"]
    assert dict((n, r.endpoint.key) for n, r in reg.routes()) == {"chat": "v1", "chat-canary": "v2"}
    # Sticky by the split's header.
    hdr = {"x-session-id": "alice"}
    assert len({reg.route("chat", hdr).endpoint.key for _ in range(20)}) == 1
    # Not ready: no traffic; its weight goes to the other version.
    reg.endpoints["v2"].backends["http://x"].healthy = False
    assert {reg.route("chat").endpoint.key for _ in range(50)} == {"v1"}
    assert reg.route("chat-canary").endpoint.key == "v2"  # an alias is held at its version (wakes it)
    # The metrics.
    samples = {(m.name, tuple(s.labels.values())): s.value for m in VersionCollector(reg).collect() for s in m.samples}
    assert samples[("sluice_gateway_version_requests", ("chat", "v1"))] >= 950
    assert samples[("sluice_gateway_version_weight", ("chat", "v2"))] == 10


def test_registry_split_takes_a_name_from_an_endpoint_that_is_no_version():
    spec = SplitSpec("chat", "chat", (Version("v1", 1),))
    reg = registry_with({"v1": True, "other": True}, [spec])
    assert reg.route("chat").endpoint.key == "v1"
    assert [(c.name, c.endpoint, c.holder) for c in reg.conflicts] == [("chat", "other", "chat")]
    reg.apply([EndpointSpec("v1", "chat"), EndpointSpec("other", "chat")])  # the split is gone
    assert reg.route("chat").endpoint.key == "other" and reg.splits == {}  # by key, as endpoints claim


def test_registry_split_with_no_known_version_is_not_found():
    reg = registry_with({}, [SplitSpec("chat", "chat", (Version("v1", 1),))])
    assert reg.route("chat") is None and reg.routes() == []


# -- the backends file ------------------------------------------------------------------------------------------
def test_backends_file_models():
    text = """
endpoints:
  - {model: chat, name: v1, serving: [http://a:1]}
  - {model: chat, name: v2, serving: [http://b:1]}
models:
  - model: chat
    versions: [{endpoint: v1, weight: 95}, {endpoint: v2, weight: 5}]
    aliases: {chat-canary: v2}
    sessionHeader: X-User
"""
    assert [e.key for e in parse_backends_file(text)] == ["v1", "v2"]
    [m] = parse_models(text)
    assert m.versions == (Version("v1", 95), Version("v2", 5)) and m.aliases == {"chat-canary": "v2"}
    assert m.session_header == "x-user" and m.key == "chat"
    assert parse_models("endpoints: []") == []


@pytest.mark.parametrize(("versions", "reason"), [
    ("[]", "at least one"),
    ("[{endpoint: a, weight: -1}]", "weight"),
    ("[{endpoint: a, weight: 1.5}]", "weight"),
    ("[{endpoint: a, weight: 1}, {endpoint: a, weight: 2}]", "once"),
    ("[{endpoint: a, weight: 0}]", "more than 0"),
])
def test_backends_file_models_refused(versions, reason):
    with pytest.raises(ValueError, match=reason):
        parse_models(f"models: [{{model: chat, versions: {versions}}}]")
    with pytest.raises(ValueError, match="not one of the versions"):
        parse_models("models: [{model: chat, versions: [{endpoint: a, weight: 1}], aliases: {c: b}}]")


# -- the gateway, in process, fake backends ---------------------------------------------------------------------------
def write_file(path, weights: dict[str, int], backends: dict[str, FakeBackend], **extra) -> None:
    doc = {"endpoints": [{"model": "m", "name": k, "serving": [b.url]} for k, b in backends.items()],
           "models": [{"model": "chat", "versions": [{"endpoint": k, "weight": w} for k, w in weights.items()],
                       **extra}]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)


@pytest.mark.asyncio
async def test_gateway_splits_by_weight_and_shifts_under_load(tmp_path):
    backends = {k: await FakeBackend(k, delay=0.02).start() for k in ("v1", "v2")}
    path = tmp_path / "backends.json"
    write_file(path, {"v1": 90, "v2": 10}, backends, aliases={"chat-canary": "v2"})
    gw = await start_gateway(backends_file=str(path))
    try:
        await wait_until(lambda: all(e.candidates()[0] for e in gw.registry.endpoints.values()), 5)
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
            async def one(model: str = "chat", **headers: str) -> str:
                r = await c.post("/v1/chat/completions", json={"model": model, "messages": []}, headers=headers)
                assert r.status_code == 200, r.text
                assert r.json()["model"] == "m"  # the engines' served name, not the split's
                return r.json()["backend"]

            got = collections.Counter(await asyncio.gather(*(one() for _ in range(100))))
            assert got == {"v1": 90, "v2": 10}
            assert backends["v1"].requests[0]["model"] == "m"  # forwarded under the version's served name
            assert await one("chat-canary") == "v2"
            assert len({await one(**{"x-session-id": "alice"}) for _ in range(10)}) == 1
            models = (await c.get("/v1/models")).json()["data"]
            assert {m["id"] for m in models} >= {"chat", "chat-canary"}
            # 0/100 while requests run: none fails, and v1 gets no new ones once the file is read.
            stop = asyncio.Event()
            results: list[str] = []

            async def load() -> None:
                while not stop.is_set():
                    results.append(await one())

            workers = [asyncio.create_task(load()) for _ in range(8)]
            await asyncio.sleep(0.3)
            write_file(path, {"v1": 0, "v2": 100}, backends)
            await wait_until(lambda: gw.registry.splits["chat"].spec.versions[0].weight == 0, 5)
            await asyncio.sleep(0.3)  # requests routed to v1 just before the change reach it (then finish there)
            before = len(backends["v1"].requests)
            await asyncio.sleep(0.5)
            stop.set()
            await asyncio.gather(*workers)  # each asserted its 200
            assert len(backends["v1"].requests) == before and results.count("v1") > 0
            # v2's /ready fails: with v1 back at 50, v1 takes everything.
            write_file(path, {"v1": 50, "v2": 50}, backends)
            backends["v2"].ready = False
            await wait_until(lambda: not gw.registry.endpoints["v2"].candidates()[0], 5)
            await wait_until(lambda: gw.registry.splits["chat"].spec.versions[0].weight == 50, 5)
            assert {await one() for _ in range(20)} == {"v1"}
        text = (await httpx.AsyncClient().get(f"{gw.url}/metrics")).text
        assert "sluice_gateway_requests_total" in text
    finally:
        await gw.stop()
        for b in backends.values():
            await b.stop()


# -- Kubernetes: ServedModels ----------------------------------------------------------------------------------------
def test_split_specs_from_served_models():
    from sluice_autoscaler.kube import split_specs

    sm = {"metadata": {"namespace": "team-a", "name": "chat"},
          "spec": {"model": "chat", "versions": [{"endpoint": "chat-v1", "weight": 90}, {"endpoint": "chat-v2",
                                                                                           "weight": 10},
                                                 {"endpoint": "bad", "weight": -1}],
                   "aliases": {"chat-canary": "chat-v2", "nowhere": "chat-v9"}, "sessionHeader": "X-User"}}
    [s] = split_specs([sm])
    assert s.key == "team-a/chat" and s.names == ("team-a/chat",)
    assert s.versions == (Version("team-a/chat-v1", 90), Version("team-a/chat-v2", 10))
    assert s.aliases == {"chat-canary": "team-a/chat-v2"} and s.alias_names == {"chat-canary": ("team-a/chat-canary",)}
    assert s.session_header == "x-user"
    [s] = split_specs([sm], only_namespace=True)
    assert s.names == ("team-a/chat", "chat")
    assert split_specs([{"metadata": {"name": "x"}, "spec": {"model": "a/b"}}]) == []
