"""spec.disaggregation (issue 28, acceptance 4): a prefill pool and a decode pool rendered and wired (engine flags,
the decode pod's KV receiver, Services, one KEDA object per autoscaled pool), refused by both validators when the
pools cannot exchange blocks, and reconciled by the real loop on kmock with both pools in the status. That the
rendered manifests validate strictly (kubernetes-validate, reference CRDs) and reach Ready on a real API server
comes from examples/cpu-disaggregated.yaml being one of the examples every such test takes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from operator_schemas import CRD_FILE, EXAMPLES, api_server_errors, crd_schema, load_yaml

from sluice_operator.config import OperatorConfig
from sluice_operator.reconcile import reconcile
from sluice_operator.spec import SpecError, parse_endpoint

EXAMPLE = load_yaml(next(p for p in EXAMPLES if p.name == "cpu-disaggregated.yaml"))
NAME = EXAMPLE["metadata"]["name"]


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return crd_schema(load_yaml(CRD_FILE))


def _doc(**disaggregation: Any) -> dict[str, Any]:
    doc = copy.deepcopy(EXAMPLE)
    for pool, changes in disaggregation.items():
        doc["spec"]["disaggregation"][pool].update(changes)
    return doc


def _by(manifests: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (m,) = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
    return m


def _container(deploy: dict[str, Any]) -> dict[str, Any]:
    (c,) = deploy["spec"]["template"]["spec"]["containers"]
    return c


def _flag(args: list[str], flag: str) -> str:
    return args[len(args) - 1 - args[::-1].index(flag) + 1]  # the last one wins, as argparse reads them


def test_the_example_renders_both_pools_wired_to_each_other() -> None:
    cfg = OperatorConfig()
    out = reconcile(parse_endpoint(EXAMPLE), cfg)
    decode, prefill = _by(out, "Deployment", NAME), _by(out, "Deployment", f"{NAME}-prefill")
    d, p = _container(decode), _container(prefill)
    # Decode: the endpoint's serving pods, its KV receiver on the pod's IP, its hop to the prefill Service.
    assert decode["spec"]["template"]["metadata"]["labels"]["sluice.dev/role"] == "serving"
    assert "replicas" not in decode["spec"]  # autoscaled: KEDA's
    assert _flag(d["args"], "--kv-role") == "decode"
    assert _flag(d["args"], "--kv-host") == "$(POD_IP)"
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in d["env"]
    assert {"name": "kv", "containerPort": int(_flag(d["args"], "--kv-port")), "protocol": "TCP"} in d["ports"]
    assert _flag(d["args"], "--prefill-url") == f"http://{NAME}-prefill.default.svc.{cfg.cluster_domain}"
    assert _flag(d["args"], "--kv-offload-bytes") == "1GiB"
    assert _flag(d["args"], "--prefill-min-prompt-tokens") == "256"
    assert d["resources"]["requests"] == {"cpu": "2", "memory": "4Gi"}
    # Prefill: its own role, resources and flags over the endpoint's.
    assert prefill["spec"]["replicas"] == 1
    assert prefill["spec"]["template"]["metadata"]["labels"]["sluice.dev/role"] == "prefill"
    assert _flag(p["args"], "--kv-role") == "prefill" and "--prefill-url" not in p["args"]
    assert _flag(p["args"], "--max-num-batched-tokens") == "4096"
    assert "--max-num-batched-tokens" not in d["args"]
    assert p["resources"]["requests"]["cpu"] == "4"
    # The same model, dtype and engine flags in both (one ConfigMap).
    for flag in ("--model", "--served-model-name", "--dtype", "--max-model-len", "--kv-cache-memory"):
        assert _flag(d["args"], flag) == _flag(p["args"], flag), flag
    # Services: the endpoint's selects decode pods only; the prefill one, prefill pods only.
    assert _by(out, "Service", NAME)["spec"]["selector"]["sluice.dev/role"] == "serving"
    svc = _by(out, "Service", f"{NAME}-prefill")
    assert svc["spec"]["selector"]["sluice.dev/role"] == "prefill"
    assert svc["metadata"]["labels"]["sluice.dev/role"] == "prefill"  # the gateway leaves its slices out
    assert _by(out, "PodDisruptionBudget", f"{NAME}-prefill")["spec"]["selector"]["matchLabels"][
        "sluice.dev/role"] == "prefill"
    # One ScaledObject, the decode pool's (prefill has a fixed count), on requests carried per replica.
    (so,) = [m for m in out if m["kind"] == "ScaledObject"]
    assert so["spec"]["scaleTargetRef"]["name"] == NAME
    (trigger,) = so["spec"]["triggers"]
    assert "sluice_num_requests_running" in trigger["metadata"]["query"]
    assert 'sluice_dev_role="serving"' in trigger["metadata"]["query"]
    assert trigger["metadata"]["threshold"] == "16"
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (1, 4)
    # Monitoring scrapes the prefill pool too.
    sm = _by(out, "ServiceMonitor", NAME)
    assert "prefill" in sm["spec"]["selector"]["matchExpressions"][0]["values"]


def test_each_autoscaled_pool_gets_its_own_scaled_object() -> None:
    doc = _doc()
    doc["spec"]["disaggregation"]["prefill"] = {"scaling": {"minReplicas": 1, "maxReplicas": 3,
                                                            "targetPromptTokens": 4096}}
    out = reconcile(parse_endpoint(doc))
    so = _by(out, "ScaledObject", f"{NAME}-prefill")
    assert so["spec"]["scaleTargetRef"]["name"] == f"{NAME}-prefill"
    assert so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["name"] == f"{NAME}-prefill"
    (trigger,) = so["spec"]["triggers"]
    assert trigger["metadata"]["query"].startswith("sum(sluice_num_prompt_tokens_waiting{")
    assert 'sluice_dev_role="prefill"' in trigger["metadata"]["query"]
    assert trigger["metadata"]["threshold"] == "4096"
    assert "replicas" not in _by(out, "Deployment", f"{NAME}-prefill")["spec"]
    assert {m["metadata"]["name"] for m in out if m["kind"] == "ScaledObject"} == {NAME, f"{NAME}-prefill"}


def test_a_pool_flag_change_rolls_that_pool_only() -> None:
    before = reconcile(parse_endpoint(EXAMPLE))
    after = reconcile(parse_endpoint(_doc(prefill={"args": {"max-num-batched-tokens": 8192}})))

    def hash_of(manifests: list[dict[str, Any]], name: str) -> str:
        return _by(manifests, "Deployment", name)["spec"]["template"]["metadata"]["annotations"][
            "sluice.dev/config-hash"]
    assert hash_of(before, f"{NAME}-prefill") != hash_of(after, f"{NAME}-prefill")
    assert hash_of(before, NAME) == hash_of(after, NAME)


MISMATCHED = [
    pytest.param(_doc(decode={"args": {"block-size": 32}}),
                 "disaggregation.prefill and disaggregation.decode must use the same KV block size",
                 id="block-size-differs"),
    pytest.param({**_doc(), "spec": {**_doc()["spec"], "engine": {"args": {"block-size": 32}},
                                     "disaggregation": {"prefill": {"args": {"block-size": 16}}, "decode": {}}}},
                 "must use the same KV block size", id="block-size-differs-from-the-endpoints"),
    pytest.param({**_doc(), "spec": {**_doc()["spec"], "replicas": 2}},
                 "with disaggregation, set replicas or scaling per pool", id="spec-replicas"),
    pytest.param({**_doc(), "spec": {**_doc()["spec"], "parallelism": {"pipeline": 2}}},
                 "disaggregation runs engines of one rank for now", id="pipeline-parallel"),
    pytest.param(_doc(prefill={"scaling": {"maxReplicas": 2}}),
                 "set either replicas (a fixed count) or scaling, not both", id="pool-replicas-and-scaling"),
    pytest.param(_doc(decode={"args": {"kv-role": "both"}}), "'kv-role' is set by the operator",
                 id="pool-sets-the-role"),
]


@pytest.mark.parametrize(("doc", "message"), MISMATCHED)
def test_pools_that_cannot_exchange_blocks_are_refused_by_both_validators(doc, message, schema) -> None:
    with pytest.raises(SpecError) as err:
        parse_endpoint(doc)
    assert message in str(err.value)
    errors = api_server_errors(schema, doc)
    assert errors, "the API server would admit it"
    if "kv-role" not in message:  # the schema's message for an operator-owned key names every allowed flag
        assert any(message in e for e in errors), errors


def test_the_same_block_size_set_in_both_pools_is_admitted(schema) -> None:
    doc = _doc(prefill={"args": {"block-size": 32}}, decode={"args": {"block-size": "32"}})
    ep = parse_endpoint(doc)
    assert api_server_errors(schema, doc) == []
    out = reconcile(ep)
    for name in (NAME, f"{NAME}-prefill"):
        assert _flag(_container(_by(out, "Deployment", name))["args"], "--block-size") == "32"


# -- the KV key (issue 39) ----------------------------------------------------------------------------------
def test_both_pools_read_the_endpoints_kv_secret() -> None:
    """Both pools mount the Secret `<name>-kv` read-only and name its key with --kv-secret-file: the engine
    refuses a KV receiver on the pod's IP without it, and a push without the key is refused."""
    from sluice_operator.disaggregation import KV_SECRET_FILE, kv_secret_name

    ep = parse_endpoint(EXAMPLE)
    out = reconcile(ep)
    assert kv_secret_name(ep) == f"{NAME}-kv"
    assert "Secret" not in {m["kind"] for m in out}  # made once by the loop, never rendered (a random key)
    for name in (NAME, f"{NAME}-prefill"):
        pod = _by(out, "Deployment", name)["spec"]["template"]["spec"]
        c = _container(_by(out, "Deployment", name))
        assert _flag(c["args"], "--kv-secret-file") == KV_SECRET_FILE == "/etc/sluice-kv/kv-secret"
        (volume,) = [v for v in pod["volumes"] if v["name"] == "kv-secret"]
        assert volume["secret"] == {"secretName": f"{NAME}-kv", "defaultMode": 0o440,
                                    "items": [{"key": "kv-secret", "path": "kv-secret"}]}
        assert {"name": "kv-secret", "mountPath": "/etc/sluice-kv", "readOnly": True} in c["volumeMounts"]
        # Nothing else of the pod mounts it (the fetch containers hold other credentials).
        assert all(m["name"] != "kv-secret" for i in pod.get("initContainers", []) for m in i["volumeMounts"])
    assert reconcile(ep) == out  # pure: the key is not in what reconcile renders, so nothing changes per pass


def test_the_kv_secret_is_a_fresh_random_key_owned_by_the_endpoint() -> None:
    import re

    import kubernetes_validate

    from sluice_operator.disaggregation import kv_secret

    doc = copy.deepcopy(EXAMPLE)
    doc["metadata"]["uid"] = "4f9a51c6-8f0e-4a44-9c1e-2b8d3c1d0e11"
    ep = parse_endpoint(doc)
    first, second = kv_secret(ep), kv_secret(ep)
    for version in ("1.30", kubernetes_validate.latest_version()):
        kubernetes_validate.validate(first, version, strict=True)
    key = first["stringData"]["kv-secret"]
    assert re.fullmatch(r"[0-9a-f]{64}", key) and key != second["stringData"]["kv-secret"]
    assert first["immutable"] is True and first["metadata"]["name"] == f"{NAME}-kv"
    (owner,) = first["metadata"]["ownerReferences"]
    assert (owner["uid"], owner["controller"]) == (doc["metadata"]["uid"], True)  # the garbage collector's
    assert kv_secret(ep, "ab" * 32)["stringData"] == {"kv-secret": "ab" * 32}


# -- the loop on kmock -------------------------------------------------------------------------------------
kmock = pytest.importorskip("kmock")
from kopf_harness import (  # noqa: E402 - needs kmock
    DEPLOY,
    SVC,
    api,
    condition,
    create_endpoint,
    eventually,
    live,
    must,
    operator,
    phase_is,
    serve_kinds,
    status_of,
)
from kube_emulator import ApiServer  # noqa: E402

SO = "keda.sh/v1alpha1/scaledobjects"
SECRET = "v1/secrets"


async def _ready(k8s: Any, name: str, ready: int) -> None:
    await api(k8s, "PATCH", f"/apis/apps/v1/namespaces/default/deployments/{name}/status",
              {"status": {"replicas": ready, "readyReplicas": ready, "updatedReplicas": ready}},
              "application/merge-patch+json")


@pytest.mark.kmock(cls=ApiServer)
@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_disaggregated_endpoint_reconciles_with_both_pools_in_its_status(kmock: Any) -> None:
    k8s = serve_kinds(kmock)
    doc = copy.deepcopy(EXAMPLE)
    doc["metadata"]["namespace"] = "default"
    async with operator(k8s):
        await create_endpoint(k8s, doc)
        wanted = ((DEPLOY, NAME), (DEPLOY, f"{NAME}-prefill"), (SVC, NAME), (SVC, f"{NAME}-prefill"), (SO, NAME))
        await eventually(lambda: must(all(live(k8s, resource, name) is not None for resource, name in wanted)))
        assert live(k8s, SO, f"{NAME}-prefill") is None  # the prefill pool has a fixed count
        # Decode ready first: the endpoint serves (decode engines compute prompts themselves meanwhile).
        await _ready(k8s, NAME, 1)
        st = await eventually(lambda: phase_is(k8s, NAME, "Ready"))
        assert (st["replicas"]["prefillDesired"], st["replicas"]["prefillReady"]) == (1, 0)
        assert "0/1 prefill replicas ready" in condition(st, "Ready")["message"]
        await _ready(k8s, f"{NAME}-prefill", 1)
        st = await eventually(lambda: must(status_of(k8s, NAME)["replicas"].get("prefillReady") == 1)
                              and status_of(k8s, NAME))
        assert "prefill" not in condition(st, "Ready")["message"]
        # The KV key: created once, owned by the endpoint; later passes keep it, a deleted one is made anew.
        secret = live(k8s, SECRET, f"{NAME}-kv")
        assert secret is not None and secret["metadata"]["ownerReferences"][0]["name"] == NAME
        key = secret["stringData"]["kv-secret"]
        await api(k8s, "PATCH", f"/apis/sluice.dev/v1alpha1/namespaces/default/inferenceendpoints/{NAME}",
                  {"spec": {"startupGraceSeconds": 700}}, "application/merge-patch+json")
        await eventually(lambda: must(live(k8s, DEPLOY, NAME)["spec"]["progressDeadlineSeconds"] == 700 + 600))
        assert live(k8s, SECRET, f"{NAME}-kv")["stringData"]["kv-secret"] == key


@pytest.mark.kmock(cls=ApiServer)
@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_mismatched_pools_are_refused_with_the_reason(kmock: Any) -> None:
    """kmock has no CEL (the API server's would refuse it at admission): the operator refuses it the same way."""
    k8s = serve_kinds(kmock)
    bad = _doc(decode={"args": {"block-size": 32}})
    bad["metadata"].update(name="bad-split", namespace="default")
    async with operator(k8s):
        await create_endpoint(k8s, bad)
        st = await eventually(lambda: phase_is(k8s, "bad-split", "Failed"))
    ready = condition(st, "Ready")
    assert ready["reason"] == "InvalidSpec"
    assert "must use the same KV block size" in ready["message"]
    assert live(k8s, DEPLOY, "bad-split") is None and live(k8s, DEPLOY, "bad-split-prefill") is None
