"""The operator's policy through the real kopf loop (kmock, the harness of test_operator_loop.py): endpoints
that break it are refused with the field in their status and get nothing applied; once fixed they are served;
and model credentials never reach the serving container of what is applied."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from sluice_operator.config import OperatorConfig

kmock = pytest.importorskip("kmock")
from kopf_harness import (  # noqa: E402 - needs kmock
    CM,
    DEPLOY,
    ENDPOINT,
    all_live,
    condition,
    create_endpoint,
    events_of,
    eventually,
    live,
    must,
    operator,
    patch_spec,
    phase_is,
    serve_kinds,
    status_of,
)
from kube_emulator import ApiServer  # noqa: E402

pytestmark = pytest.mark.kmock(cls=ApiServer)


@pytest.fixture
def k8s(kmock: Any) -> Any:
    return serve_kinds(kmock)


POLICY = OperatorConfig(allowed_image_prefixes=("registry.corp/ml/",), host_path_allowed=False,
                        pod_secret_refs_allowed=False, allowed_secrets=("hf-token",))


def _endpoint(name: str, **spec: Any) -> dict[str, Any]:
    doc = copy.deepcopy(ENDPOINT)
    doc["metadata"]["name"] = name
    doc["spec"].update(copy.deepcopy(spec))
    return doc


# (endpoint name, spec changes, the field the status must name)
REFUSED = [
    ("bad-image", {"engine": {"maxModelLen": 2048, "image": "docker.io/someone/miner:latest"}}, "spec.engine.image"),
    ("bad-hostpath", {"model": {**ENDPOINT["spec"]["model"], "cache": {"type": "hostPath", "path": "/var/lib/kubelet"}}},
     "spec.model.cache.path"),
    ("bad-secret", {"pod": {"env": [{"name": "DB_PASSWORD", "valueFrom": {"secretKeyRef": {"name": "prod-db",
                                                                                           "key": "password"}}}]}},
     "spec.pod.env[0].valueFrom.secretKeyRef.name"),
]


def _children(server: Any, name: str) -> list[tuple[str, str]]:
    return [(res, n) for res, n in all_live(server) if n in (name, f"{name}-engine", f"{name}-warm")
            and "inferenceendpoints" not in res]


@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_policy_violations_are_refused_with_reasons(k8s: Any) -> None:  # noqa: F811 - the fixture
    async with operator(k8s, cfg=POLICY):
        for name, spec, _ in REFUSED:
            await create_endpoint(k8s, _endpoint(name, **spec))
        for name, _, field in REFUSED:
            st = await eventually(lambda n=name: phase_is(k8s, n, "Failed"))
            ready = condition(st, "Ready")
            assert (ready["status"], ready["reason"], ready["observedGeneration"]) == ("False", "PolicyViolation", 1)
            assert field in ready["message"] and "policy" in ready["message"], ready["message"]
            await eventually(lambda n=name: must(("Warning", "Failed") in events_of(k8s, n)))
        for name, _, _ in REFUSED:  # nothing applied for them, not even the ConfigMap
            assert _children(k8s, name) == [], _children(k8s, name)

        # Fixed, the endpoint is served: the update brings its children and a status past the refusal.
        await patch_spec(k8s, "bad-image", {"engine": {"image": "registry.corp/ml/sluice-engine:v1"}})
        await eventually(lambda: must(live(k8s, DEPLOY, "bad-image") is not None))
        st = await eventually(lambda: phase_is(k8s, "bad-image", "Pending"))
        assert condition(st, "Ready")["reason"] != "PolicyViolation" and st["observedGeneration"] == 2
        (engine,) = live(k8s, DEPLOY, "bad-image")["spec"]["template"]["spec"]["containers"]
        assert engine["image"] == "registry.corp/ml/sluice-engine:v1"
        assert live(k8s, CM, "bad-image-engine") is not None
        # The others stay refused.
        assert condition(status_of(k8s, "bad-secret"), "Ready")["reason"] == "PolicyViolation"


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_credentials_never_reach_the_serving_container(k8s: Any) -> None:  # noqa: F811 - the fixture
    model = {**ENDPOINT["spec"]["model"], "credentialsSecretRef": {"name": "hf-token"}}
    doc = _endpoint("gated", model=model, scaling={"minReplicas": 0, "maxReplicas": 2, "warmPool": {"replicas": 1}},
                    pod={"env": [{"name": "LOG_LEVEL", "value": "debug"}]})
    async with operator(k8s, cfg=POLICY):  # hf-token is on the allow-list: the fetch container may read it
        await create_endpoint(k8s, doc)
        await eventually(lambda: must(live(k8s, DEPLOY, "gated-warm") is not None))
        st = await eventually(lambda: phase_is(k8s, "gated", "Pending"))  # applied; no pod yet
    assert condition(st, "Ready")["reason"] != "PolicyViolation"
    for name in ("gated", "gated-warm"):  # serving and warm pool, as applied
        pod = live(k8s, DEPLOY, name)["spec"]["template"]["spec"]
        (fetch,) = pod["initContainers"]
        assert fetch["name"] == "fetch-model" and fetch["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
        (engine,) = pod["containers"]
        assert "hf-token" not in json.dumps(engine) and "envFrom" not in engine
        assert {"name": "LOG_LEVEL", "value": "debug"} in engine["env"]
