"""endpoint_status() and transitions(), pure: observed children and pods in, status and events out. And the
operator's settings from the environment."""

from __future__ import annotations

import copy
import re
from typing import Any

import kubernetes_validate
import pytest
import yaml
from operator_schemas import CRD_FILE, crd_schema, schema_errors

from sluice_operator.apply import event_manifest
from sluice_operator.children import Problem
from sluice_operator.config import ENGINE_IMAGE, ENV, OperatorConfig
from sluice_operator.render import render_text
from sluice_operator.spec import parse_endpoint
from sluice_operator.status import endpoint_status, summarize_pods, transitions

ENDPOINT = {
    "apiVersion": "sluice.dev/v1alpha1",
    "kind": "InferenceEndpoint",
    "metadata": {"name": "qwen", "namespace": "team-a", "uid": "u", "generation": 4},
    "spec": {
        "model": {"uri": "hf://Qwen/Qwen2.5-7B-Instruct", "servedName": "qwen"},
        "scaling": {"minReplicas": 0, "maxReplicas": 4, "warmPool": {"replicas": 1}},
    },
}
NOW = "2025-01-01T00:00:00Z"
STATUS_SCHEMA = crd_schema(yaml.safe_load(CRD_FILE.read_text()))["properties"]["status"]


def ep(**spec: Any) -> Any:
    doc = copy.deepcopy(ENDPOINT)
    doc["spec"] |= spec
    return parse_endpoint(doc)


def deploy(desired: int | None, **status: Any) -> dict[str, Any]:
    return {"metadata": {}, "spec": {} if desired is None else {"replicas": desired}, "status": status}


def pod(name: str = "qwen-1", *, scheduled: tuple[str, str | None, str | None] | None = ("True", None, None),
        init: dict[str, Any] | None = None, engine: dict[str, Any] | None = None, ready: bool = False,
        **extra: Any) -> dict[str, Any]:
    conditions = []
    if scheduled:
        conditions.append({"type": "PodScheduled", "status": scheduled[0], "reason": scheduled[1],
                           "message": scheduled[2]})
    conditions.append({"type": "Ready", "status": "True" if ready else "False"})
    status: dict[str, Any] = {"phase": "Running" if scheduled and scheduled[0] == "True" else "Pending",
                              "conditions": conditions}
    if init is not None:
        status["initContainerStatuses"] = [{"name": "fetch-model", "state": init}]
    if engine is not None:
        status["containerStatuses"] = [{"name": "engine", "state": engine}]
    return {"metadata": {"name": name, **extra.pop("metadata", {})}, "status": {**status, **extra}}


UNSCHEDULABLE = ("False", "Unschedulable", "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.")


def cond(status: dict[str, Any], type_: str) -> tuple[str, str]:
    c = next(c for c in status["conditions"] if c["type"] == type_)
    return c["status"], c["reason"]


def message(status: dict[str, Any], type_: str) -> str:
    return next(c for c in status["conditions"] if c["type"] == type_)["message"]


# -- pods ---------------------------------------------------------------------------------------------------
def test_summarize_pods():
    seen = summarize_pods([
        pod("a", scheduled=UNSCHEDULABLE),
        pod("b", scheduled=None),  # the scheduler has not looked yet
        pod("c", init={"running": {}}),
        pod("d", engine={"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 5m0s"}}),
        pod("e", metadata={"deletionTimestamp": NOW}),  # on its way out: not counted
        pod("f", phase="Failed"),
    ])
    assert (seen.total, len(seen.unschedulable), seen.unplaced, seen.scheduled, seen.downloading) == (4, 1, 1, 2, 1)
    assert seen.stuck == ("CrashLoopBackOff", "pod d, container engine: back-off 5m0s")


@pytest.mark.parametrize(("pods", "serving", "phase", "ready_reason", "model_ready", "scheduled"), [
    # Nothing fits: Pending, and Scheduled says why.
    ([pod(scheduled=UNSCHEDULABLE)], deploy(1, replicas=1), "Pending", "InsufficientCapacity",
     ("False", "NoPodsRunning"), ("False", "InsufficientCapacity")),
    # Created, not looked at by the scheduler yet.
    ([pod(scheduled=None)], deploy(1, replicas=1), "Pending", "AwaitingScheduler",
     ("False", "NoPodsRunning"), ("Unknown", "AwaitingScheduler")),
    # Placed; the init container fetches the weights.
    ([pod(init={"running": {}})], deploy(1, replicas=1), "Loading", "Downloading",
     ("False", "Downloading"), ("True", "PodsScheduled")),
    # The engine runs and loads the model.
    ([pod(engine={"running": {}})], deploy(1, replicas=1), "Loading", "ModelLoading",
     ("False", "ModelLoading"), ("True", "PodsScheduled")),
    # The image cannot be pulled: waiting will not help, and the reason says so.
    ([pod(engine={"waiting": {"reason": "ImagePullBackOff", "message": "not found"}})], deploy(1, replicas=1),
     "Loading", "ImagePullBackOff", ("False", "ImagePullBackOff"), ("True", "PodsScheduled")),
    # One replica serves, a second fits nowhere: Ready, with Scheduled False.
    ([pod("a", ready=True), pod("b", scheduled=UNSCHEDULABLE)], deploy(2, replicas=2, readyReplicas=1), "Ready",
     "ReplicasReady", ("True", "ModelLoaded"), ("False", "InsufficientCapacity")),
    # Scaled to zero.
    ([], deploy(0), "Idle", "ScaledToZero", ("False", "ScaledToZero"), ("True", "ScaledToZero")),
    # No pod yet.
    ([], deploy(1), "Pending", "NoPods", ("False", "NoPodsRunning"), ("Unknown", "NoPods")),
])
def test_status_from_pods(pods, serving, phase, ready_reason, model_ready, scheduled):
    st = endpoint_status(ep(), serving=serving, pods=pods, now=NOW)
    assert st["phase"] == phase
    assert cond(st, "Ready")[1] == ready_reason
    assert cond(st, "ModelReady") == model_ready
    assert cond(st, "Scheduled") == scheduled
    assert all(c["observedGeneration"] == 4 for c in st["conditions"])
    assert schema_errors(STATUS_SCHEMA, st) == []


def test_insufficient_capacity_message_names_the_shortage():
    st = endpoint_status(ep(), serving=deploy(2, replicas=2), pods=[pod("a", scheduled=UNSCHEDULABLE),
                                                                     pod("b", scheduled=UNSCHEDULABLE)], now=NOW)
    assert message(st, "Scheduled") == (
        "2 of 2 serving pods cannot be scheduled: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu.")
    assert message(st, "Ready") == message(st, "Scheduled")


def test_pods_not_read():
    st = endpoint_status(ep(), serving=deploy(1, replicas=1), pods=None, now=NOW)
    assert st["phase"] == "Loading" and cond(st, "Scheduled") == ("Unknown", "PodsNotObserved")


def test_workload_failure_wins_over_pods():
    failed = deploy(1, replicas=1, conditions=[{"type": "Progressing", "status": "False",
                                                 "reason": "ProgressDeadlineExceeded", "message": "stuck"}])
    st = endpoint_status(ep(), serving=failed, pods=[pod(engine={"running": {}})], now=NOW)
    assert st["phase"] == "Failed" and cond(st, "Degraded") == ("True", "ProgressDeadlineExceeded")


# -- warm pool, Idle, URL ---------------------------------------------------------------------------------
def test_idle_with_warm_pool():
    st = endpoint_status(ep(), serving=deploy(0), standby=deploy(1, replicas=1, readyReplicas=1), pods=[], now=NOW)
    assert st["phase"] == "Idle"
    assert st["replicas"] == {"desired": 0, "ready": 0, "standby": 1}
    assert message(st, "Ready") == "scaled to zero; a request brings a replica back (1 warm-pool pod ready meanwhile)"
    assert st["selector"] == "sluice.dev/endpoint=qwen,sluice.dev/role=serving"


def test_url_is_the_gateway_for_autoscaled_endpoints():
    cfg = OperatorConfig()
    assert endpoint_status(ep(), serving=None, now=NOW, cfg=cfg)["url"] == cfg.gateway_url
    fixed = ep(scaling=None, replicas=1)
    assert endpoint_status(fixed, serving=None, now=NOW)["url"] == "http://qwen.team-a.svc.cluster.local/v1"
    no_gateway = OperatorConfig(gateway_url="")
    assert endpoint_status(ep(), serving=None, now=NOW, cfg=no_gateway)["url"] == (
        "http://qwen.team-a.svc.cluster.local/v1")


# -- KEDA ---------------------------------------------------------------------------------------------------
def scaled_object(*conditions: tuple[str, str, str], health: dict[str, Any] | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"conditions": [{"type": t, "status": s, "reason": r, "message": f"{t} says {s}"}
                                             for t, s, r in conditions]}
    if health:
        status["health"] = health
    return {"status": status}


def test_keda_conditions_pass_through():
    so = scaled_object(("Ready", "True", "ScaledObjectReady"), ("Active", "False", "ScalerNotActive"),
                       ("Fallback", "True", "FallbackExists"),
                       health={"s0-prometheus": {"numberOfFailures": 7, "status": "Failing"},
                               "s1-external-push": {"numberOfFailures": 0, "status": "Happy"}})
    st = endpoint_status(ep(), serving=deploy(0), scaled_object=so, pods=[], now=NOW)
    assert cond(st, "AutoscalerReady") == ("True", "ScaledObjectReady")
    assert cond(st, "AutoscalerActive") == ("False", "ScalerNotActive")
    assert cond(st, "AutoscalerFallback") == ("True", "FallbackExists")
    assert message(st, "AutoscalerFallback") == "Fallback says True; failing triggers: s0-prometheus (7 failures)"
    assert schema_errors(STATUS_SCHEMA, st) == []


def test_keda_silent_or_missing():
    st = endpoint_status(ep(), serving=deploy(0), scaled_object=None, pods=[], now=NOW)
    assert {cond(st, t) for t in ("AutoscalerReady", "AutoscalerActive", "AutoscalerFallback")} == {
        ("Unknown", "AwaitingKeda")}
    st = endpoint_status(ep(), serving=deploy(0), pods=[], missing_kinds={"ScaledObject"}, now=NOW)
    assert cond(st, "AutoscalerReady") == ("False", "KedaNotInstalled")
    fixed = endpoint_status(ep(scaling=None, replicas=1), serving=deploy(1), pods=[], now=NOW)
    assert not any(c["type"].startswith("Autoscaler") for c in fixed["conditions"])


def test_missing_leaderworkerset_fails_with_what_to_install():
    st = endpoint_status(ep(), serving=None, missing_kinds={"LeaderWorkerSet"}, now=NOW)
    assert st["phase"] == "Failed" and cond(st, "Ready") == ("False", "LeaderWorkerSetNotInstalled")
    assert "kubernetes-sigs/lws" in message(st, "Ready")


# -- events -------------------------------------------------------------------------------------------------
def test_transitions():
    e = ep()
    pending = endpoint_status(e, serving=deploy(1, replicas=1), pods=[pod(scheduled=UNSCHEDULABLE)], now=NOW)
    assert [(x.type, x.reason) for x in transitions(None, pending)] == [
        ("Normal", "Pending"), ("Warning", "InsufficientCapacity")]
    assert transitions(pending, pending) == []  # nothing new: nothing posted
    loading = endpoint_status(e, serving=deploy(1, replicas=1), pods=[pod(engine={"running": {}})],
                              previous=pending, now=NOW)
    assert [(x.type, x.reason) for x in transitions(pending, loading)] == [("Normal", "Loading")]
    stuck = endpoint_status(e, serving=deploy(1, replicas=1), previous=loading, now=NOW,
                            pods=[pod(engine={"waiting": {"reason": "CrashLoopBackOff", "message": "oom"}})])
    assert [(x.type, x.reason) for x in transitions(loading, stuck)] == [("Warning", "CrashLoopBackOff")]
    ready = endpoint_status(e, serving=deploy(1, replicas=1, readyReplicas=1), pods=[pod(ready=True)],
                            previous=stuck, now=NOW)
    (event,) = transitions(stuck, ready)
    assert (event.type, event.reason, event.message) == ("Normal", "Ready", "1/1 replicas ready")
    fallback = endpoint_status(e, serving=deploy(1, replicas=1, readyReplicas=1), pods=[pod(ready=True)],
                               scaled_object=scaled_object(("Fallback", "True", "FallbackExists")), now=NOW)
    assert [(x.type, x.reason) for x in transitions(ready, fallback)] == [("Warning", "AutoscalerFallback")]
    recovered = endpoint_status(e, serving=deploy(1, replicas=1, readyReplicas=1), pods=[pod(ready=True)],
                                scaled_object=scaled_object(("Fallback", "False", "NoFallbackFound")), now=NOW)
    assert [(x.type, x.reason) for x in transitions(fallback, recovered)] == [("Normal", "AutoscalerRecovered")]
    degraded = endpoint_status(e, now=NOW, pods=[pod(ready=True)], serving=deploy(
        2, replicas=2, readyReplicas=1,
        conditions=[{"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": "quota"}]))
    assert [(x.type, x.reason) for x in transitions(ready, degraded)] == [("Warning", "Degraded")]


@pytest.mark.parametrize("version", ["1.30", kubernetes_validate.latest_version()])
def test_event_manifest_is_a_valid_event(version):
    involved = {"apiVersion": "sluice.dev/v1alpha1", "kind": "InferenceEndpoint", "name": "qwen",
                "namespace": "team-a", "uid": "u"}
    event = event_manifest(involved, "Warning", "InsufficientCapacity", "x" * 5000, NOW)
    assert len(event["message"]) == 1024
    event = {**event, "metadata": {**event["metadata"], "name": "qwen.abc123"}}  # the API server names it
    kubernetes_validate.validate(event, version, strict=True)


# -- settings -------------------------------------------------------------------------------------------------
def test_config_from_env():
    assert OperatorConfig.from_env({}) == OperatorConfig()
    assert OperatorConfig().engine_image == ENGINE_IMAGE
    cfg = OperatorConfig.from_env({ENV["engine_image"]: "registry.local/engine:dev", ENV["prometheus_url"]: "",
                                   ENV["gateway_scaler_address"]: "", ENV["gateway_url"]: "http://gw:8080/v1"})
    assert cfg.engine_image == "registry.local/engine:dev"
    assert cfg.prometheus_url == OperatorConfig().prometheus_url  # empty: the default
    assert cfg.gateway_scaler_address == ""  # empty: no gateway, no external-push trigger
    assert cfg.gateway_url == "http://gw:8080/v1"


def test_monitoring_labels_from_env():
    """The chart passes monitoring.labels / .annotations as JSON (toJson); bad ones name the variable."""
    cfg = OperatorConfig.from_env({ENV["monitoring_labels"]: '{"release": "kube-prometheus-stack"}',
                                   ENV["monitoring_annotations"]: '{"example.com/owner": "ml platform"}',
                                   ENV["gateway_scaler_tls_secret"]: "sluice-gateway-scaler-tls"})
    assert cfg.monitoring_labels == {"release": "kube-prometheus-stack"}
    assert cfg.monitoring_annotations == {"example.com/owner": "ml platform"}  # any string, unlike a label
    assert cfg.gateway_scaler_tls_secret == "sluice-gateway-scaler-tls"
    assert OperatorConfig.from_env({ENV["monitoring_labels"]: "{}"}) == OperatorConfig()
    for value, message in [
        ("release=kps", "SLUICE_MONITORING_LABELS must be a JSON object of strings"),
        ('["release"]', "SLUICE_MONITORING_LABELS must be a JSON object of strings, got list"),
        ('{"release": 1}', "the value of 'release' must be a string"),
        ('{"release": "has spaces"}', "'has spaces' (of 'release') is not a valid label value"),
        ('{"bad key!": "x"}', "'bad key!' is not a valid label or annotation key"),
        ('{"sluice.dev/endpoint": "other"}', "'sluice.dev/endpoint' is set by the operator itself"),
        ('{"app.kubernetes.io/component": "x"}', "is set by the operator itself"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            OperatorConfig.from_env({ENV["monitoring_labels"]: value})


def test_render_reads_the_operator_environment(monkeypatch):
    spec = {**ENDPOINT["spec"], "scaling": {"minReplicas": 1, "maxReplicas": 4}}  # no gateway: 0 is refused
    text = yaml.safe_dump({**ENDPOINT, "metadata": {"name": "qwen", "namespace": "team-a"}, "spec": spec})
    monkeypatch.setenv("SLUICE_ENGINE_IMAGE", "registry.local/engine:dev")
    monkeypatch.setenv("SLUICE_GATEWAY_SCALER_ADDRESS", "")
    manifests = render_text(text)
    deployment = next(m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"] == "qwen")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.local/engine:dev"
    so = next(m for m in manifests if m["kind"] == "ScaledObject")
    assert [t["type"] for t in so["spec"]["triggers"]] == ["prometheus"]


def test_apply_problems() -> None:
    failed = Problem("ApplyFailed", "PrometheusRule", "qwen", "PrometheusRule qwen: admission webhook denied it")
    conflict = Problem("NameConflict", "Service", "qwen", "Service team-a/qwen already exists, ...")
    # Still serving: Degraded, and Ready stays True (clients are answered), with the reason in Degraded.
    st = endpoint_status(ep(), serving=deploy(2, readyReplicas=2), problems=[failed], now=NOW)
    assert st["phase"] == "Degraded"
    assert _cond(st, "Ready")["status"] == "True"
    assert (_cond(st, "Degraded")["status"], _cond(st, "Degraded")["reason"]) == ("True", "ApplyFailed")
    assert (_cond(st, "Reconciled")["status"], _cond(st, "Reconciled")["message"]) == ("False", failed.message)
    # Nothing serves: Failed, with the API server's message in Ready.
    st = endpoint_status(ep(), serving=None, problems=[failed], now=NOW)
    assert (st["phase"], _cond(st, "Ready")["reason"], _cond(st, "Ready")["message"]) == (
        "Failed", "ApplyFailed", failed.message)
    # A name conflict fails the endpoint even while replicas serve: a person must act.
    st = endpoint_status(ep(), serving=deploy(2, readyReplicas=2), problems=[failed, conflict], now=NOW)
    assert (st["phase"], _cond(st, "Ready")["status"], _cond(st, "Ready")["reason"]) == ("Failed", "False",
                                                                                         "NameConflict")
    assert _cond(st, "Reconciled")["reason"] == "NameConflict"
    assert schema_errors(STATUS_SCHEMA, st) == []
    events = transitions(None, st)
    assert ("Warning", "NameConflict") in [(e.type, e.reason) for e in events]
    clean = endpoint_status(ep(), serving=deploy(2, readyReplicas=2), now=NOW)
    assert (_cond(clean, "Reconciled")["status"], _cond(clean, "Reconciled")["reason"]) == ("True", "Applied")


def _cond(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == type_)
