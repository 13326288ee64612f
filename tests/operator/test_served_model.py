"""ServedModel (issue 42, model versions by weight): the generated CRD (fresh, valid, structural, CEL rules that
refuse bad specs with a reason, each with its Python twin), its reference doc, and the status the operator writes."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml
from operator_schemas import ROOT, api_server_errors, compile_rule, crd_schema

from sluice_autoscaler import versions
from sluice_operator import served_model as sm
from sluice_operator.spec import SpecError

CRD_PATH = ROOT / "crds" / "sluice.dev_servedmodels.yaml"
GOOD = {"apiVersion": "sluice.dev/v1alpha1", "kind": "ServedModel",
        "metadata": {"name": "chat", "namespace": "team-a", "generation": 3},
        "spec": {"model": "chat", "versions": [{"endpoint": "chat-v1", "weight": 90},
                                               {"endpoint": "chat-v2", "weight": 10}],
                 "aliases": {"chat-canary": "chat-v2"}}}


def test_checked_in_crd_and_reference_are_fresh():
    assert CRD_PATH.read_text() == sm.crd_yaml(), (
        "regenerate: python -m sluice_operator.served_model crd > crds/sluice.dev_servedmodels.yaml "
        "(and cp it to charts/sluice/crds/)")
    assert (ROOT / "docs" / "reference-servedmodel.md").read_text() == sm.reference(), (
        "regenerate: python -m sluice_operator.served_model docs > docs/reference-servedmodel.md")
    assert (ROOT / "charts" / "sluice" / "crds" / CRD_PATH.name).read_bytes() == CRD_PATH.read_bytes()


@pytest.mark.parametrize("version", ["1.30", kubernetes_validate.latest_version()])
def test_crd_validates_as_a_crd(version):
    kubernetes_validate.validate(yaml.safe_load(CRD_PATH.read_text()), version, strict=True)


def _nodes(schema, path=""):
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from _nodes(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from _nodes(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _nodes(schema["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural_and_rules_compile():
    schema = crd_schema(sm.crd())
    rules = 0
    for path, node in _nodes(schema):
        for forbidden in ("$ref", "$defs", "anyOf", "oneOf", "allOf", "not", "title", "const", "nullable",
                          "propertyNames"):
            assert forbidden not in node, f"{path}: {forbidden}"
        assert "type" in node, f"{path}: untyped"
        for rule in node.get("x-kubernetes-validations", []):
            compile_rule(rule["rule"])
            rules += 1
    assert rules == 5


def test_good_spec_is_admitted_and_parsed():
    schema = crd_schema(sm.crd())
    assert api_server_errors(schema, GOOD) == []
    spec = sm.parse_served_model(GOOD)
    assert spec.session_header == "x-session-id" and spec.name_scope == "Namespace"


def _with(**spec):
    doc = copy.deepcopy(GOOD)
    doc["spec"].update(spec)
    return doc


@pytest.mark.parametrize(("doc", "reason"), [
    (_with(versions=[]), "non-empty"),
    (_with(versions=[{"endpoint": "chat-v1", "weight": -1}], aliases={}), "minimum"),
    (_with(versions=[{"endpoint": "chat-v1", "weight": 1.5}], aliases={}), "integer"),
    (_with(versions=[{"endpoint": "Chat_V1", "weight": 1}], aliases={}), "does not match"),
    (_with(versions=[{"endpoint": "chat-v1", "weight": 1}, {"endpoint": "chat-v1", "weight": 2}], aliases={}),
     "versions[].endpoint must be unique"),
    (_with(versions=[{"endpoint": "chat-v1", "weight": 0}, {"endpoint": "chat-v2", "weight": 0}]),
     "at least one version must have a weight above 0"),
    (_with(aliases={"chat-canary": "chat-v3"}), "every alias must lead to one of versions[].endpoint"),
    (_with(aliases={"chat": "chat-v2"}), "an alias must not be the model's own name"),
    (_with(aliases={"team/x": "chat-v2"}), "an alias is a model name"),
    (_with(model="a/b"), "does not match"),
])
def test_bad_specs_are_refused_with_a_reason_by_both(doc, reason):
    errors = api_server_errors(crd_schema(sm.crd()), doc)
    assert errors and any(reason in e for e in errors), (reason, errors)
    with pytest.raises(SpecError):
        sm.parse_served_model(doc)


def ie(name: str, ready: int | None, phase: str = "Ready") -> dict:
    status = {"phase": phase, "replicas": {"ready": ready or 0}} if ready is not None else {}
    return {"metadata": {"name": name}, "status": status}


def test_status_versions_readiness_and_traffic():
    st = sm.served_model_status(GOOD, {"chat-v1": ie("chat-v1", 2), "chat-v2": ie("chat-v2", 1)}, "T0")
    assert st["versions"] == [
        {"endpoint": "chat-v1", "weight": 90, "ready": True, "trafficPercent": 90},
        {"endpoint": "chat-v2", "weight": 10, "ready": True, "trafficPercent": 10}]
    [cond] = st["conditions"]
    assert (cond["type"], cond["status"], cond["reason"], cond["observedGeneration"]) == ("Ready", "True",
                                                                                         "VersionsReady", 3)
    assert st["observedGeneration"] == 3
    # v2 not ready (scaled to zero): it gets none; v1 all.
    st2 = sm.served_model_status({**GOOD, "status": st}, {"chat-v1": ie("chat-v1", 1),
                                                          "chat-v2": ie("chat-v2", 0, "Idle")}, "T1")
    assert [(v["ready"], v["trafficPercent"]) for v in st2["versions"]] == [(True, 100), (False, 0)]
    assert st2["conditions"][0]["lastTransitionTime"] == "T0"  # still Ready: the transition time is kept
    # None ready: the weighted split holds (and wakes them).
    st3 = sm.served_model_status(GOOD, {"chat-v1": ie("chat-v1", 0, "Idle"), "chat-v2": ie("chat-v2", 0, "Idle")},
                                 "T2")
    assert [v["trafficPercent"] for v in st3["versions"]] == [90, 10]
    assert st3["conditions"][0]["reason"] == "NoVersionReady"
    # A version whose endpoint does not exist.
    st4 = sm.served_model_status(GOOD, {"chat-v1": ie("chat-v1", 1)}, "T3")
    assert st4["conditions"][0]["reason"] == "EndpointNotFound" and "message" in st4["versions"][1]
    # Invalid (an older CRD let it in): the condition says why.
    bad = _with(versions=[{"endpoint": "chat-v1", "weight": 0}])
    assert sm.served_model_status(bad, {}, "T4")["conditions"][0]["reason"] == "InvalidSpec"
    assert sm.versions_of(GOOD) == {"chat-v1", "chat-v2"}


@pytest.mark.parametrize("weights", [{"a": 90, "b": 10}, {"a": 0, "b": 5}, {"a": 3, "b": 3, "c": 0}])
@pytest.mark.parametrize("ready", [set(), {"a"}, {"b"}, {"a", "b", "c"}])
def test_status_shares_are_the_gateways(weights, ready):
    assert sm.traffic_shares(weights, {v: v in ready for v in weights}) == versions.traffic_shares(
        weights, lambda v: v in ready)
    assert sm.DEFAULT_SESSION_HEADER == versions.DEFAULT_SESSION_HEADER


def test_example_parses():
    from operator_schemas import load_yaml

    from sluice_operator.spec import parse_endpoint

    folder = ROOT / "examples" / "model-versions"
    served = load_yaml(folder / "servedmodel.yaml")
    spec = sm.parse_served_model(served)
    assert api_server_errors(crd_schema(sm.crd()), served) == []
    endpoints = {p.stem: parse_endpoint(load_yaml(p)) for p in folder.glob("chat-v*.yaml")}
    assert {v.endpoint for v in spec.versions} == set(endpoints) == {e.name for e in endpoints.values()}
