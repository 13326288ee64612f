"""The kopf loop's test harness: the operator in-process against kmock's emulator (kube_emulator.py), and the
client's, the controllers' and the kubelet's parts the tests play (creating endpoints and pods, patching status).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import kopf
import kube_ssa

from sluice_operator.apply import FIELD_MANAGER
from sluice_operator.config import OperatorConfig
from sluice_operator.handlers import Loop, build_registry, operator_settings

NS = "default"
EP = "sluice.dev/v1alpha1/inferenceendpoints"
DEPLOY, CM, SVC = "apps/v1/deployments", "v1/configmaps", "v1/services"
PDB, SO, SM = "policy/v1/poddisruptionbudgets", "keda.sh/v1alpha1/scaledobjects", "monitoring.coreos.com/v1/servicemonitors"
PR = "monitoring.coreos.com/v1/prometheusrules"
TA = "keda.sh/v1alpha1/triggerauthentications"
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
def serve_kinds(kmock: Any) -> Any:
    """The emulator serving the built-in kinds, the CRDs the operator uses, and the test namespace. It forgets the
    requests it answered (kube_emulator.py: kmock routes each request by scanning all those before it, so a test
    of a minute spent most of its time there); no test asserts on kmock's history of requests."""
    kmock.record_requests = False
    kmock.resources.load_bundled()  # built-in kinds (namespaces, deployments, ...) as a k3s server lists them
    verbs = {"get", "list", "watch", "create", "patch", "update", "delete"}
    for key, kind in ((EP, "InferenceEndpoint"), (SO, "ScaledObject"), (SM, "ServiceMonitor"), (PR, "PrometheusRule"),
                      (TA, "TriggerAuthentication"), ("leaderworkerset.x-k8s.io/v1/leaderworkersets", "LeaderWorkerSet")):
        kmock.resources[key] = {"kind": kind, "namespaced": True, "verbs": verbs, "subresources": {"status"}}
    kmock.objects["v1/namespaces", None, NS] = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}
    return kmock


@contextlib.asynccontextmanager
async def operator(k8s: Any, resync_seconds: float = 1.0, cfg: OperatorConfig | None = None) -> AsyncIterator[None]:
    """kopf.operator() as a task of this event loop, logged in to the emulator."""
    server = str(k8s.url).rstrip("/")
    registry = build_registry(Loop(cfg=cfg or OperatorConfig()), namespaces=[NS], login=lambda **_: kopf.ConnectionInfo(server=server),
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


def operator_fields(obj: dict[str, Any]) -> set[tuple[str, ...]]:
    """The fields the operator's server-side applies own (metadata.managedFields)."""
    return kube_ssa.owners(obj).get((FIELD_MANAGER, "Apply"), set())


def engine_args(deploy: dict[str, Any]) -> list[str]:
    return next(c for c in deploy["spec"]["template"]["spec"]["containers"] if c["name"] == "engine")["args"]



def must(ok: bool) -> bool:
    assert ok
    return ok


def must_equal(a: Any, b: Any) -> bool:
    assert a == b, f"{a!r} != {b!r}"
    return True
