"""core/v1 schema pieces (Affinity, Toleration, Volume, ...) for the CRD's pod fields.

Embedded in the InferenceEndpoint's openAPIV3Schema (as KServe embeds PodSpec pieces), so the API server
rejects a misspelt pod field (`nodeAfinity`, `tolerations[0].efect`) when the endpoint is created, instead
of the operator's apply of the child failing later, again and again. `sluice render` and the operator check
the same schemas (`errors`), so an endpoint that got past a lenient client is reported in its status.

The schemas are extracted offline from the Kubernetes OpenAPI definitions that kubernetes-validate ships,
for KUBE_VERSION: the oldest Kubernetes the chart supports, so every field accepted here exists on every
supported cluster. They are checked in (core_v1_schemas.json) so the operator needs no kubernetes-validate
at run time; regenerate after changing TYPES or KUBE_VERSION (a test fails while the file is stale):

    python -m sluice_operator.core_schemas > operator/sluice_operator/core_v1_schemas.json

Descriptions are dropped: the full texts would push the CRD past what a client-side apply can carry (the
last-applied annotation is limited to 256 KiB); the fields are the Kubernetes ones, documented there.
"""

from __future__ import annotations

import copy
import json
import sys
from functools import cache
from pathlib import Path
from typing import Any

KUBE_VERSION = "1.30.0"
SCHEMA_FILE = Path(__file__).with_name("core_v1_schemas.json")
# The core/v1 types the pod fields use, by their short names.
TYPES = ("Affinity", "Toleration", "TopologySpreadConstraint", "Volume", "VolumeMount", "EnvVar",
         "ResourceRequirements")
_PREFIX = "io.k8s.api.core.v1."
# Definitions that are not plain objects in a structural schema.
_INT_OR_STRING = ("io.k8s.apimachinery.pkg.api.resource.Quantity", "io.k8s.apimachinery.pkg.util.intstr.IntOrString")
# An ephemeral volume's claim template carries an ObjectMeta: labels and annotations only are meaningful there.
_OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
_KEPT = {"type", "properties", "required", "items", "additionalProperties", "enum", "format", "minimum", "maximum",
         "minLength", "maxLength", "pattern", "minItems", "maxItems"}


def _definitions(version: str) -> dict[str, Any]:
    import kubernetes_validate  # a development dependency: only the generator needs it

    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{version}-local"
    return json.loads((root / "_definitions.json").read_text())["$defs"]


def _structural(node: dict[str, Any], defs: dict[str, Any], seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """One OpenAPI (JSON Schema) node as a Kubernetes structural schema node, $refs inlined."""
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        if name in _INT_OR_STRING:
            return {"x-kubernetes-int-or-string": True}
        if name == _OBJECT_META:
            return {"type": "object", "properties": {
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}}}}
        if name in seen:
            raise ValueError(f"recursive definition {name}: cannot inline it")
        return _structural(defs[name], defs, (*seen, name))
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key not in _KEPT:
            continue  # description, x-kubernetes-patch-*, list types (core lists are atomic here), ...
        if key == "type":
            types = [t for t in (value if isinstance(value, list) else [value]) if t != "null"]
            if len(types) != 1:
                raise ValueError(f"cannot express type {value} structurally")
            out[key] = types[0]
        elif key == "properties":
            out[key] = {name: _structural(sub, defs, seen) for name, sub in value.items()}
        elif key in ("items", "additionalProperties"):
            if isinstance(value, dict):
                out[key] = _structural(value, defs, seen)
        elif key == "format" and value not in ("int32", "int64", "double", "byte"):
            continue
        else:
            out[key] = copy.deepcopy(value)
    if "properties" in node and "type" not in out:
        out["type"] = "object"
    if "required" in out:
        out["required"] = sorted(out["required"])
    return out


def extract(version: str = KUBE_VERSION) -> dict[str, Any]:
    defs = _definitions(version)
    return {"kubernetesVersion": version,
            "types": {name: _structural(defs[_PREFIX + name], defs, (_PREFIX + name,)) for name in TYPES}}


@cache
def _checked_in() -> dict[str, Any]:
    return json.loads(SCHEMA_FILE.read_text())


def schema(name: str) -> dict[str, Any]:
    """The structural schema of a core/v1 type (a fresh copy: callers may add to it)."""
    return copy.deepcopy(_checked_in()["types"][name])


def errors(node: dict[str, Any], value: Any, path: str) -> list[str]:
    """What the API server's structural validation (strict field validation) refuses in `value`, each message
    naming the field. Types, unknown fields, required fields and enums: what a typo trips over."""
    if value is None:
        return []
    if node.get("x-kubernetes-int-or-string"):
        ok = isinstance(value, int | str) and not isinstance(value, bool)
        return [] if ok else [f"{path}: must be an integer or a string"]
    if node.get("x-kubernetes-preserve-unknown-fields") and "properties" not in node:
        return []
    expected = node.get("type")
    checks = {"object": dict, "array": list, "string": str, "boolean": bool, "integer": int, "number": int | float}
    if expected in checks and (not isinstance(value, checks[expected]) or
                               (expected in ("integer", "number") and isinstance(value, bool))):
        return [f"{path}: must be of type {expected}"]
    out: list[str] = []
    if "enum" in node and value not in node["enum"]:
        out.append(f"{path}: must be one of {', '.join(map(str, node['enum']))}")
    if expected == "array":
        for i, item in enumerate(value):
            out += errors(node.get("items", {}), item, f"{path}[{i}]")
    elif expected == "object":
        props = node.get("properties")
        if props is not None:
            out += [f"{path}.{key}: unknown field (not in core/v1)" for key in value if key not in props]
            out += [f"{path}.{key}: required" for key in node.get("required", []) if key not in value]
            out += [e for key, sub in props.items() if key in value for e in errors(sub, value[key], f"{path}.{key}")]
        elif isinstance(node.get("additionalProperties"), dict):
            out += [e for key, item in value.items()
                    for e in errors(node["additionalProperties"], item, f"{path}.{key}")]
    return out


if __name__ == "__main__":
    sys.stdout.write(json.dumps(extract(), indent=1, sort_keys=True) + "\n")
