"""The shared model cache through the real kopf loop against kmock (test_operator_loop.py explains the emulator).

Two endpoints of one model and revision: one claim and one Job, co-owned by both; both held at zero replicas
while it downloads (status: Downloading, with the bytes the fetch pod's log reports); the Job completes (the
test plays the Job controller) and both scale up; each endpoint that stops using the cache lets go of it, and
the last one deletes it.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import test_operator_loop
from test_operator_loop import (
    DEPLOY,
    ENDPOINT,
    NS,
    ApiServer,
    api,
    condition,
    create_endpoint,
    eventually,
    live,
    operator,
    patch_spec,
    status_of,
)

from sluice_operator.apply import STRATEGIC_CONTENT_TYPE
from sluice_operator.model_cache import COMPLETE_ANNOTATION, shared_cache_name
from sluice_operator.spec import parse_endpoint

kmock = pytest.importorskip("kmock")
JOB, PVC = "batch/v1/jobs", "v1/persistentvolumeclaims"


class StrategicApiServer(ApiServer):
    """kmock merges every PATCH as JSON (a list replaces the old one). The API server merges ownerReferences in
    a strategic merge patch by uid, and `$patch: delete` removes one: emulated here, on the stored object."""

    async def _handle(self, request: Any) -> Any:
        if (request.resource is not None and request.action == kmock.action.UPDATE and request.name
                and STRATEGIC_CONTENT_TYPE in (request.headers.get("Content-Type") or "")
                and isinstance(request.data, dict) and "ownerReferences" in request.data.get("metadata", {})):
            stored = self.objects[request.resource, request.namespace, request.name]
            refs = [r for r in (stored.raw["metadata"].get("ownerReferences") or [])]
            for entry in request.data["metadata"]["ownerReferences"]:
                refs = [r for r in refs if r["uid"] != entry["uid"]]
                if entry.get("$patch") != "delete":
                    refs.append(entry)
            request.data["metadata"]["ownerReferences"] = refs
        return await super()._handle(request)


pytestmark = pytest.mark.kmock(cls=StrategicApiServer)


@pytest.fixture
def k8s(kmock: Any) -> Any:
    """The emulator as test_operator_loop sets it up (batch/v1 jobs and persistentvolumeclaims are built in)."""
    return test_operator_loop.k8s.__wrapped__(kmock)


def shared_endpoint(name: str, **cache: Any) -> dict[str, Any]:
    doc = copy.deepcopy(ENDPOINT)
    doc["metadata"]["name"] = name
    doc["spec"].pop("scaling")
    doc["spec"]["replicas"] = 2
    doc["spec"]["model"] = {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct", "revision": "main",
                            "servedName": name, "cache": {"type": "shared", "size": "2Gi", **cache}}
    return doc


CACHE = shared_cache_name(parse_endpoint(shared_endpoint("x")).spec.model)


def owners(k8s: Any, resource: str) -> set[str]:
    obj = live(k8s, resource, CACHE)
    assert obj is not None, f"{resource} {CACHE} missing"
    return {r["name"] for r in obj["metadata"].get("ownerReferences") or []}


def _check(ok: bool, what: Any = None) -> bool:
    assert ok, what
    return ok


@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_two_endpoints_share_one_download_and_let_go_of_it(k8s: Any) -> None:
    # The fetch pod's log, as the kubelet serves it: the operator reads the newest progress line.
    k8s["get /api/v1/namespaces/default/pods/fetch-1/log"] << b"sluice-fetch: 1048576 bytes\nsluice-fetch: 52428800 bytes\n"
    async with operator(k8s):
        await create_endpoint(k8s, shared_endpoint("chat-a"))
        await create_endpoint(k8s, shared_endpoint("chat-b"))

        # One claim and one Job, co-owned (never controlled) by both endpoints.
        await eventually(lambda: _check(owners(k8s, JOB) == {"chat-a", "chat-b"} == owners(k8s, PVC)))
        jobs = [n for (res, _, n), o in k8s.objects.items() if res.plural == "jobs" and not o.deleted]
        claims = [n for (res, _, n), o in k8s.objects.items() if res.plural == "persistentvolumeclaims" and not o.deleted]
        assert jobs == [CACHE] and claims == [CACHE]
        for res in (JOB, PVC):
            assert not any(r["controller"] for r in live(k8s, res, CACHE)["metadata"]["ownerReferences"])

        # Both held at zero while it downloads; the status says so, with the bytes from the fetch pod's log.
        for name in ("chat-a", "chat-b"):
            await eventually(lambda name=name: _check(live(k8s, DEPLOY, name)["spec"]["replicas"] == 0))
        await api(k8s, "POST", f"/api/v1/namespaces/{NS}/pods", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "fetch-1", "namespace": NS, "creationTimestamp": "2026-01-01T00:00:00Z",
                         "labels": {"sluice.dev/model-cache": CACHE.removeprefix("sluice-model-")}},
            "spec": {"containers": [{"name": "fetch-model", "image": "sluice-engine"}]},
            "status": {"phase": "Running"}})

        def downloading(name: str) -> dict[str, Any]:
            st = status_of(k8s, name)
            model_ready = condition(st, "ModelReady")
            assert (st["phase"], model_ready["status"], model_ready["reason"]) == ("Loading", "False", "Downloading"), st
            assert "50.0 MiB so far" in model_ready["message"], model_ready
            return st

        await eventually(lambda: downloading("chat-a"))
        await eventually(lambda: downloading("chat-b"))

        # The Job controller's part: the download completes. Both endpoints scale up; the claim remembers.
        await api(k8s, "PATCH", f"/apis/batch/v1/namespaces/{NS}/jobs/{CACHE}/status", {"status": {
            "succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}}, "application/merge-patch+json")
        for name in ("chat-a", "chat-b"):
            await eventually(lambda name=name: _check(live(k8s, DEPLOY, name)["spec"]["replicas"] == 2))
            await eventually(lambda name=name: _check(
                condition(status_of(k8s, name), "ModelReady")["reason"] != "Downloading", status_of(k8s, name)))
        annotations = live(k8s, PVC, CACHE)["metadata"]["annotations"]
        assert annotations[COMPLETE_ANNOTATION] == "true"

        # chat-b moves to a per-pod cache: it lets go; chat-a keeps the cache.
        await patch_spec(k8s, "chat-b", {"model": {"cache": {"type": "emptyDir", "size": None,
                                                              "storageClassName": None}}})
        await eventually(lambda: _check(owners(k8s, JOB) == {"chat-a"} == owners(k8s, PVC)))
        # chat-a, the last user, moves too: the claim and the Job are deleted.
        await patch_spec(k8s, "chat-a", {"model": {"cache": {"type": "emptyDir", "size": None,
                                                              "storageClassName": None}}})
        await eventually(lambda: _check(live(k8s, JOB, CACHE) is None and live(k8s, PVC, CACHE) is None))


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_complete_claim_is_never_downloaded_again(k8s: Any) -> None:
    """The Job of a finished download is deleted: a new endpoint of that model starts at once, with no Job."""
    async with operator(k8s):
        await create_endpoint(k8s, shared_endpoint("first"))
        await eventually(lambda: _check(live(k8s, JOB, CACHE) is not None))
        await api(k8s, "PATCH", f"/apis/batch/v1/namespaces/{NS}/jobs/{CACHE}/status", {"status": {
            "succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}}, "application/merge-patch+json")
        await eventually(lambda: _check(
            (live(k8s, PVC, CACHE)["metadata"].get("annotations") or {}).get(COMPLETE_ANNOTATION) == "true"))
        await api(k8s, "DELETE", f"/apis/batch/v1/namespaces/{NS}/jobs/{CACHE}")
        await create_endpoint(k8s, shared_endpoint("second"))
        await eventually(lambda: _check(live(k8s, DEPLOY, "second") is not None
                                        and live(k8s, DEPLOY, "second")["spec"]["replicas"] == 2))
        await eventually(lambda: _check(owners(k8s, PVC) == {"first", "second"}))
        assert live(k8s, JOB, CACHE) is None
