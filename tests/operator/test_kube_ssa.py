"""The emulator's server-side apply (kube_ssa.py) follows the rules the Kubernetes documentation gives
(https://kubernetes.io/docs/reference/using-api/server-side-apply/), the cases the operator relies on."""

from __future__ import annotations

import copy
from typing import Any

import kube_ssa
import pytest


def deployment(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "namespace": "ns"},
            "spec": {"template": {"spec": {"containers": [{"name": "c", "image": "i"}]}}, **spec}}


def test_a_field_dropped_by_its_only_owner_is_removed_and_defaulted() -> None:
    live = kube_ssa.apply(None, deployment(replicas=3, paused=True), "op", force=True)
    assert (live["spec"]["replicas"], live["spec"]["paused"]) == (3, True)
    live = kube_ssa.apply(live, deployment(), "op", force=True)
    assert live["spec"]["replicas"] == 1  # the API server's default again: the documented reset
    assert "paused" not in live["spec"]
    assert live["spec"]["template"]["spec"]["containers"] == [{"name": "c", "image": "i"}]


def test_handover_keeps_a_field_its_first_owner_drops() -> None:
    """The documented transfer to an HPA: a second manager applies only the field, then the first drops it."""
    live = kube_ssa.apply(None, deployment(replicas=3), "op", force=True)
    only_replicas = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "namespace": "ns"},
                     "spec": {"replicas": 3}}
    live = kube_ssa.apply(live, only_replicas, "handover", force=False)
    live = kube_ssa.apply(live, deployment(), "op", force=True)
    assert live["spec"]["replicas"] == 3
    owned = kube_ssa.owners(live)
    assert ("spec", "replicas") not in owned["op", "Apply"]
    assert owned["handover", "Apply"] == {("spec", "replicas")}
    # The HPA's write takes the field over; the handover manager, owning nothing, disappears.
    live = kube_ssa.update(live, {**live, "spec": {**live["spec"], "replicas": 5}}, "hpa")
    assert ("handover", "Apply") not in kube_ssa.owners(live)
    assert kube_ssa.owners(live)["hpa", "Update"] == {("spec", "replicas")}


def test_conflicts_unless_forced() -> None:
    live = kube_ssa.apply(None, deployment(replicas=3), "op", force=True)
    live = kube_ssa.update(live, {**live, "spec": {**live["spec"], "replicas": 5}}, "hpa")
    with pytest.raises(kube_ssa.Conflict, match='conflict with "hpa": .spec.replicas'):
        kube_ssa.apply(live, deployment(replicas=2), "op", force=False)
    same = kube_ssa.apply(live, deployment(replicas=5), "op", force=False)  # the same value: shared
    assert ("spec", "replicas") in kube_ssa.owners(same)["hpa", "Update"]
    forced = kube_ssa.apply(live, deployment(replicas=2), "op", force=True)
    assert forced["spec"]["replicas"] == 2
    assert ("hpa", "Update") not in kube_ssa.owners(forced)


def test_merge_patch_turns_old_into_new() -> None:
    old = {"a": {"b": 1, "c": [1, 2]}, "d": 1}
    new = {"a": {"c": [3]}, "e": {}}
    patch = kube_ssa.merge_patch(old, new)
    assert patch == {"a": {"b": None, "c": [3]}, "d": None, "e": {}}
    assert copy.deepcopy(old) == old  # inputs untouched
