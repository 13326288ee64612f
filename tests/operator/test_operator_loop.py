"""The real kopf loop against kmock, an in-memory Kubernetes API emulator (by kopf's author), in-process.

`ApiServer` (kube_emulator.py) adds the API server's bookkeeping kopf relies on, server-side apply's field
ownership, and can leave resource types out or refuse writes. The test plays the rest: it
bumps metadata.generation on a spec change, patches a Deployment's status as the Deployment controller would,
creates pods as the scheduler and kubelet leave them, and writes a ScaledObject's status as KEDA would.
Everything else is the operator as deployed: kopf's watches and event posting, our handlers, HTTP to the API.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from sluice_operator.config import OperatorConfig
from sluice_operator.reconcile import reconcile
from sluice_operator.spec import parse_endpoint
from sluice_operator.status import endpoint_status

kmock = pytest.importorskip("kmock")
from kopf_harness import (  # noqa: E402 - needs kmock
    CHILDREN,
    CM,
    DEPLOY,
    ENDPOINT,
    EP,
    NS,
    PDB,
    SM,
    SO,
    SVC,
    TA,
    all_live,
    api,
    condition,
    create_endpoint,
    create_pod,
    engine_args,
    events_of,
    eventually,
    live,
    must,
    must_equal,
    operator,
    operator_fields,
    patch_spec,
    phase_is,
    reason_is,
    serve_kinds,
    status_of,
)
from kube_emulator import ApiServer  # noqa: E402

pytestmark = pytest.mark.kmock(cls=ApiServer)


@pytest.fixture
def k8s(kmock: Any) -> Any:
    return serve_kinds(kmock)


# -- the loop -----------------------------------------------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_loop_create_update_recreate_restart(k8s: Any) -> None:
    name = ENDPOINT["metadata"]["name"]
    async with operator(k8s):
        # (a) create: every child applied, owned by the endpoint; status set.
        uid = (await create_endpoint(k8s, ENDPOINT))["metadata"]["uid"]

        def children_applied() -> None:
            for res in CHILDREN:
                obj = live(k8s, res, name if res != CM else f"{name}-engine")
                assert obj is not None, f"{res} missing from {all_live(k8s)}"
                ref = obj["metadata"]["ownerReferences"][0]
                assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("InferenceEndpoint", name, uid, True)
                assert obj["metadata"]["labels"]["sluice.dev/endpoint"] == name

        await eventually(children_applied)
        st = await eventually(lambda: phase_is(k8s, name, "Pending"))
        assert st["observedGeneration"] == 1
        assert st["url"] == OperatorConfig().gateway_url  # autoscaled: reached through the gateway
        assert st["replicas"] == {"desired": 1, "ready": 0}
        assert {c["observedGeneration"] for c in st["conditions"]} == {1}
        assert condition(st, "Ready")["status"] == "False"
        assert condition(st, "ModelReady")["status"] == "False"
        assert condition(st, "Scheduled")["status"] == "Unknown"  # no pod yet
        for type_ in ("AutoscalerReady", "AutoscalerActive", "AutoscalerFallback"):
            assert (condition(st, type_)["status"], condition(st, type_)["reason"]) == ("Unknown", "AwaitingKeda")
        assert live(k8s, EP, name)["spec"] == ENDPOINT["spec"]  # never written by the operator
        assert not live(k8s, EP, name)["metadata"].get("finalizers")  # deletion is left to the GC

        # The scheduler's part: the serving pod fits no node. The operator reads the pods by the endpoint's
        # serving selector and says why nothing starts.
        deploy = f"/apis/apps/v1/namespaces/{NS}/deployments/{name}"
        pod = f"/api/v1/namespaces/{NS}/pods/{name}-7d9f-x1"
        await create_pod(k8s, f"{name}-7d9f-x1", name, scheduled=(
            "False", "Unschedulable", "0/3 nodes are available: 3 Insufficient cpu."))
        await create_pod(k8s, f"{name}-warm-0", name, role="standby")  # not a serving pod: not read
        await api(k8s, "PATCH", f"{deploy}/status", {"status": {"replicas": 1, "readyReplicas": 0}},
                  "application/merge-patch+json")
        st = await eventually(lambda: reason_is(k8s, name, "Ready", "InsufficientCapacity"))
        assert st["phase"] == "Pending"
        scheduled = condition(st, "Scheduled")
        assert (scheduled["status"], scheduled["reason"]) == ("False", "InsufficientCapacity")
        assert scheduled["message"] == "1 of 1 serving pod cannot be scheduled: 0/3 nodes are available: 3 Insufficient cpu."
        await eventually(lambda: must(("Warning", "InsufficientCapacity") in events_of(k8s, name)))

        # The kubelet's part: the pod is placed and the engine starts, then turns ready; the status follows.
        await api(k8s, "PATCH", pod, {"status": {
            "phase": "Running", "conditions": [{"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [{"name": "engine", "ready": False, "state": {"running": {}}}]}},
            "application/merge-patch+json")
        st = await eventually(lambda: phase_is(k8s, name, "Loading"))
        assert (condition(st, "ModelReady")["status"], condition(st, "ModelReady")["reason"]) == ("False", "ModelLoading")
        assert (condition(st, "Scheduled")["status"], condition(st, "Scheduled")["reason"]) == ("True", "PodsScheduled")
        await api(k8s, "PATCH", f"{deploy}/status", {"status": {"readyReplicas": 1, "updatedReplicas": 1}},
                  "application/merge-patch+json")
        st = await eventually(lambda: phase_is(k8s, name, "Ready"))
        assert st["replicas"] == {"desired": 1, "ready": 1}
        assert condition(st, "Ready")["status"] == "True"
        assert (condition(st, "ModelReady")["status"], condition(st, "ModelReady")["reason"]) == ("True", "ModelLoaded")

        # KEDA's part: its conditions on the ScaledObject become the endpoint's, with their reasons.
        so = f"/apis/keda.sh/v1alpha1/namespaces/{NS}/scaledobjects/{name}"
        keda = [{"type": "Ready", "status": "True", "reason": "ScaledObjectReady", "message": "ok"},
                {"type": "Active", "status": "True", "reason": "ScalerActive", "message": "triggers active"},
                {"type": "Fallback", "status": "False", "reason": "NoFallbackFound", "message": "healthy"}]
        await api(k8s, "PATCH", f"{so}/status", {"status": {"conditions": keda}}, "application/merge-patch+json")
        st = await eventually(lambda: reason_is(k8s, name, "AutoscalerActive", "ScalerActive"))
        assert (condition(st, "AutoscalerReady")["status"], condition(st, "AutoscalerReady")["reason"]) == (
            "True", "ScaledObjectReady")
        assert condition(st, "AutoscalerFallback")["status"] == "False"
        keda[2] = {"type": "Fallback", "status": "True", "reason": "FallbackExists", "message": "using fallback"}
        await api(k8s, "PATCH", f"{so}/status", {"status": {"conditions": keda, "health": {
            "s0-prometheus": {"numberOfFailures": 4, "status": "Failing"}}}}, "application/merge-patch+json")
        st = await eventually(lambda: reason_is(k8s, name, "AutoscalerFallback", "FallbackExists"))
        assert condition(st, "AutoscalerFallback")["message"] == (
            "using fallback; failing triggers: s0-prometheus (4 failures)")
        assert st["phase"] == "Ready"  # still serving, at the fallback count

        # Events on the transitions: each phase once, in order, and the warnings.
        await eventually(lambda: must(("Warning", "AutoscalerFallback") in events_of(k8s, name)))
        phases = [r for _, r in events_of(k8s, name) if r in ("Pending", "Loading", "Ready", "Idle", "Failed")]
        assert phases == ["Pending", "Loading", "Ready"]
        assert ("Normal", "Ready") in events_of(k8s, name)

        # (b) spec change: children updated; the ScaledObject the new spec no longer needs is pruned.
        await patch_spec(k8s, name, {"engine": {"maxModelLen": 4096}, "scaling": None, "replicas": 2})

        def updated() -> None:
            d = live(k8s, DEPLOY, name)
            args = engine_args(d)
            assert args[args.index("--max-model-len") + 1] == "4096"
            assert d["spec"]["replicas"] == 2
            assert live(k8s, SO, name) is None
            s = status_of(k8s, name)
            assert s["observedGeneration"] == 2 and s["replicas"] == {"desired": 2, "ready": 1}
            assert not {"AutoscalerReady", "AutoscalerActive", "AutoscalerFallback"} & {c["type"] for c in s["conditions"]}
            assert s["url"] == f"http://{name}.{NS}.svc.cluster.local/v1"  # a fixed count: the Service itself

        await eventually(updated)

        # (c) a deleted child comes back.
        await api(k8s, "DELETE", deploy)
        await eventually(lambda: must(live(k8s, DEPLOY, name) is not None))
        assert engine_args(live(k8s, DEPLOY, name))[-1]  # the full manifest, not a stub
        before = all_live(k8s)

    # (d) a restarted operator converges: same objects, no duplicates, status still right.
    await api(k8s, "DELETE", f"/api/v1/namespaces/{NS}/services/{name}")  # drift while it was down
    async with operator(k8s):
        await eventually(lambda: must_equal(all_live(k8s), before))
        await eventually(lambda: must_equal(status_of(k8s, name)["observedGeneration"], 2))
    # One event per transition, through two operators: no phase is reported twice in a row.
    phases = [r for _, r in events_of(k8s, name) if r in ("Pending", "Loading", "Ready", "Idle", "Failed")]
    assert all(a != b for a, b in zip(phases, phases[1:], strict=False)), phases
    names = [(res, n) for res, n in all_live(k8s)]
    assert len(names) == len(set(names))
    assert sum(1 for res, _ in names if "deployments" in res) == 1


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_loop_invalid_spec_sets_condition_and_creates_nothing(k8s: Any) -> None:
    bad = copy.deepcopy(ENDPOINT)
    bad["metadata"]["name"] = "broken"
    bad["spec"]["replicas"] = 2  # with scaling: the XOR rule (the CRD's CEL would refuse it; kmock has none)
    async with operator(k8s):
        await create_endpoint(k8s, bad)
        st = await eventually(lambda: phase_is(k8s, "broken", "Failed"))
    ready = condition(st, "Ready")
    assert (ready["status"], ready["reason"], ready["observedGeneration"]) == ("False", "InvalidSpec", 1)
    assert "set either replicas (a fixed count) or scaling (autoscaling), not both" in ready["message"]
    assert [n for res, n in all_live(k8s) if "inferenceendpoints" not in res and "namespaces" not in res] == []
    await eventually(lambda: must(("Warning", "Failed") in events_of(k8s, "broken")))


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_loop_refuses_scale_to_zero_without_a_gateway(k8s: Any) -> None:
    """An operator installed without the gateway (chart: gateway.enabled=false) cannot wake an endpoint at
    zero replicas: Ready False with the reason, nothing applied; with minReplicas 1 it serves."""
    no_gateway = OperatorConfig(gateway_scaler_address="", gateway_url="")
    doc = copy.deepcopy(ENDPOINT)
    doc["metadata"]["name"] = "sleepy"
    doc["spec"]["scaling"] = {"minReplicas": 0, "maxReplicas": 2}
    async with operator(k8s, cfg=no_gateway):
        await create_endpoint(k8s, doc)
        st = await eventually(lambda: phase_is(k8s, "sleepy", "Failed"))
        ready = condition(st, "Ready")
        assert (ready["status"], ready["reason"]) == ("False", "ScaleToZeroNeedsGateway")
        assert "scaling.minReplicas is 0, but this operator has no gateway" in ready["message"]
        assert [n for res, n in all_live(k8s) if "inferenceendpoints" not in res and "namespaces" not in res] == []
        await eventually(lambda: must(("Warning", "Failed") in events_of(k8s, "sleepy")))


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_loop_applies_the_trigger_authentication(k8s: Any) -> None:
    """With the gateway's TLS Secret configured, the TriggerAuthentication is applied with the ScaledObject
    that names it, and pruned with it when scaling goes."""
    cfg = OperatorConfig(gateway_scaler_tls_secret="sluice-gateway-scaler-tls")
    doc = copy.deepcopy(ENDPOINT)
    doc["metadata"]["name"] = "guarded"
    async with operator(k8s, cfg=cfg):
        await create_endpoint(k8s, doc)
        await eventually(lambda: must(live(k8s, SM, "guarded") is not None))  # the last child applied
        auth = live(k8s, TA, "guarded-gateway-scaler")
        assert auth["spec"]["secretTargetRef"][0] == {"parameter": "caCert", "name": "sluice-gateway-scaler-tls",
                                                      "key": "ca.crt"}
        push = live(k8s, SO, "guarded")["spec"]["triggers"][1]
        assert push["authenticationRef"] == {"name": "guarded-gateway-scaler"}


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_loop_warm_pool_scaled_to_zero_is_idle(k8s: Any) -> None:
    doc = copy.deepcopy(ENDPOINT)
    doc["metadata"]["name"] = "cold"
    doc["spec"]["scaling"] = {"minReplicas": 0, "maxReplicas": 2, "warmPool": {"replicas": 1}}
    async with operator(k8s):
        await create_endpoint(k8s, doc)
        await eventually(lambda: must(live(k8s, SM, "cold") is not None))  # the last child applied
        warm, serving = live(k8s, DEPLOY, "cold-warm"), live(k8s, DEPLOY, "cold")
        assert warm["spec"]["replicas"] == 1
        # The autoscaled count is left to KEDA: the operator never applies it (1 is the API server's default).
        assert ("spec", "replicas") in operator_fields(warm)
        assert ("spec", "replicas") not in operator_fields(serving)
        assert live(k8s, SVC, "cold-warm")["spec"]["selector"]["sluice.dev/role"] == "standby"
        assert live(k8s, SVC, "cold")["spec"]["selector"]["sluice.dev/role"] == "serving"
        # KEDA scales the serving Deployment to zero; the warm pool stays loaded.
        await api(k8s, "PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/cold", {"spec": {"replicas": 0}},
                  "application/merge-patch+json")
        await api(k8s, "PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/cold-warm/status",
                  {"status": {"replicas": 1, "readyReplicas": 1}}, "application/merge-patch+json")
        st = await eventually(lambda: phase_is(k8s, "cold", "Idle"))
        await eventually(lambda: must_equal(status_of(k8s, "cold")["replicas"],
                                            {"desired": 0, "ready": 0, "standby": 1}))
        st = status_of(k8s, "cold")
        assert (condition(st, "Ready")["status"], condition(st, "Ready")["reason"]) == ("False", "ScaledToZero")
        assert "1 warm-pool pod ready" in condition(st, "Ready")["message"]
        assert (condition(st, "Scheduled")["status"], condition(st, "Scheduled")["reason"]) == ("True", "ScaledToZero")
        await eventually(lambda: must(("Normal", "Idle") in events_of(k8s, "cold")))


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_loop_without_keda_or_the_prometheus_operator(k8s: Any) -> None:
    """A cluster without the optional CRDs: the rest is applied, and the status says what to install."""
    k8s.absent = frozenset({"scaledobjects", "servicemonitors", "prometheusrules"})
    async with operator(k8s):
        await create_endpoint(k8s, ENDPOINT)
        st = await eventually(lambda: reason_is(k8s, "smollm2", "AutoscalerReady", "KedaNotInstalled"))
        for res in (CM, DEPLOY, SVC, PDB):
            assert live(k8s, res, "smollm2" if res != CM else "smollm2-engine") is not None
    assert st["phase"] == "Pending"
    assert condition(st, "AutoscalerReady")["status"] == "False"
    assert "install KEDA" in condition(st, "AutoscalerReady")["message"]
    assert condition(st, "AutoscalerActive")["status"] == "Unknown"


# -- the status fold (pure) ------------------------------------------------------------------------------
def _ep(**spec: Any) -> Any:
    doc = copy.deepcopy(ENDPOINT)
    doc["metadata"] |= {"uid": "u", "generation": 3}
    doc["spec"] |= spec
    return parse_endpoint(doc)


def _deploy(desired: int | None, **status: Any) -> dict[str, Any]:
    spec = {} if desired is None else {"replicas": desired}
    return {"metadata": {}, "spec": spec, "status": status}


@pytest.mark.parametrize(("serving", "phase", "ready_status"), [
    (None, "Pending", "False"),
    (_deploy(1), "Pending", "False"),
    (_deploy(1, replicas=1), "Loading", "False"),
    (_deploy(2, replicas=2, readyReplicas=1), "Ready", "True"),
    (_deploy(0), "Idle", "False"),
    (_deploy(1, replicas=1, conditions=[{"type": "Progressing", "status": "False",
                                         "reason": "ProgressDeadlineExceeded", "message": "stuck"}]), "Failed", "False"),
    (_deploy(2, replicas=2, readyReplicas=1, conditions=[{"type": "ReplicaFailure", "status": "True",
                                                          "reason": "FailedCreate", "message": "quota"}]),
     "Degraded", "True"),
])
def test_status_phases(serving: Any, phase: str, ready_status: str) -> None:
    st = endpoint_status(_ep(), serving=serving, now="2025-01-01T00:00:00Z")
    assert st["phase"] == phase
    assert condition(st, "Ready")["status"] == ready_status
    assert all(c["observedGeneration"] == 3 for c in st["conditions"])


def test_status_keeps_transition_time_while_unchanged() -> None:
    ep = _ep()
    first = endpoint_status(ep, serving=_deploy(1, readyReplicas=1), now="t1")
    again = endpoint_status(ep, serving=_deploy(1, readyReplicas=1), previous=first, now="t2")
    assert condition(again, "Ready")["lastTransitionTime"] == "t1"
    lost = endpoint_status(ep, serving=_deploy(1, replicas=1), previous=again, now="t3")
    assert condition(lost, "Ready")["lastTransitionTime"] == "t3"


def test_children_are_what_reconcile_renders() -> None:
    kinds = [m["kind"] for m in reconcile(_ep())]
    assert kinds == ["ConfigMap", "NetworkPolicy", "Deployment", "Service", "PodDisruptionBudget", "ScaledObject",
                     "ServiceMonitor", "PrometheusRule"]
