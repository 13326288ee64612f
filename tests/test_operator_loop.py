"""The real kopf loop against kmock, an in-memory Kubernetes API emulator (by kopf's author), in-process.

kmock stores objects as plain JSON and merges every PATCH. `ApiServer` adds the API server's bookkeeping that
kopf relies on: a uid on create, a new resourceVersion on every write (kopf guards its patches with a
JSON-patch test of resourceVersion and waits for the version it wrote), and a name from `generateName` (kopf
posts its events with one; kmock alone would file them all under one missing name, and the second would
collide). It can also leave resource types out, as a cluster without a CRD does. The test plays the rest: it
bumps metadata.generation on a spec change, patches a Deployment's status as the Deployment controller would,
creates pods as the scheduler and kubelet leave them, and writes a ScaledObject's status as KEDA would.
Everything else is the operator as deployed: kopf's watches and event posting, our handlers, HTTP to the API.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import kopf
import pytest

from sluice_operator.config import OperatorConfig
from sluice_operator.handlers import Loop, build_registry, operator_settings
from sluice_operator.reconcile import reconcile
from sluice_operator.spec import parse_endpoint
from sluice_operator.status import endpoint_status

kmock = pytest.importorskip("kmock")
_versions = itertools.count(1)


class ApiServer(kmock.KubernetesEmulator):
    absent: frozenset[str] = frozenset()  # plurals served as unknown resource types (no CRD installed)

    async def _handle(self, request: Any) -> Any:
        data = request.data
        if request.resource is not None and request.resource.plural in self.absent:
            raise kmock.KubernetesResourceNotFoundError()
        if request.resource is not None and request.action in (kmock.action.CREATE, kmock.action.UPDATE):
            version = str(next(_versions))
            if isinstance(data, dict):
                meta = data.setdefault("metadata", {})
                meta["resourceVersion"] = version
                if request.action == kmock.action.CREATE:
                    meta.setdefault("uid", str(uuid.uuid4()))
                    if not meta.get("name") and meta.get("generateName"):
                        meta["name"] = meta["generateName"] + secrets.token_hex(3)
            elif isinstance(data, list):  # a JSON patch: its own test ops come first
                data.append({"op": "add", "path": "/metadata/resourceVersion", "value": version})
        return await super()._handle(request)


pytestmark = pytest.mark.kmock(cls=ApiServer)

NS = "default"
EP = "sluice.dev/v1alpha1/inferenceendpoints"
DEPLOY, CM, SVC = "apps/v1/deployments", "v1/configmaps", "v1/services"
PDB, SO, SM = "policy/v1/poddisruptionbudgets", "keda.sh/v1alpha1/scaledobjects", "monitoring.coreos.com/v1/servicemonitors"
PR = "monitoring.coreos.com/v1/prometheusrules"
CHILDREN = (CM, DEPLOY, SVC, PDB, SO, SM, PR)

ENDPOINT = {
    "apiVersion": "sluice.dev/v1alpha1",
    "kind": "InferenceEndpoint",
    "metadata": {"name": "smollm2", "namespace": NS},
    "spec": {
        "model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct", "servedName": "smollm2"},
        "engine": {"maxModelLen": 2048},
        "accelerator": {"type": "cpu"},
        "scaling": {"minReplicas": 1, "maxReplicas": 3},
    },
}


# -- the emulator and the operator ------------------------------------------------------------------------
@pytest.fixture
def k8s(kmock: Any) -> Any:
    kmock.resources.load_bundled()  # built-in kinds (namespaces, deployments, ...) as a k3s server lists them
    verbs = {"get", "list", "watch", "create", "patch", "update", "delete"}
    for key, kind in ((EP, "InferenceEndpoint"), (SO, "ScaledObject"), (SM, "ServiceMonitor"), (PR, "PrometheusRule"),
                      ("leaderworkerset.x-k8s.io/v1/leaderworkersets", "LeaderWorkerSet")):
        kmock.resources[key] = {"kind": kind, "namespaced": True, "verbs": verbs, "subresources": {"status"}}
    kmock.objects["v1/namespaces", None, NS] = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}
    return kmock


@contextlib.asynccontextmanager
async def operator(k8s: Any, resync_seconds: float = 1.0, cfg: OperatorConfig | None = None) -> AsyncIterator[None]:
    """kopf.operator() as a task of this event loop, logged in to the emulator, with the settings `cfg`."""
    server = str(k8s.url).rstrip("/")
    registry = build_registry(Loop(cfg or OperatorConfig()), namespaces=[NS], login=lambda **_: kopf.ConnectionInfo(server=server),
                              resync_seconds=resync_seconds, retry_seconds=0.5)
    settings = operator_settings()
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(kopf.operator(registry=registry, settings=settings, standalone=True,
                                             namespaces=[NS], stop_flag=stop, ready_flag=ready))
    await asyncio.wait_for(ready.wait(), 10)
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


async def api(k8s: Any, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
    """A client's request (kubectl's part)."""
    async with aiohttp.ClientSession() as s, s.request(
            method, str(k8s.url).rstrip("/") + path, json=body, headers={"Content-Type": content_type}) as r:
        assert r.status < 400, await r.text()
        return await r.json()


def _path(res: Any) -> str:
    return "/".join(p for p in (res.group, res.version, res.plural) if p)


def live(k8s: Any, resource: str, name: str) -> dict[str, Any] | None:
    for (res, ns, n), obj in k8s.objects.items():
        if (_path(res), ns, n) == (resource, NS, name) and not obj.deleted:
            return obj.raw
    return None


def all_live(k8s: Any) -> list[tuple[str, str]]:
    """Every live object but events (they pile up by design)."""
    return sorted((_path(res), name) for (res, _, name), obj in k8s.objects.items()
                  if not obj.deleted and _path(res) != "v1/events")


async def eventually(check: Callable[[], Any], timeout: float = 10.0) -> Any:
    """Poll `check` (which asserts) until it passes; the last failure explains a timeout."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except (AssertionError, KeyError, TypeError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def create_endpoint(k8s: Any, doc: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    doc["metadata"]["generation"] = 1  # the API server's part, as is the generation bump in patch_spec
    return await api(k8s, "POST", f"/apis/sluice.dev/v1alpha1/namespaces/{NS}/inferenceendpoints", doc)


async def patch_spec(k8s: Any, name: str, spec: dict[str, Any]) -> None:
    gen = live(k8s, EP, name)["metadata"]["generation"]
    await api(k8s, "PATCH", f"/apis/sluice.dev/v1alpha1/namespaces/{NS}/inferenceendpoints/{name}",
              {"spec": spec, "metadata": {"generation": gen + 1}}, "application/merge-patch+json")


def status_of(k8s: Any, name: str) -> dict[str, Any]:
    return live(k8s, EP, name).get("status") or {}


def phase_is(k8s: Any, name: str, phase: str) -> dict[str, Any]:
    st = status_of(k8s, name)
    assert st.get("phase") == phase, st
    return st


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == type_)


def reason_is(k8s: Any, name: str, type_: str, reason: str) -> dict[str, Any]:
    st = status_of(k8s, name)
    assert condition(st, type_)["reason"] == reason, st
    return st


def events_of(k8s: Any, name: str) -> list[tuple[str, str]]:
    """(type, reason) of the events about an endpoint, in the order they were posted (kopf's own left out)."""
    out = []
    for (res, _, _), obj in k8s.objects.items():
        if _path(res) != "v1/events" or obj.deleted:
            continue
        ev = obj.raw
        if ev["involvedObject"].get("name") == name:
            if ev["involvedObject"].get("kind") == "InferenceEndpoint" and ev["reason"] != "Logging":
                out.append((ev["type"], ev["reason"]))
    return out


async def create_pod(k8s: Any, pod: str, endpoint: str, role: str = "serving",
                     scheduled: tuple[str, str, str] | None = None) -> None:
    """A pod of the endpoint's workload, as the ReplicaSet controller and the scheduler leave it."""
    status: dict[str, Any] = {"phase": "Pending"}
    if scheduled:
        status["conditions"] = [{"type": "PodScheduled", "status": scheduled[0], "reason": scheduled[1],
                                 "message": scheduled[2]}]
    await api(k8s, "POST", f"/api/v1/namespaces/{NS}/pods", {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": pod, "namespace": NS, "labels": {
            "sluice.dev/endpoint": endpoint, "sluice.dev/role": role, "sluice.dev/serves": "true"}},
        "spec": {"containers": [{"name": "engine", "image": "sluice-engine"}]},
        "status": status})


def engine_args(deploy: dict[str, Any]) -> list[str]:
    return next(c for c in deploy["spec"]["template"]["spec"]["containers"] if c["name"] == "engine")["args"]


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
        await eventually(lambda: _assert(("Warning", "InsufficientCapacity") in events_of(k8s, name)))

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
        await eventually(lambda: _assert(("Warning", "AutoscalerFallback") in events_of(k8s, name)))
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
        await eventually(lambda: _assert(live(k8s, DEPLOY, name) is not None))
        assert engine_args(live(k8s, DEPLOY, name))[-1]  # the full manifest, not a stub
        before = all_live(k8s)

    # (d) a restarted operator converges: same objects, no duplicates, status still right.
    await api(k8s, "DELETE", f"/api/v1/namespaces/{NS}/services/{name}")  # drift while it was down
    async with operator(k8s):
        await eventually(lambda: _assert_eq(all_live(k8s), before))
        await eventually(lambda: _assert_eq(status_of(k8s, name)["observedGeneration"], 2))
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
    await eventually(lambda: _assert(("Warning", "Failed") in events_of(k8s, "broken")))


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_loop_warm_pool_scaled_to_zero_is_idle(k8s: Any) -> None:
    doc = copy.deepcopy(ENDPOINT)
    doc["metadata"]["name"] = "cold"
    doc["spec"]["scaling"] = {"minReplicas": 0, "maxReplicas": 2, "warmPool": {"replicas": 1}}
    async with operator(k8s):
        await create_endpoint(k8s, doc)
        await eventually(lambda: _assert(live(k8s, SM, "cold") is not None))  # the last child applied
        warm, serving = live(k8s, DEPLOY, "cold-warm"), live(k8s, DEPLOY, "cold")
        assert warm["spec"]["replicas"] == 1 and "replicas" not in serving["spec"]
        assert live(k8s, SVC, "cold-warm")["spec"]["selector"]["sluice.dev/role"] == "standby"
        assert live(k8s, SVC, "cold")["spec"]["selector"]["sluice.dev/role"] == "serving"
        # KEDA scales the serving Deployment to zero; the warm pool stays loaded.
        await api(k8s, "PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/cold", {"spec": {"replicas": 0}},
                  "application/merge-patch+json")
        await api(k8s, "PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/cold-warm/status",
                  {"status": {"replicas": 1, "readyReplicas": 1}}, "application/merge-patch+json")
        st = await eventually(lambda: phase_is(k8s, "cold", "Idle"))
        await eventually(lambda: _assert_eq(status_of(k8s, "cold")["replicas"],
                                            {"desired": 0, "ready": 0, "standby": 1}))
        st = status_of(k8s, "cold")
        assert (condition(st, "Ready")["status"], condition(st, "Ready")["reason"]) == ("False", "ScaledToZero")
        assert "1 warm-pool pod ready" in condition(st, "Ready")["message"]
        assert (condition(st, "Scheduled")["status"], condition(st, "Scheduled")["reason"]) == ("True", "ScaledToZero")
        await eventually(lambda: _assert(("Normal", "Idle") in events_of(k8s, "cold")))


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
def _assert(ok: bool) -> bool:
    assert ok
    return ok


def _assert_eq(a: Any, b: Any) -> bool:
    assert a == b, f"{a!r} != {b!r}"
    return True


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
    assert kinds == ["ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "ScaledObject", "ServiceMonitor",
                     "PrometheusRule"]
