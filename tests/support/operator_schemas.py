"""Test helpers for the operator: the API server's view of a custom resource, without an API server.

- `strict_schema`: an openAPIV3Schema as a JSON Schema that rejects unknown fields (kubectl's strict field
  validation) and understands x-kubernetes-int-or-string.
- `apply_defaults`: structural defaulting, as the API server does before validating.
- `cel_violations`: evaluates every x-kubernetes-validations rule on the values it is scoped to (cel-python).
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import pytest
import yaml

ROOT = Path(__file__).parents[2]
REFERENCE_CRDS = Path(__file__).parents[2].parent / "shared" / "reference-crds"
CRD_FILE = ROOT / "crds" / "sluice.dev_inferenceendpoints.yaml"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def load_yaml(path: Path) -> Any:
    # The C loader where PyYAML has it: the reference CRDs are megabytes of YAML.
    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def crd_schema(crd: dict[str, Any], version: str | None = None) -> dict[str, Any]:
    versions = crd["spec"]["versions"]
    chosen = next(v for v in versions if v["name"] == version) if version else next(
        v for v in versions if v.get("storage"))
    return chosen["schema"]["openAPIV3Schema"]


@cache
def reference_crd(filename: str) -> dict[str, Any]:
    path = REFERENCE_CRDS / filename
    if not path.is_file():
        pytest.skip(f"reference CRDs not found at {REFERENCE_CRDS} (a checkout of ../shared); "
                    "custom resources of KEDA, LWS and the Prometheus operator are not validated")
    return load_yaml(path)


@cache
def gateway_crd(filename: str) -> dict[str, Any]:
    """One of the Gateway API or Inference Extension CRDs scripts/get-gateway-crds.sh fetches from the projects'
    Go modules (cached after the first run); skips where it cannot (no Go, no module proxy)."""
    import subprocess

    proc = subprocess.run(["bash", str(ROOT / "scripts" / "get-gateway-crds.sh")], capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0:
        pytest.skip(f"scripts/get-gateway-crds.sh failed ({proc.stderr.strip()[-300:]}); Gateway API kinds not validated")
    return load_yaml(Path(proc.stdout.strip().splitlines()[-1]) / filename)


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    node = {k: strict_schema(v) if k in ("items", "additionalProperties") and isinstance(v, dict) else v
            for k, v in schema.items()}
    if "properties" in node:
        node["properties"] = {k: strict_schema(v) for k, v in node["properties"].items()}
        if not node.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in node:
            node["additionalProperties"] = False
    if node.get("x-kubernetes-int-or-string"):
        node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("x-kubernetes-embedded-resource"):  # apiVersion/kind/metadata are implicit there
        node.pop("additionalProperties", None)
    return node


_VALIDATORS: dict[int, tuple[dict[str, Any], jsonschema.Draft4Validator]] = {}


def _validator(schema: dict[str, Any]) -> jsonschema.Draft4Validator:
    # Keyed by identity, holding the schema so its id cannot be reused; schemas here are never mutated.
    if id(schema) not in _VALIDATORS:
        _VALIDATORS[id(schema)] = (schema, jsonschema.Draft4Validator(strict_schema(schema)))
    return _VALIDATORS[id(schema)][1]


def schema_errors(schema: dict[str, Any], obj: Any) -> list[str]:
    """Messages of everything the OpenAPI schema rejects (Draft 4: OpenAPI v3's exclusiveMinimum flags)."""
    validator = _validator(schema)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    obj = copy.deepcopy(obj)
    _default(schema, obj)
    return obj


def _default(schema: dict[str, Any], obj: Any) -> None:
    if isinstance(obj, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in obj and "default" in sub:
                obj[name] = copy.deepcopy(sub["default"])
            if name in obj:
                _default(sub, obj[name])
        if isinstance(schema.get("additionalProperties"), dict):
            for value in obj.values():
                _default(schema["additionalProperties"], value)
    elif isinstance(obj, list) and "items" in schema:
        for item in obj:
            _default(schema["items"], item)


_ENV = celpy.Environment()


@cache
def _program(rule: str) -> Any:
    return _ENV.program(_ENV.compile(rule))


def compile_rule(rule: str) -> None:
    _program(rule)


def cel_violations(schema: dict[str, Any], obj: Any) -> list[str]:
    """Messages of every failing rule, evaluated on `obj` as given (apply_defaults first, as the server)."""
    out: list[str] = []
    _walk(schema, obj, out)
    return out


def _walk(schema: dict[str, Any], obj: Any, out: list[str]) -> None:
    for rule in schema.get("x-kubernetes-validations", []):
        result = _program(rule["rule"]).evaluate({"self": celpy.json_to_cel(obj)})
        if isinstance(result, Exception) or not bool(result):
            out.append(rule.get("message", f"failed rule: {rule['rule']}"))
    if isinstance(obj, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in obj:
                _walk(sub, obj[name], out)
        if isinstance(schema.get("additionalProperties"), dict):
            for value in obj.values():
                _walk(schema["additionalProperties"], value, out)
    elif isinstance(obj, list) and "items" in schema:
        for item in obj:
            _walk(schema["items"], item, out)


def api_server_errors(schema: dict[str, Any], obj: Any) -> list[str]:
    """What creating `obj` would be refused for: schema first, then CEL on the defaulted object."""
    errors = schema_errors(schema, obj)
    return errors or cel_violations(schema, apply_defaults(schema, obj))
