"""The generated CRD: fresh, valid as a CRD, structural, with CEL rules that compile, and its reference doc."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml
from operator_schemas import CRD_FILE, ROOT, compile_rule, crd_schema

from sluice_operator import crd, docs, spec

K8S_VERSIONS = ["1.30", kubernetes_validate.latest_version()]


def test_checked_in_crd_is_fresh():
    assert CRD_FILE.read_text() == crd.crd_yaml(), (
        "crds/sluice.dev_inferenceendpoints.yaml is stale; regenerate it with\n"
        "  python -m sluice_operator.crd > crds/sluice.dev_inferenceendpoints.yaml")


def test_crd_reference_doc_is_fresh():
    assert (ROOT / "docs" / "crd-reference.md").read_text() == docs.reference(), (
        "docs/crd-reference.md is stale; regenerate it with\n"
        "  python -m sluice_operator.docs > docs/crd-reference.md")


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_crd_validates_as_a_crd(version):
    kubernetes_validate.validate(yaml.safe_load(CRD_FILE.read_text()), version, strict=True)


def _nodes(schema: dict[str, Any], path: str = ""):
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from _nodes(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from _nodes(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _nodes(schema["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural():
    """The rules the API server enforces for a structural schema (and pydantic's output would break)."""
    schema = crd_schema(crd.crd())
    for path, node in _nodes(schema):
        for forbidden in ("$ref", "$defs", "anyOf", "oneOf", "allOf", "not", "title", "const", "nullable"):
            assert forbidden not in node, f"{path}: {forbidden}"
        assert "type" in node or node.get("x-kubernetes-int-or-string") or node.get(
            "x-kubernetes-preserve-unknown-fields"), f"{path}: untyped"
        assert not ("properties" in node and "additionalProperties" in node), path
        assert not isinstance(node.get("additionalProperties"), bool), path
        if "default" in node:
            value = node["default"]
            assert not isinstance(value, dict | list) and value is not None, path
            assert "enum" not in node or value in node["enum"], path
        for name in node.get("required", []):
            assert name in node["properties"], f"{path}: required {name} is not a property"


def test_cel_rules_compile_and_fields_exist():
    schema = crd_schema(crd.crd())
    rules = [(path, r) for path, node in _nodes(schema) for r in node.get("x-kubernetes-validations", [])]
    assert len(rules) >= 12
    for path, rule in rules:
        compile_rule(rule["rule"])
        assert rule["message"] and "\n" not in rule["message"], path
        if "fieldPath" in rule:
            node = dict(_nodes(schema))[path]
            assert rule["fieldPath"].lstrip(".") in node["properties"], (path, rule["fieldPath"])


def test_names_subresources_and_columns():
    doc = crd.crd()
    assert doc["metadata"]["name"] == "inferenceendpoints.sluice.dev"
    names = doc["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == ("InferenceEndpoint", "inferenceendpoints",
                                                                     ["ie"])
    (version,) = doc["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    scale = version["subresources"]["scale"]
    assert version["subresources"]["status"] == {}
    schema = version["schema"]["openAPIV3Schema"]
    paths = {p for p, _ in _nodes(schema)}
    for key in ("specReplicasPath", "statusReplicasPath", "labelSelectorPath"):
        assert scale[key] in paths, key
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert set(columns) == {"Model", "Phase", "Ready", "Desired", "Prefill", "URL", "Age"}
    for name, path in columns.items():
        assert path in paths or path == ".metadata.creationTimestamp", name


def test_status_conditions_are_a_map_by_type():
    schema = crd_schema(crd.crd())
    conditions = schema["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert "type" in conditions["items"]["required"]
    phases = schema["properties"]["status"]["properties"]["phase"]["enum"]
    assert phases == ["Pending", "Loading", "Ready", "Idle", "Degraded", "Failed"]


def test_every_rule_is_documented():
    text = docs.reference()
    schema = crd_schema(crd.crd())
    for _, node in _nodes(schema):
        for rule in node.get("x-kubernetes-validations", []):
            assert rule["message"].replace("|", "\\|") in text
    for field in ("`spec.scaling.warmPool.replicas`", "`spec.accelerator.gpusPerNode`", "`status.phase`"):
        assert field in text
    assert spec.API_VERSION in text
