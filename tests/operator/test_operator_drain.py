"""Issue 13, fault-suite case 8 (drain settings): every engine pod gets a preStop pause and a grace period
that covers the pause, the engine's drain (--shutdown-timeout, 30 s unless engine.args sets it) and a
margin, so Kubernetes never kills a drain that is on time; the manifests stay valid."""

from __future__ import annotations

import kubernetes_validate
import pytest
from test_operator_distributed import LWS_ENV, TP8_PP2, endpoint, workload_of  # noqa: F401

from sluice_operator.reconcile import reconcile
from sluice_operator.spec import parse_endpoint
from sluice_operator.workload import GRACE_MARGIN_S, PRESTOP_SLEEP_S


def pod_specs(manifests):
    wl = workload_of(manifests)
    if wl["kind"] == "Deployment":
        return [wl["spec"]["template"]["spec"]]
    lwt = wl["spec"]["leaderWorkerTemplate"]
    return [lwt["leaderTemplate"]["spec"], lwt["workerTemplate"]["spec"]]


@pytest.mark.parametrize(("args", "drain"), [({}, 30), ({"shutdown-timeout": "90"}, 90), ({"shutdown-timeout": "2.5"}, 3)])
def test_drain_settings_rendered(args, drain):
    manifests = reconcile(parse_endpoint(endpoint(engine={"args": args})))
    for spec in pod_specs(manifests):
        assert spec["terminationGracePeriodSeconds"] == PRESTOP_SLEEP_S + drain + GRACE_MARGIN_S
        (engine,) = spec["containers"]
        assert engine["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(PRESTOP_SLEEP_S)]
        if args:
            assert engine["args"][engine["args"].index("--shutdown-timeout") + 1] == args["shutdown-timeout"]
    wl = workload_of(manifests)
    kubernetes_validate.validate(wl, kubernetes_validate.latest_version(), strict=True)


def test_multinode_pods_drain_alike():
    import yaml

    specs = pod_specs(reconcile(parse_endpoint(yaml.safe_load(TP8_PP2))))
    assert len(specs) == 2
    assert {s["terminationGracePeriodSeconds"] for s in specs} == {PRESTOP_SLEEP_S + 30 + GRACE_MARGIN_S}
