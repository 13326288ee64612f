"""The gateway's pure parts: CHWBL, routing keys, warm-pool candidate selection, backend sources."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest

from sluice_autoscaler.config import GatewayConfig
from sluice_autoscaler.kube import endpoint_specs, served_model_name
from sluice_autoscaler.prefix import routing_key
from sluice_autoscaler.registry import SERVING, STANDBY, Backend, Endpoint
from sluice_autoscaler.router import HashRing, Router, chwbl_pick, load_bound
from sluice_autoscaler.static import build_specs, parse_backends_file

IDS = [f"http://10.0.0.{i}:8000" for i in range(1, 6)]
KEYS = [f"system prompt {i}: you are a helpful assistant" for i in range(2000)]


@dataclass
class B:
    url: str
    inflight: int = 0


# -- CHWBL -------------------------------------------------------------------------------------------------
def test_same_prefix_same_backend():
    router = Router("prefix", 1.25)
    backends = [B(u) for u in IDS]
    for key in KEYS[:50]:
        first = router.pick(backends, key)
        assert all(router.pick(backends, key) is first for _ in range(5))
    # and the choice does not depend on the order the candidates come in
    assert router.pick(list(reversed(backends)), KEYS[0]) is router.pick(backends, KEYS[0])


def test_below_the_load_floor_a_prefix_stays_on_its_backend():
    backends = [B(u) for u in IDS]
    key = KEYS[0]
    owner = Router("prefix", 1.25).pick(backends, key)
    owner.inflight = 3  # the bound with 3 in flight over 5 backends is ceil(1.25 * 4 / 5) = 1: CHWBL spills
    assert Router("prefix", 1.25).pick(backends, key) is not owner
    assert Router("prefix", 1.25, load_floor=4).pick(backends, key) is owner  # 3 + 1 <= 4: it keeps the prefix
    owner.inflight = 4
    assert Router("prefix", 1.25, load_floor=4).pick(backends, key) is not owner  # past the floor: the bound


def test_keys_spread_over_backends():
    ring = HashRing(IDS)
    owners = Counter(next(ring.walk(k)) for k in KEYS)
    assert set(owners) == set(IDS)
    assert max(owners.values()) < 1.5 * len(KEYS) / len(IDS)


def test_bounded_load_holds_under_a_hot_prefix():
    """Every request has the same key: the load still never exceeds ceil(c * (total + 1) / n)."""
    c = 1.25
    loads = dict.fromkeys(IDS, 0)
    ring = HashRing(IDS)
    rng = random.Random(0)
    for _ in range(500):
        if rng.random() < 0.3 and sum(loads.values()):  # some requests finish
            done = rng.choice([i for i in IDS if loads[i]])
            loads[done] -= 1
        bound = load_bound(sum(loads.values()), len(IDS), c)
        chosen = chwbl_pick(ring, "the one hot prefix", loads, c)
        loads[chosen] += 1
        assert loads[chosen] <= bound
        assert max(loads.values()) <= bound
    # the hot key's first choice carries the most; the others take the overflow
    first = next(ring.walk("the one hot prefix"))
    assert loads[first] == max(loads.values())


def test_bounded_load_with_random_keys_and_loads():
    rng = random.Random(1)
    ring = HashRing(IDS)
    for _ in range(300):
        loads = {i: rng.randint(0, 20) for i in IDS}
        c = rng.choice([1.0, 1.25, 2.0])
        chosen = chwbl_pick(ring, rng.choice(KEYS), loads, c)
        assert loads[chosen] + 1 <= load_bound(sum(loads.values()), len(IDS), c)


def test_minimal_remapping_when_a_backend_leaves_or_joins():
    def owners(ids):
        ring, idle = HashRing(ids), dict.fromkeys(ids, 0)
        return {k: chwbl_pick(ring, k, idle, 1.25) for k in KEYS}

    before = owners(IDS)
    # remove one: only its keys move
    gone = IDS[2]
    rest = [i for i in IDS if i != gone]
    after = owners(rest)
    moved = [k for k in KEYS if before[k] != after[k]]
    assert moved and all(before[k] == gone for k in moved)
    assert len(moved) == sum(1 for k in KEYS if before[k] == gone)
    # add one: only keys that go to the newcomer move, about 1/(n+1) of them
    new = "http://10.0.0.9:8000"
    grown = [*IDS, new]
    after = owners(grown)
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == new for k in moved)
    assert 0.5 / len(grown) < len(moved) / len(KEYS) < 1.5 / len(grown)


def test_least_loaded_and_round_robin():
    a, b, c = B("a", 3), B("b", 1), B("c", 1)
    ll = Router("least-loaded")
    assert {ll.pick([a, b, c], None).url for _ in range(4)} == {"b", "c"}  # ties rotate
    assert Router("prefix").pick([a, b, c], None).url in ("b", "c")  # no prefix: least-loaded
    rr = Router("round-robin")
    assert [rr.pick([a, b, c], "same key").url for _ in range(6)] == ["b", "c", "a", "b", "c", "a"]
    assert Router().pick([], "k") is None


# -- routing keys ---------------------------------------------------------------------------------------------
def test_routing_key_of_chat_shares_the_conversation_prefix():
    system = {"role": "system", "content": "You are a pirate. " * 30}
    k1 = routing_key({"messages": [system, {"role": "user", "content": "hi"}]}, 256)
    k2 = routing_key({"messages": [system, {"role": "user", "content": "something else"}]}, 256)
    assert k1 == k2 and len(k1) == 256
    short = routing_key({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, 256)
    assert short == "<user>hi\n"
    other = routing_key({"messages": [{"role": "system", "content": "You are a poet."}, {"role": "user",
                                                                                       "content": "hi"}]}, 256)
    assert other != k1


def test_routing_key_of_completions():
    assert routing_key({"prompt": "abcdef"}, 3) == "abc"
    assert routing_key({"prompt": ["abcdef", "x"]}, 4) == "abcd"
    assert routing_key({"prompt": [1, 2, 3]}, 100) == "1 2 3"
    assert routing_key({"prompt": [[5, 6], [7]]}, 100) == "5 6"
    assert routing_key({"prompt": ""}, 10) is None
    assert routing_key({}, 10) is None


# -- the warm pool in candidate selection ----------------------------------------------------------------------
def _endpoint(serving: list[bool], standby: list[bool]) -> Endpoint:
    ep = Endpoint("ns/e", "m")
    for i, ok in enumerate(serving):
        ep.backends[f"s{i}"] = Backend(f"s{i}", SERVING, healthy=ok)
    for i, ok in enumerate(standby):
        ep.backends[f"w{i}"] = Backend(f"w{i}", STANDBY, healthy=ok)
    return ep


def test_candidates_prefer_serving_and_fall_back_to_standby():
    def urls(ep):
        cands, via_standby = ep.candidates()
        return sorted(b.url for b in cands), via_standby

    assert urls(_endpoint([], [])) == ([], False)  # nothing: hold
    assert urls(_endpoint([], [True])) == (["w0"], True)  # scaled to zero: the warm pool answers
    assert urls(_endpoint([False], [True])) == (["w0"], True)  # serving replica still loading
    assert urls(_endpoint([True, False], [True])) == (["s0", "w0"], True)  # scaling up under a burst
    assert urls(_endpoint([True, True], [True])) == (["s0", "s1"], False)  # serving ready: traffic moves back
    assert urls(_endpoint([False], [False])) == ([], False)
    ep = _endpoint([True], [])
    ep.backends["s0"].listed_ready = False  # Kubernetes says not ready (e.g. terminating)
    assert urls(ep) == ([], False)


# -- backend sources ----------------------------------------------------------------------------------------------
def test_static_specs_from_flags_and_file():
    entries = parse_backends_file("""
endpoints:
  - model: big
    name: prod/big
    serving: [http://10.0.0.1:8000/]
    standby: http://10.0.0.2:8000
""")
    specs = build_specs(["m=http://a:1", "m=http://b:2"], ["m=http://c:3"], entries)
    assert [(s.key, s.model, s.serving, s.standby) for s in specs] == [
        ("m", "m", {"http://a:1": True, "http://b:2": True}, {"http://c:3": True}),
        ("prod/big", "big", {"http://10.0.0.1:8000": True}, {"http://10.0.0.2:8000": True}),
    ]
    with pytest.raises(ValueError, match="MODEL=URL"):
        build_specs(["no-url"], [], [])
    with pytest.raises(ValueError, match="model"):
        parse_backends_file("endpoints: [{serving: [http://x]}]")


def test_kubernetes_specs_from_endpoints_and_slices():
    ies = [
        {"metadata": {"namespace": "ns", "name": "chat"}, "spec": {
            "model": {"uri": "hf://org/SmolLM2", "servedName": "smol"},
            "routing": {"objectives": [{"name": "critical", "priority": 10}, {"name": "odd", "priority": "high"}]}}},
        {"metadata": {"namespace": "ns", "name": "plain"}, "spec": {"model": {"uri": "hf://org/Qwen3-8B/"}}},
    ]

    def slice_(name, ep, role, endpoints, port=8000, labels=None):
        lab = {"sluice.dev/endpoint": ep, "kubernetes.io/service-name": name, **({"sluice.dev/role": role} if role else {})}
        return {"metadata": {"namespace": "ns", "name": name + "-abc", "labels": {**lab, **(labels or {})}},
                "addressType": "IPv4", "ports": [{"name": "http", "port": port}], "endpoints": endpoints}

    slices = [
        slice_("chat", "chat", "serving", [
            {"addresses": ["10.1.0.1"], "conditions": {"ready": True}},
            {"addresses": ["10.1.0.2"], "conditions": {"ready": False}},
            {"addresses": ["10.1.0.3"]},  # no condition: ready
            {"addresses": ["10.1.0.4"], "conditions": {"ready": True, "terminating": True}},
        ]),
        slice_("chat-warm", "chat", "standby", [{"addresses": ["10.1.0.9"], "conditions": {"ready": True}}]),
        slice_("plain", "plain", None, [{"addresses": ["10.1.1.1"]}], port=9000),
        slice_("orphan", "gone", "serving", [{"addresses": ["10.9.9.9"]}]),  # no InferenceEndpoint: ignored
    ]
    specs = endpoint_specs(ies, slices)
    assert [(s.key, s.model) for s in specs] == [("ns/chat", "smol"), ("ns/plain", "Qwen3-8B")]
    chat, plain = specs
    assert chat.serving == {"http://10.1.0.1:8000": True, "http://10.1.0.2:8000": False,
                            "http://10.1.0.3:8000": True, "http://10.1.0.4:8000": False}
    assert chat.standby == {"http://10.1.0.9:8000": True}
    assert plain.serving == {"http://10.1.1.1:9000": True} and plain.standby == {}
    assert chat.priorities == {"critical": 10} and plain.priorities == {}  # the entry the CRD would refuse: skipped
    assert served_model_name({"metadata": {"name": "n"}, "spec": {"model": {}}}) == "n"


def test_config_checks_itself():
    with pytest.raises(ValueError, match="routing"):
        GatewayConfig(routing="random")
    with pytest.raises(ValueError, match="load-factor"):
        GatewayConfig(load_factor=0.5)
    with pytest.raises(ValueError, match="--kubernetes"):
        GatewayConfig(kubernetes=True, backends=["m=http://x"])
