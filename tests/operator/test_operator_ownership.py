"""The kopf loop (kmock, kube_emulator.py) on ownership and lifecycle (issue 14):
- an object of a child's name that the endpoint does not own is never touched, and the status says so;
- a child the API server refuses shows as a condition with the API server's message, and is retried;
- `replicas` -> `scaling` keeps the live replica count (server-side apply's field ownership, emulated);
- `slo`/`cost` edits change the ConfigMap, not the pod template; `rollout` reaches the Deployment;
- the autoscaler's minReplicaCount holds replicas that are still loading.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from sluice_operator.children import HANDOVER_MANAGER

kmock = pytest.importorskip("kmock")
import kube_ssa  # noqa: E402
from kopf_harness import (  # noqa: E402 - needs kmock
    CM,
    DEPLOY,
    ENDPOINT,
    EP,
    NS,
    PR,
    SO,
    SVC,
    api,
    condition,
    create_endpoint,
    create_pod,
    events_of,
    eventually,
    live,
    must,
    must_equal,
    operator,
    operator_fields,
    patch_spec,
    reason_is,
    serve_kinds,
    status_of,
)
from kube_emulator import ApiServer  # noqa: E402

pytestmark = pytest.mark.kmock(cls=ApiServer)
MERGE = "application/merge-patch+json"


@pytest.fixture
def k8s(kmock: Any) -> Any:
    return serve_kinds(kmock)


def collect_garbage(k8s: Any, owner_uid: str) -> list[tuple[str, str]]:
    """The garbage collector's part once the owner is gone: delete every object with an ownerReference to it."""
    gone = []
    for (res, _ns, name), obj in list(k8s.objects.items()):
        refs = (obj.raw.get("metadata") or {}).get("ownerReferences") or [] if not obj.deleted else []
        if any(r.get("uid") == owner_uid for r in refs):
            obj.delete()
            gone.append((res.plural, name))
    return gone


def endpoint_doc(name: str, **spec: Any) -> dict[str, Any]:
    doc = copy.deepcopy(ENDPOINT)
    doc["metadata"]["name"] = name
    doc["spec"].update(spec)
    return {**doc, "spec": {k: v for k, v in doc["spec"].items() if v is not None}}


# -- ownership -------------------------------------------------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_an_unowned_object_of_the_same_name_is_left_alone(k8s: Any) -> None:
    theirs = {"apiVersion": "v1", "kind": "Service",
              "metadata": {"name": "smollm2", "namespace": NS, "labels": {"app": "billing"}},
              "spec": {"selector": {"app": "billing"}, "ports": [{"port": 443, "targetPort": 8443}]}}
    await api(k8s, "POST", f"/api/v1/namespaces/{NS}/services", theirs)
    before = copy.deepcopy(live(k8s, SVC, "smollm2"))
    async with operator(k8s):
        uid = (await create_endpoint(k8s, endpoint_doc("smollm2")))["metadata"]["uid"]
        st = await eventually(lambda: reason_is(k8s, "smollm2", "Ready", "NameConflict"))
        await eventually(lambda: must(("Warning", "NameConflict") in events_of(k8s, "smollm2")))
        assert live(k8s, DEPLOY, "smollm2") is not None  # the rest is applied
        assert live(k8s, SVC, "smollm2") == before  # byte for byte: no selector, label or ownerReference of ours
    ready = condition(st, "Ready")
    assert (st["phase"], ready["status"]) == ("Failed", "False")
    assert ready["message"].startswith("Service default/smollm2 already exists, with no controller, not this "
                                       "endpoint: the operator leaves it untouched")
    assert (condition(st, "Reconciled")["status"], condition(st, "Reconciled")["reason"]) == ("False", "NameConflict")

    # Deleting the endpoint: the garbage collector takes what the endpoint owns, and only that.
    await api(k8s, "DELETE", f"/apis/sluice.dev/v1alpha1/namespaces/{NS}/inferenceendpoints/smollm2")
    gone = collect_garbage(k8s, uid)
    assert ("deployments", "smollm2") in gone and ("services", "smollm2") not in gone
    assert live(k8s, SVC, "smollm2") == before


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_refused_child_is_a_condition_with_the_api_servers_message(k8s: Any) -> None:
    k8s.refuse = {("deployments", "refused"): "spec.template.spec.containers[0].resources.requests: Invalid value: "
                                                "\"9\": must be less than or equal to cpu limit of 2"}
    async with operator(k8s):
        await create_endpoint(k8s, endpoint_doc("refused"))
        st = await eventually(lambda: reason_is(k8s, "refused", "Ready", "ApplyFailed"))
        assert live(k8s, SVC, "refused") is not None  # the other children are still applied
        message = condition(st, "Reconciled")["message"]
        assert message == ('Deployment refused: Deployment "refused" is invalid: spec.template.spec.containers[0]'
                           '.resources.requests: Invalid value: "9": must be less than or equal to cpu limit of 2')
        assert condition(st, "Ready")["message"] == message and st["phase"] == "Failed"
        await eventually(lambda: must(("Warning", "ApplyFailed") in events_of(k8s, "refused")))
        # The API server accepts it again (a quota raised, a webhook fixed): the retry goes through.
        k8s.refuse = {}
        st = await eventually(lambda: reason_is(k8s, "refused", "Reconciled", "Applied"), timeout=15)
    assert live(k8s, DEPLOY, "refused") is not None
    assert condition(st, "Ready")["reason"] != "ApplyFailed"


# -- lifecycle ---------------------------------------------------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_replicas_to_scaling_keeps_the_live_count(k8s: Any) -> None:
    async with operator(k8s):
        await create_endpoint(k8s, endpoint_doc("keep", scaling=None, replicas=3))
        await eventually(lambda: must_equal(live(k8s, DEPLOY, "keep")["spec"]["replicas"], 3))
        assert ("spec", "replicas") in operator_fields(live(k8s, DEPLOY, "keep"))

        await patch_spec(k8s, "keep", {"replicas": None, "scaling": {"minReplicas": 1, "maxReplicas": 5}})
        await eventually(lambda: must(live(k8s, SO, "keep") is not None))
        await eventually(lambda: must(("spec", "replicas") not in operator_fields(live(k8s, DEPLOY, "keep"))))
        deploy = live(k8s, DEPLOY, "keep")
        assert deploy["spec"]["replicas"] == 3  # not reset to the API server's default of 1
        assert kube_ssa.owners(deploy)[HANDOVER_MANAGER, "Apply"] == {("spec", "replicas")}

        # KEDA's HPA scales: it owns the count from then on, and the operator's passes leave it alone.
        await api(k8s, "PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/keep?fieldManager=kube-controller-manager",
                  {"spec": {"replicas": 4}}, MERGE)
        owners = kube_ssa.owners(live(k8s, DEPLOY, "keep"))
        assert (HANDOVER_MANAGER, "Apply") not in owners
        await patch_spec(k8s, "keep", {"engine": {"maxModelLen": 1024}})  # an applying pass
        await eventually(lambda: must_equal(status_of(k8s, "keep").get("observedGeneration"), 3))
        assert live(k8s, DEPLOY, "keep")["spec"]["replicas"] == 4


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_slo_and_cost_edits_do_not_touch_the_pod_template(k8s: Any) -> None:
    async with operator(k8s):
        await create_endpoint(k8s, endpoint_doc("steady", slo={"ttftMs": 500}, cost={"gpuHourUSD": 2}))
        await eventually(lambda: must(live(k8s, PR, "steady") is not None))
        template = copy.deepcopy(live(k8s, DEPLOY, "steady")["spec"]["template"])
        rules = copy.deepcopy(live(k8s, PR, "steady")["spec"])
        await patch_spec(k8s, "steady", {"slo": {"ttftMs": 200, "target": 0.95}, "cost": {"gpuHourUSD": 3.5}})
        await eventually(lambda: must('"slo-ttft-ms": 200' in live(k8s, CM, "steady-engine")["data"]["objectives.json"]))
        await eventually(lambda: must(live(k8s, PR, "steady")["spec"] != rules))  # the burn-rate alerts follow
        await eventually(lambda: must_equal(status_of(k8s, "steady").get("observedGeneration"), 2))
        assert live(k8s, DEPLOY, "steady")["spec"]["template"] == template  # no rollout, no model reloaded


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_rollout_setting_reaches_the_deployment(k8s: Any) -> None:
    async with operator(k8s):
        await create_endpoint(k8s, endpoint_doc("roll"))
        await eventually(lambda: must(live(k8s, DEPLOY, "roll") is not None))
        assert live(k8s, DEPLOY, "roll")["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
        await patch_spec(k8s, "roll", {"rollout": {"maxSurge": 1, "maxUnavailable": 0}})
        await eventually(lambda: must_equal(live(k8s, DEPLOY, "roll")["spec"]["strategy"]["rollingUpdate"],
                                            {"maxSurge": 1, "maxUnavailable": 0}))


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_loading_replica_holds_the_autoscalers_minimum(k8s: Any) -> None:
    deploy = f"/apis/apps/v1/namespaces/{NS}/deployments/cold"
    async with operator(k8s):
        await create_endpoint(k8s, endpoint_doc("cold", scaling={"minReplicas": 0, "maxReplicas": 3}))
        await eventually(lambda: must_equal(live(k8s, SO, "cold")["spec"]["minReplicaCount"], 0))
        # KEDA starts a replica for a held request; its pod runs and loads the model (not Ready yet).
        await create_pod(k8s, "cold-1", "cold", scheduled=("True", "", ""))
        await api(k8s, "PATCH", f"/api/v1/namespaces/{NS}/pods/cold-1", {"status": {
            "phase": "Running", "containerStatuses": [{"name": "engine", "ready": False, "restartCount": 0,
                                                       "state": {"running": {}}}]}}, MERGE)
        await api(k8s, "PATCH", f"{deploy}/status", {"status": {"replicas": 1, "readyReplicas": 0}}, MERGE)
        await eventually(lambda: must_equal(live(k8s, SO, "cold")["spec"]["minReplicaCount"], 1))
        # Loaded: the hold is released, and the usual scale-down delay applies.
        await api(k8s, "PATCH", f"/api/v1/namespaces/{NS}/pods/cold-1", {"status": {
            "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}]}}, MERGE)
        await api(k8s, "PATCH", f"{deploy}/status", {"status": {"replicas": 1, "readyReplicas": 1}}, MERGE)
        await eventually(lambda: must_equal(live(k8s, SO, "cold")["spec"]["minReplicaCount"], 0))
    assert live(k8s, EP, "cold")["spec"]["scaling"]["minReplicas"] == 0  # the spec is never written
