"""The emulator's bookkeeping (kube_emulator.py) that the operator's loop and benchmarks/operator_scale.py rely
on: no-op writes are invisible to watchers, and a server that does not record requests forgets them."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

pytest.importorskip("kmock")
from kopf_harness import NS, api, serve_kinds  # noqa: E402
from kube_emulator import ApiServer  # noqa: E402

pytestmark = [pytest.mark.kmock(cls=ApiServer), pytest.mark.asyncio, pytest.mark.timeout(30)]
CM = f"/api/v1/namespaces/{NS}/configmaps"


async def _watch_events(url: str, seconds: float) -> list[dict[str, Any]]:
    """What a watch on configmaps sees within `seconds`."""
    events: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as s, s.get(url + CM, params={"watch": "true"}) as r:
        try:
            async with asyncio.timeout(seconds):
                async for line in r.content:
                    if line.strip():
                        events.append(json.loads(line))
        except TimeoutError:
            pass
    return events


async def test_a_no_op_write_keeps_the_version_and_tells_no_watcher(kmock: Any) -> None:
    k8s = serve_kinds(kmock)
    url = str(k8s.url).rstrip("/")
    created = await api(k8s, "POST", CM, {"apiVersion": "v1", "kind": "ConfigMap",
                                          "metadata": {"name": "c", "namespace": NS}, "data": {"k": "1"}})
    watch = asyncio.create_task(_watch_events(url, 1.5))
    await asyncio.sleep(0.3)  # the watch is open
    patch = f"{CM}/c?fieldManager=m"
    changed = await api(k8s, "PATCH", patch, {"data": {"k": "2"}}, "application/merge-patch+json")
    assert changed["metadata"]["resourceVersion"] != created["metadata"]["resourceVersion"]
    same = await api(k8s, "PATCH", patch, {"data": {"k": "2"}}, "application/merge-patch+json")
    assert same["metadata"]["resourceVersion"] == changed["metadata"]["resourceVersion"]
    assert same["data"] == {"k": "2"}
    modified = [e for e in await watch if e["type"] == "MODIFIED"]
    assert [e["object"]["data"] for e in modified] == [{"k": "2"}]  # the change alone


async def test_a_server_that_does_not_record_forgets_answered_requests(kmock: Any) -> None:
    k8s = serve_kinds(kmock)
    k8s.record_requests = False
    for i in range(5):
        await api(k8s, "POST", CM, {"apiVersion": "v1", "kind": "ConfigMap",
                                    "metadata": {"name": f"c{i}", "namespace": NS}})
    listed = await api(k8s, "GET", CM)
    assert sorted(o["metadata"]["name"] for o in listed["items"]) == [f"c{i}" for i in range(5)]
    assert len(k8s._requests) == 0  # the history kmock scans per request stays empty
