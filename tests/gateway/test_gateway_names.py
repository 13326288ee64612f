"""Model names at the gateway (docs/gateway.md, "Model names"): `<namespace>/<servedName>` on the wire, plain
names for cluster-wide publishers or a one-namespace gateway, one holder per name, conflicts reported. And the
contract module both sides use for it."""

from __future__ import annotations

import typing
from typing import Any

import pytest

from sluice_autoscaler.kube import endpoint_specs, peer_urls
from sluice_autoscaler.registry import Registry
from sluice_contract import NAME_SCOPES, model_names, served_name


def ie(namespace: str, name: str, served: str | None = "llama", scope: str | None = None,
       created: str = "2025-01-01T00:00:00Z") -> dict[str, Any]:
    model: dict[str, Any] = {"uri": f"hf://org/{name}-weights"}
    if served:
        model["servedName"] = served
    if scope:
        model["nameScope"] = scope
    return {"metadata": {"name": name, "namespace": namespace, "creationTimestamp": created},
            "spec": {"model": model}}


def registry_of(*endpoints: dict[str, Any], only_namespace: bool = False) -> Registry:
    from sluice_autoscaler.config import GatewayConfig

    reg = Registry(GatewayConfig())
    reg.apply(endpoint_specs(endpoints, [], only_namespace))  # no backends: no health tasks
    return reg


def test_the_name_rule():
    assert model_names("team-a", "llama", "Namespace", False) == ("team-a/llama",)
    assert model_names("team-a", "llama", "Namespace", True) == ("team-a/llama", "llama")
    assert model_names("team-a", "llama", "Cluster", False) == ("team-a/llama", "llama")
    with pytest.raises(ValueError, match="Namespace, Cluster"):
        model_names("team-a", "llama", "Global", False)
    assert served_name(None, "hf://Org/Model-7B/") == "Model-7B" and served_name("x", "hf://a/b") == "x"


def test_operator_and_gateway_share_the_served_name_and_scopes():
    from sluice_operator.spec import ModelSource

    for served, uri in ((None, "hf://Org/Model-7B"), ("chat", "hf://Org/Model-7B"), (None, "pvc://claim/dir/m/")):
        source = ModelSource.model_validate({"uri": uri, "servedName": served} if served else {"uri": uri})
        gateway_side = endpoint_specs([{"metadata": {"name": "e", "namespace": "n"},
                                        "spec": {"model": source.model_dump(by_alias=True)}}], [])
        assert gateway_side[0].model == source.name
    field = ModelSource.model_fields["name_scope"]
    assert typing.get_args(field.annotation) == NAME_SCOPES and field.default == "Namespace"


@pytest.mark.asyncio
async def test_same_name_in_two_namespaces_stays_apart():
    reg = registry_of(ie("team-a", "chat"), ie("team-b", "chat"))
    assert reg.by_model("team-a/llama").key == "team-a/chat"
    assert reg.by_model("team-b/llama").key == "team-b/chat"
    assert reg.by_model("llama") is None  # nobody published the plain name
    assert reg.conflicts == []
    assert [n for n, _ in reg.names()] == ["team-a/llama", "team-b/llama"]
    # Served names may hold slashes: the namespace is what comes before the first one.
    reg = registry_of(ie("team-a", "chat", served="Qwen/Qwen3-8B"))
    assert reg.by_model("team-a/Qwen/Qwen3-8B").model == "Qwen/Qwen3-8B"


@pytest.mark.asyncio
async def test_one_namespace_gateway_keeps_plain_names():
    reg = registry_of(ie("team-a", "chat"), ie("team-a", "embed", served="bge"), only_namespace=True)
    assert reg.by_model("llama").key == "team-a/chat" and reg.by_model("team-a/llama").key == "team-a/chat"
    assert reg.by_model("bge").key == "team-a/embed"


@pytest.mark.asyncio
async def test_cluster_wide_name_goes_to_the_first_publisher_and_the_conflict_is_reported():
    older = ie("team-a", "chat", scope="Cluster", created="2025-01-01T00:00:00Z")
    newer = ie("team-b", "chat", scope="Cluster", created="2025-02-01T00:00:00Z")
    for order in ((older, newer), (newer, older)):  # not the listing order: creation time decides
        reg = registry_of(*order)
        assert reg.by_model("llama").key == "team-a/chat"
        assert reg.by_model("team-b/llama").key == "team-b/chat"  # still reachable by its own name
        assert [(c.name, c.endpoint, c.holder) for c in reg.conflicts] == [("llama", "team-b/chat", "team-a/chat")]
    # The older one leaves: the name moves to the other and the conflict is gone.
    reg.apply(endpoint_specs([newer], []))
    assert reg.by_model("llama").key == "team-b/chat" and reg.conflicts == []


@pytest.mark.asyncio
async def test_a_namespaced_name_beats_a_cluster_wide_name_that_looks_like_it():
    """team-b's cluster-wide `team-a/llama` cannot take team-a's own `<namespace>/...` name, however old."""
    squatter = ie("team-b", "chat", served="team-a/llama", scope="Cluster", created="2020-01-01T00:00:00Z")
    owner = ie("team-a", "chat", created="2025-01-01T00:00:00Z")
    reg = registry_of(squatter, owner)
    assert reg.by_model("team-a/llama").key == "team-a/chat"
    assert [(c.name, c.endpoint) for c in reg.conflicts] == [("team-a/llama", "team-b/chat")]


@pytest.mark.asyncio
async def test_scaler_refs_resolve_within_their_namespace():
    reg = registry_of(ie("team-a", "chat", scope="Cluster"), ie("team-b", "other", served="qwen"))
    assert reg.resolve_key("team-b/other", None, "team-b/so") == "team-b/other"  # the endpoint metadata
    assert reg.resolve_key(None, "llama", "team-a/so") == "team-a/chat"  # model, in the ref's namespace
    # A ScaledObject in team-b naming model llama never gets team-a's demand, cluster-wide or not.
    assert reg.resolve_key(None, "llama", "team-b/so") == "team-b/so"
    assert reg.resolve_key("team-b/gone", "llama", "team-b/so") == "team-b/gone"


def test_unknown_name_scope_falls_back_to_the_namespaced_name():
    (spec,) = endpoint_specs([ie("team-a", "chat", scope="Everywhere")], [])
    assert spec.names == ("team-a/llama",)


def test_peer_urls_from_the_headless_service_slices():
    slices = [
        {"addressType": "IPv4", "ports": [{"name": "http", "port": 8080}, {"name": "peers", "port": 9091}],
         "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
                       {"addresses": ["10.0.0.2"], "conditions": {"ready": False, "terminating": True}}]},
        {"addressType": "IPv6", "ports": [{"name": "peers", "port": 9091}], "endpoints": [{"addresses": ["fd00::3"]}]},
        {"addressType": "FQDN", "ports": [{"name": "peers", "port": 9091}], "endpoints": [{"addresses": ["x.y"]}]},
    ]
    # Not-ready and terminating replicas count: one starting has nothing held, one leaving drains streams.
    assert peer_urls(slices) == {"http://10.0.0.1:9091", "http://10.0.0.2:9091", "http://[fd00::3]:9091"}


def test_the_contract_module_needs_nothing_but_the_standard_library():
    import subprocess
    import sys

    heavy = ("pydantic", "aiohttp", "grpc", "yaml", "torch", "kopf", "prometheus_client", "sluice_operator",
             "sluice_autoscaler", "sluice_engine")
    code = ("import sys, sluice_contract; print(sorted({m.split('.')[0] for m in sys.modules} & set(sys.argv[1:])))")
    out = subprocess.run([sys.executable, "-c", code, *heavy], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_a_disaggregated_endpoints_prefill_pool_is_no_backend():
    """Its decode engines call the prefill pool (spec.disaggregation); clients, and so the gateway, never do."""
    from gateway_fakes import endpoint_slice

    def slice_(name: str, role: str, url: str) -> dict[str, Any]:
        return endpoint_slice(name, "ml", {"sluice.dev/endpoint": "split", "sluice.dev/role": role}, url)

    (spec,) = endpoint_specs([ie("ml", "split")], [slice_("split-abcde", "serving", "http://10.0.0.1:8000"),
                                                   slice_("split-prefill-fghij", "prefill", "http://10.0.0.2:8000")])
    assert set(spec.serving) == {"http://10.0.0.1:8000"} and not spec.standby
