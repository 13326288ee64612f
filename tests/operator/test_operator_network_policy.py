"""Issue 39, the endpoint's NetworkPolicies (network_policy.py), offline: what each admits on which port, the
opt-out, the operator settings that feed them, and that every one is valid Kubernetes."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import kubernetes_validate
import pytest
from operator_schemas import EXAMPLES, load_yaml

from sluice_operator.config import GATEWAY_PEERS, OPERATOR_PEERS, PROMETHEUS_PEERS, OperatorConfig
from sluice_operator.network_policy import LWS_GROUP_INDEX_LABEL, LWS_NAME_LABEL, group_count
from sluice_operator.reconcile import reconcile
from sluice_operator.spec import parse_endpoint

K8S_VERSIONS = ["1.30", kubernetes_validate.latest_version()]
HTTP, KV = [{"port": "http", "protocol": "TCP"}], [{"port": "kv", "protocol": "TCP"}]
API_PEERS = [*GATEWAY_PEERS, *OPERATOR_PEERS, *PROMETHEUS_PEERS]


def example(name: str, **spec: Any) -> Any:
    doc = load_yaml(next(p for p in EXAMPLES if p.name == name))
    doc["spec"].update(copy.deepcopy(spec))
    return parse_endpoint(doc)


def policies(ep: Any, cfg: OperatorConfig | None = None) -> dict[str, dict[str, Any]]:
    return {m["metadata"]["name"]: m for m in reconcile(ep, cfg) if m["kind"] == "NetworkPolicy"}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_policy_validates_strictly(path: Any, version: str) -> None:
    found = policies(parse_endpoint(load_yaml(path)))
    assert found
    for policy in found.values():
        kubernetes_validate.validate(policy, version, strict=True)
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"]["ingress"]:
            # An empty `from` means "anyone": never rendered.
            assert rule.get("from"), policy["metadata"]["name"]


def test_a_single_pod_endpoint_admits_only_the_api_peers_on_the_api_port() -> None:
    ep = example("cpu-smollm2.yaml")
    (policy,) = policies(ep).values()
    assert policy["metadata"]["name"] == ep.name
    assert policy["metadata"]["labels"]["sluice.dev/endpoint"] == ep.name  # the prune pass finds it
    assert policy["spec"]["podSelector"] == {"matchLabels": {"sluice.dev/endpoint": ep.name}}
    assert policy["spec"]["ingress"] == [{"from": API_PEERS, "ports": HTTP}]
    # Before the workload: the pods start behind it.
    kinds = [m["kind"] for m in reconcile(ep)]
    assert kinds.index("NetworkPolicy") < kinds.index("Deployment")


def test_disaggregated_kv_port_only_from_the_endpoints_prefill_pods() -> None:
    ep = example("cpu-disaggregated.yaml")
    found = policies(ep)
    assert set(found) == {ep.name, f"{ep.name}-prefill"}
    main = found[ep.name]["spec"]["ingress"]
    assert main[0] == {"from": API_PEERS, "ports": HTTP}
    prefill_pods = {"podSelector": {"matchLabels": {"sluice.dev/endpoint": ep.name, "sluice.dev/role": "prefill"}}}
    assert main[1] == {"from": [prefill_pods], "ports": KV} and len(main) == 2
    # The prefill hop: the decode (serving) pods call the prefill pods' API port.
    hop = found[f"{ep.name}-prefill"]["spec"]
    assert hop["podSelector"] == {"matchLabels": {"sluice.dev/endpoint": ep.name, "sluice.dev/role": "prefill"}}
    assert hop["ingress"] == [{"from": [{"podSelector": {"matchLabels": {
        "sluice.dev/endpoint": ep.name, "sluice.dev/role": "serving"}}}], "ports": HTTP}]
    # Only the decode pods declare the KV port the rule names.
    for m in reconcile(ep):
        if m["kind"] == "Deployment":
            ports = {p["name"] for p in m["spec"]["template"]["spec"]["containers"][0]["ports"]}
            assert ("kv" in ports) == (m["metadata"]["labels"]["sluice.dev/role"] == "serving")


@pytest.mark.parametrize(("name", "spec", "groups"), [
    ("cpu-pipeline-2node.yaml", {}, {"smollm2-pp2": 1}),
    ("cpu-pipeline-2node.yaml", {"replicas": 3, "rollout": {"maxSurge": 1, "maxUnavailable": 0}},
     {"smollm2-pp2": 4}),
    ("cpu-pipeline-2node.yaml", {"replicas": 3, "rollout": {"maxSurge": "50%", "maxUnavailable": 0}},
     {"smollm2-pp2": 5}),  # 50% of 3, rounded up
    ("multinode-70b.yaml", {"scaling": {"minReplicas": 1, "maxReplicas": 3, "warmPool": {"replicas": 1}}},
     {"llama-70b": 3, "llama-70b-warm": 1}),
])
def test_lws_groups_admit_only_their_own_group(name: str, spec: dict[str, Any], groups: dict[str, int]) -> None:
    ep = example(name, **spec)
    found = policies(ep)
    assert set(found) == {ep.name} | {f"{w}-group-{i}" for w, n in groups.items() for i in range(n)}
    assert found[ep.name]["spec"]["ingress"] == [{"from": API_PEERS, "ports": HTTP}]  # no rendezvous port there
    for workload, n in groups.items():
        for i in range(n):
            group = {"sluice.dev/endpoint": ep.name, LWS_NAME_LABEL: workload, LWS_GROUP_INDEX_LABEL: str(i)}
            policy = found[f"{workload}-group-{i}"]["spec"]
            assert policy["podSelector"] == {"matchLabels": group}
            # Every port (the rendezvous at 29500, then gloo/NCCL on ports of their choosing), from this group only.
            assert policy["ingress"] == [{"from": [{"podSelector": {"matchLabels": group}}]}]


def test_group_count() -> None:
    assert [group_count(4, s) for s in (0, 2, "0%", "25%", "100%")] == [4, 6, 4, 5, 8]


def test_settings_shape_the_api_rule_and_the_opt_out() -> None:
    ep = example("cpu-disaggregated.yaml")
    batch = {"from": [{"podSelector": {"matchLabels": {"app": "batch"}}}], "ports": HTTP}
    cfg = OperatorConfig.from_env({
        "SLUICE_NETWORK_POLICY_GATEWAY": "[]",  # no gateway
        "SLUICE_NETWORK_POLICY_PROMETHEUS": json.dumps(list(PROMETHEUS_PEERS)),
        "SLUICE_NETWORK_POLICY_EXTRA_INGRESS": json.dumps([batch]),
        "SLUICE_NETWORK_POLICY_EXCEPT": "public, other",
    })
    assert cfg.network_policy_except == ("public", "other") and cfg.network_policy_gateway == ()
    main = policies(ep, cfg)[ep.name]["spec"]["ingress"]
    assert main[0] == {"from": [*OPERATOR_PEERS, *PROMETHEUS_PEERS], "ports": HTTP}
    assert main[1] == batch and main[2]["ports"] == KV
    # With no peer at all there is no API rule (an empty `from` would admit anyone), only the extra ones.
    none = dataclasses.replace(cfg, network_policy_operator=(), network_policy_prometheus=())
    assert policies(ep, none)[ep.name]["spec"]["ingress"][0] == batch
    # Opted out by name, or switched off: no policies (and the prune pass deletes earlier ones).
    public = parse_endpoint({**load_yaml(EXAMPLES[0]), "metadata": {"name": "public", "namespace": "ml"}})
    assert policies(public, cfg) == {}
    assert policies(ep, dataclasses.replace(cfg, network_policy=False)) == {}
    assert OperatorConfig.from_env({"SLUICE_NETWORK_POLICY": "false"}).network_policy is False


@pytest.mark.parametrize("value", ["{", '{"a": 1}', "[1, 2]", '["x"]'])
def test_peer_settings_must_be_json_lists_of_objects(value: str) -> None:
    with pytest.raises(ValueError, match="SLUICE_NETWORK_POLICY_PROMETHEUS must be a JSON list of objects"):
        OperatorConfig.from_env({"SLUICE_NETWORK_POLICY_PROMETHEUS": value})
