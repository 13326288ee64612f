"""The operator's multi-tenancy policy (policy.py) and where model credentials go, offline: settings from the
SLUICE_* variables, each rule's verdict and message, `sluice render` refusing what the operator would refuse."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import pytest
from operator_schemas import EXAMPLES, load_yaml

from sluice_operator.config import ENGINE_IMAGE, OperatorConfig
from sluice_operator.policy import PolicyViolation, check, image_allowed, path_allowed, violations
from sluice_operator.reconcile import reconcile
from sluice_operator.render import render_text
from sluice_operator.spec import parse_endpoint

BASE = {
    "apiVersion": "sluice.dev/v1alpha1",
    "kind": "InferenceEndpoint",
    "metadata": {"name": "demo", "namespace": "team-a"},
    "spec": {"model": {"uri": "hf://org/model"}, "accelerator": {"type": "cpu"}},
}
STRICT = OperatorConfig(allowed_image_prefixes=("registry.corp/ml/", "ghcr.io/acme"), host_path_allowed=True,
                        host_path_prefixes=("/var/lib/sluice",), pod_secret_refs_allowed=False,
                        allowed_secrets=("hf-token",))


def endpoint(**spec: Any) -> Any:
    doc = copy.deepcopy(BASE)
    doc["spec"].update(copy.deepcopy(spec))
    return parse_endpoint(doc)


def fields(ep: Any, cfg: OperatorConfig) -> list[str]:
    return [v.field for v in violations(ep, cfg)]


def test_settings_come_from_the_environment() -> None:
    cfg = OperatorConfig.from_env({
        "SLUICE_ALLOWED_IMAGE_PREFIXES": "registry.corp/ml/, ghcr.io/acme ,",
        "SLUICE_HOST_PATH_ALLOWED": "false",
        "SLUICE_HOST_PATH_PREFIXES": "/var/lib/sluice",
        "SLUICE_POD_SECRET_REFS_ALLOWED": "false",
        "SLUICE_ALLOWED_SECRETS": "hf-token",
    })
    assert cfg.allowed_image_prefixes == ("registry.corp/ml/", "ghcr.io/acme")
    assert (cfg.host_path_allowed, cfg.host_path_prefixes) == (False, ("/var/lib/sluice",))
    assert (cfg.pod_secret_refs_allowed, cfg.allowed_secrets) == (False, ("hf-token",))
    # Empty lists (the chart's defaults) allow any image and Secret (hostPaths: see the next test).
    assert OperatorConfig.from_env({"SLUICE_ALLOWED_IMAGE_PREFIXES": "", "SLUICE_ALLOWED_SECRETS": ""}) == OperatorConfig()
    with pytest.raises(ValueError, match="SLUICE_HOST_PATH_ALLOWED must be true or false"):
        OperatorConfig.from_env({"SLUICE_HOST_PATH_ALLOWED": "sometimes"})


@pytest.mark.parametrize(("path", "ok"), [
    ("/var/lib/sluice/cache", True), ("/mnt/sluice", True), ("/mnt/sluice/nvme0/models", True),
    ("/etc", False), ("/etc/kubernetes", False), ("/var/lib/kubelet", False), ("/mnt", False),
    ("/var/lib/sluice-evil", False), ("/root", False), ("/usr/local/bin", False),
])
def test_default_host_path_prefixes_refuse_system_directories(path: str, ok: bool) -> None:
    """Issue 39: a root init container chowns a hostPath cache directory to the engine's user, so the default
    policy admits only directories meant for Sluice's caches, and the refusal names the field and the setting."""
    ep = endpoint(model={"uri": "hf://org/model", "cache": {"type": "hostPath", "path": path}})
    found = violations(ep, OperatorConfig())
    assert bool(found) is not ok
    if not ok:
        (v,) = found
        assert v.field == "spec.model.cache.path"
        assert f"{path!r}" in v.message and "/var/lib/sluice, /mnt/sluice" in v.message
        assert "policy.hostPath.pathPrefixes" in v.message
        with pytest.raises(PolicyViolation, match=r"spec\.model\.cache\.path: hostPath"):
            render_text(json.dumps({**BASE, "spec": {**BASE["spec"], "model": {
                "uri": "hf://org/model", "cache": {"type": "hostPath", "path": path}}}}))
    # The chart passes its default; an empty setting keeps it (an admin opens everything with "/").
    assert OperatorConfig.from_env({"SLUICE_HOST_PATH_PREFIXES": ""}).host_path_prefixes == ("/var/lib/sluice",
                                                                                             "/mnt/sluice")
    assert violations(ep, OperatorConfig.from_env({"SLUICE_HOST_PATH_PREFIXES": "/"})) == []


def test_default_policy_allows_every_example() -> None:
    for path in EXAMPLES:
        assert violations(parse_endpoint(load_yaml(path)), OperatorConfig()) == []


@pytest.mark.parametrize(("image", "ok"), [
    ("registry.corp/ml/sluice-engine:v1", True),
    ("ghcr.io/acme/engine@sha256:" + "a" * 64, True),
    ("ghcr.io/acme:v2", True),
    ("ghcr.io/acme-evil/miner:1", False),  # a prefix without '/' matches at a boundary only
    ("registry.corp/mlx/engine:v1", False),
    ("docker.io/library/python:3.12", False),
    (ENGINE_IMAGE, True),  # the operator's own default is always allowed
])
def test_images(image: str, ok: bool) -> None:
    ep = endpoint(engine={"image": image})
    assert fields(ep, STRICT) == ([] if ok else ["spec.engine.image"])
    assert fields(endpoint(), STRICT) == []  # no image: the operator's


def test_image_prefix_matching() -> None:
    assert image_allowed("a.io/x/y:1", ("a.io/x/",)) and not image_allowed("a.io/xy/z", ("a.io/x",))
    assert path_allowed("/var/lib/sluice", ("/var/lib/sluice/",))
    assert not path_allowed("/var/lib/sluice-evil/x", ("/var/lib/sluice",))
    assert not path_allowed("/var/lib/sluice/../../etc", ("/var/lib/sluice",))


def test_host_paths() -> None:
    cache = {"uri": "hf://org/model", "cache": {"type": "hostPath", "path": "/var/lib/sluice/cache"}}
    outside = {"uri": "hf://org/model", "cache": {"type": "hostPath", "path": "/home/shared/cache"}}
    volume = {"volumes": [{"name": "data", "hostPath": {"path": "/etc"}}]}
    assert fields(endpoint(model=cache), STRICT) == []
    assert fields(endpoint(model=outside), STRICT) == ["spec.model.cache.path"]
    assert fields(endpoint(pod=volume), STRICT) == ["spec.pod.volumes[0].hostPath.path"]
    no_host_path = dataclasses.replace(STRICT, host_path_allowed=False)
    assert fields(endpoint(model=cache, pod=volume), no_host_path) == [
        "spec.model.cache.path", "spec.pod.volumes[0].hostPath.path"]
    assert "policy.hostPath.allowed" in str(violations(endpoint(model=cache), no_host_path)[0])


def test_secrets_in_the_engine_container() -> None:
    env = {"env": [{"name": "PLAIN", "value": "1"},
                   {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}}}]}
    volumes = {"volumes": [{"name": "s", "secret": {"secretName": "db"}},
                           {"name": "p", "projected": {"sources": [{"secret": {"name": "db"}}]}}]}
    assert fields(endpoint(pod=env), STRICT) == ["spec.pod.env[1].valueFrom.secretKeyRef.name"]
    assert fields(endpoint(pod=volumes), STRICT) == [
        "spec.pod.volumes[0].secret.secretName", "spec.pod.volumes[1].projected.sources[0].secret.name"]
    message = str(violations(endpoint(pod=env), STRICT)[0])
    assert "'hf-token'" in message and "policy.secrets.podReferences" in message
    # Allowed in the pod, but only the listed Secrets.
    listed = dataclasses.replace(STRICT, pod_secret_refs_allowed=True)
    assert fields(endpoint(pod=env), listed) == []
    assert fields(endpoint(pod=volumes), listed) == [
        "spec.pod.volumes[0].secret.secretName", "spec.pod.volumes[1].projected.sources[0].secret.name"]
    assert fields(endpoint(pod={**env, **volumes}), OperatorConfig()) == []  # the default policy: anything


def test_model_credentials_follow_the_allow_list_only() -> None:
    # The sanctioned way to a gated model: allowed even where pod Secrets are not, if the Secret is listed.
    model = {"uri": "hf://org/model", "credentialsSecretRef": {"name": "hf-token"}}
    assert fields(endpoint(model=model), STRICT) == []
    other = {"uri": "hf://org/model", "credentialsSecretRef": {"name": "prod-db"}}
    assert fields(endpoint(model=other), STRICT) == ["spec.model.credentialsSecretRef.name"]


def test_every_violation_is_reported_at_once() -> None:
    ep = endpoint(engine={"image": "docker.io/evil/x:1"},
                  model={"uri": "hf://org/m", "cache": {"type": "hostPath", "path": "/srv"}},
                  pod={"env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "db", "key": "k"}}}]})
    with pytest.raises(PolicyViolation) as err:
        check(ep, STRICT)
    assert err.value.reason == "PolicyViolation"
    text = str(err.value)
    for field in ("spec.engine.image", "spec.model.cache.path", "spec.pod.env[0].valueFrom.secretKeyRef.name"):
        assert field in text


def test_render_refuses_what_the_operator_refuses() -> None:
    doc = copy.deepcopy(BASE)
    doc["spec"]["engine"] = {"image": "docker.io/evil/x:1"}
    text = json.dumps(doc)
    with pytest.raises(PolicyViolation, match="spec.engine.image"):
        render_text(text, cfg=STRICT)
    assert render_text(text, cfg=OperatorConfig())  # the default policy renders it


# -- model credentials ------------------------------------------------------------------------------------
def _containers(manifest: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(kind of container, container) of every pod template of a workload."""
    if manifest["kind"] == "Deployment":
        templates = [manifest["spec"]["template"]]
    elif manifest["kind"] == "LeaderWorkerSet":
        lwt = manifest["spec"]["leaderWorkerTemplate"]
        templates = [lwt["leaderTemplate"], lwt["workerTemplate"]]
    else:
        return []
    return [(kind, c) for t in templates for kind in ("containers", "initContainers") for c in t["spec"].get(kind, [])]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
@pytest.mark.parametrize("uri", ["hf://org/model", "s3://bucket/model"])
def test_credentials_reach_only_the_fetch_container(path: Any, uri: str) -> None:
    doc = load_yaml(path)
    doc["spec"]["model"] = {**doc["spec"]["model"], "uri": uri, "credentialsSecretRef": {"name": "model-creds"}}
    doc["spec"]["model"].pop("revision", None)
    manifests = reconcile(parse_endpoint(doc))
    fetchers = 0
    for kind, container in (c for m in manifests for c in _containers(m)):
        # The model's fetch, and the LoRA adapters' fetch sidecars (the same credentials path).
        if kind == "initContainers" and container["name"] in ("fetch-model", "fetch-adapters", "fetch-adapters-s3"):
            assert container["envFrom"] == [{"secretRef": {"name": "model-creds"}}]
            fetchers += 1
        else:  # the serving container (and LWS workers): not a trace of the Secret
            assert "model-creds" not in json.dumps(container), container["name"]
    assert fetchers >= 1
    assert "model-creds" not in json.dumps([m for m in manifests if m["kind"] not in ("Deployment", "LeaderWorkerSet")])
