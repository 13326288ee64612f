"""The ServedModel resource (issue 42, model versions by weight): one model name split over InferenceEndpoints.

Each version is an InferenceEndpoint of its own (its own workload, Service, ScaledObject, scale to zero); a
ServedModel in the same namespace names them with weights, and aliases that lead to one version. The gateway reads
ServedModels and splits requests (autoscaler/sluice_autoscaler/versions.py); the operator only writes their status:
each version's weight, readiness and the share of new requests it gets now (`served_model_status`, pure), and a
Ready condition. Nothing is rendered for a ServedModel: `sluice render` is unaffected.

The pydantic models below are the source of the CRD, as spec.py is of InferenceEndpoint's:

    python -m sluice_operator.served_model crd > crds/sluice.dev_servedmodels.yaml
    python -m sluice_operator.served_model docs > docs/reference-servedmodel.md
"""

from __future__ import annotations

import re
import sys
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.alias_generators import to_camel

from sluice_contract import NAME_SCOPE_CLUSTER, NAME_SCOPE_NAMESPACE

from . import crd as crd_gen
from . import docs as docs_gen
from .apply import Kind
from .spec import (
    GROUP,
    MAX_NAME_LENGTH,
    VERSION,
    Condition,
    Rule,
    SpecError,
    _Object,
    format_errors,
    without_nulls,
)

SM_KIND = "ServedModel"
SM_PLURAL = "servedmodels"
SM_SINGULAR = "servedmodel"
SM_SHORT_NAMES = ["sm"]
SERVED_MODEL_KIND = Kind(f"{GROUP}/{VERSION}", SM_KIND, SM_PLURAL, optional=True)
MAX_VERSIONS = 16
MAX_ALIASES = 16
MAX_WEIGHT = 1_000_000
DEFAULT_SESSION_HEADER = "x-session-id"  # the gateway's default too (versions.DEFAULT_SESSION_HEADER)
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]*$"  # a name clients send; no '/' (namespaced forms are derived)
ALIAS_NAME_MESSAGE = "an alias is a model name: letters, digits, '.', '_', ':' and '-', at most 128 characters"
ENDPOINT_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"  # an InferenceEndpoint's metadata.name


class ServedVersion(_Object):
    """One version: an InferenceEndpoint in the ServedModel's namespace, and its weight."""

    endpoint: str = Field(..., min_length=1, max_length=MAX_NAME_LENGTH, pattern=ENDPOINT_NAME_PATTERN,
                          description="The InferenceEndpoint's name (same namespace).")
    weight: int = Field(..., ge=0, le=MAX_WEIGHT, description=(
        "Its share of new requests: weight / the sum of the weights of the ready versions (any non-negative "
        "integers; 90 and 10 are 90%/10%). 0: no new requests (those in flight finish); the version stays "
        "reachable by an alias."))


class ServedModelSpec(_Object):
    """A model name clients send, split over versions by weight."""

    RULES = (
        Rule("self.versions.all(v, self.versions.exists_one(w, w.endpoint == v.endpoint))",
             "versions[].endpoint must be unique", lambda s: len({v.endpoint for v in s.versions}) == len(s.versions),
             field_path=".versions"),
        Rule("self.versions.exists(v, v.weight > 0)",
             "at least one version must have a weight above 0", lambda s: any(v.weight > 0 for v in s.versions),
             field_path=".versions"),
        Rule("!has(self.aliases) || self.aliases.all(a, self.versions.exists(v, v.endpoint == self.aliases[a]))",
             "every alias must lead to one of versions[].endpoint",
             lambda s: all(t in {v.endpoint for v in s.versions} for t in s.aliases.values()),
             field_path=".aliases"),
        Rule("!has(self.aliases) || !(self.model in self.aliases)",
             "an alias must not be the model's own name", lambda s: s.model not in s.aliases, field_path=".aliases"),
    )

    model: str = Field(..., min_length=1, max_length=128, pattern=MODEL_NAME_PATTERN, description=(
        "The name clients send in `model`, published as `<namespace>/<model>` (and plain with nameScope Cluster, "
        "or when the gateway serves one namespace), before any endpoint's claim on the same name. The request "
        "goes on under the chosen version's served name."))
    name_scope: Literal["Namespace", "Cluster"] = Field(NAME_SCOPE_NAMESPACE, description=(
        "As an InferenceEndpoint's spec.model.nameScope, for the model and its aliases."))
    versions: list[ServedVersion] = Field(..., min_length=1, max_length=MAX_VERSIONS, description=(
        "The versions and their weights. Only versions with a ready replica (as the gateway sees it) and a weight "
        "above 0 take new requests; when none of them is ready, requests go to the weighted choice and are held "
        "there (waking it from zero)."))
    aliases: dict[str, str] = Field(default_factory=dict, max_length=MAX_ALIASES, json_schema_extra={
        "additionalProperties": {"type": "string", "maxLength": MAX_NAME_LENGTH},
        "propertyNames": {"pattern": MODEL_NAME_PATTERN}}, description=(
        "Names that lead to one version always, whatever its weight (e.g. chat-canary: chat-v2): alias -> the "
        "version's endpoint. Published like the model."))

    @field_validator("aliases")
    @classmethod
    def _alias_names(cls, aliases: dict[str, str]) -> dict[str, str]:
        for a in aliases:  # the CRD's rule on spec.aliases (open_api_schema)
            if len(a) > 128 or not re.fullmatch(MODEL_NAME_PATTERN, a):
                raise ValueError(ALIAS_NAME_MESSAGE)
        return aliases
    session_header: str = Field(DEFAULT_SESSION_HEADER, min_length=1, max_length=128,
                                pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$", description=(
        "A request header whose value keeps a session on one version while the weights are unchanged; a weight "
        "shift moves only the sessions whose share changed hands. Requests without it are spread by smooth "
        "weighted round-robin."))


class VersionStatus(_Object):
    endpoint: str = Field(max_length=MAX_NAME_LENGTH, description="The version's InferenceEndpoint.")
    weight: int = Field(ge=0, description="Its weight in the spec.")
    ready: bool = Field(description="The endpoint exists and has a ready serving replica.")
    traffic_percent: int = Field(ge=0, le=100, description=(
        "The share of new requests it gets now, rounded: its weight over the ready weighted versions' (none "
        "ready: over all weighted ones)."))
    message: str | None = Field(None, max_length=1024)


class ServedModelStatus(_Object):
    """The observed state, written by the operator only."""

    observed_generation: int | None = Field(None, ge=0)
    versions: list[VersionStatus] = Field(default_factory=list, max_length=MAX_VERSIONS, json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["endpoint"]})
    conditions: list[Condition] = Field(default_factory=list, json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})


class ServedModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, extra="ignore", strict=True)

    spec: ServedModelSpec


def parse_served_model(doc: Any) -> ServedModelSpec:
    """Validate a ServedModel document's spec; SpecError names every offending field."""
    try:
        return ServedModel.model_validate(without_nulls(doc if isinstance(doc, dict) else {})).spec
    except ValidationError as e:
        raise SpecError("invalid ServedModel:\n" + format_errors(e)) from None


# -- status (pure) --------------------------------------------------------------------------------------------
def endpoint_ready(ie: dict[str, Any] | None) -> bool:
    """A version is ready when its InferenceEndpoint has a ready serving replica (as the gateway routes only to
    ready backends; an endpoint scaled to zero is not ready, though a held request wakes it)."""
    status = (ie or {}).get("status") or {}
    ready = ((status.get("replicas") or {}).get("ready") or 0) > 0
    return ready or any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
                        if isinstance(c, dict)) and status.get("phase") != "Idle"


def traffic_shares(weights: dict[str, int], ready: dict[str, bool]) -> dict[str, float]:
    """The gateway's rule (versions.traffic_shares; a test keeps the two the same)."""
    live = {v: w for v, w in weights.items() if w > 0 and ready.get(v)} or {v: w for v, w in weights.items() if w > 0}
    total = sum(live.values())
    return {v: (live.get(v, 0) / total if total else 0.0) for v in weights}


def served_model_status(body: dict[str, Any], endpoints: dict[str, dict[str, Any]], now: str,
                        previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """The status of a ServedModel, given the InferenceEndpoints of its namespace by name."""
    meta = body.get("metadata") or {}
    previous = previous if previous is not None else (body.get("status") or {})
    try:
        spec = parse_served_model(body)
    except SpecError as e:
        cond = _condition("Ready", "False", "InvalidSpec", str(e)[:32768], now, previous, meta)
        return without_nulls({"observedGeneration": meta.get("generation"), "versions": [], "conditions": [cond]})
    weights = {v.endpoint: v.weight for v in spec.versions}
    ready = {v: endpoint_ready(endpoints.get(v)) for v in weights}
    shares = traffic_shares(weights, ready)
    versions = []
    for v in spec.versions:
        entry: dict[str, Any] = {"endpoint": v.endpoint, "weight": v.weight, "ready": ready[v.endpoint],
                                 "trafficPercent": round(shares[v.endpoint] * 100)}
        if v.endpoint not in endpoints:
            entry["message"] = f"InferenceEndpoint {v.endpoint!r} not found in this namespace"
        versions.append(entry)
    missing = [v for v in weights if v not in endpoints]
    live = [v for v, w in weights.items() if w > 0 and ready[v]]
    if missing:
        cond = _condition("Ready", "False", "EndpointNotFound", "not found: " + ", ".join(missing), now, previous,
                          meta)
    elif live:
        cond = _condition("Ready", "True", "VersionsReady", "serving: " + ", ".join(
            f"{v} {round(shares[v] * 100)}%" for v in live), now, previous, meta)
    else:
        cond = _condition("Ready", "False", "NoVersionReady", "no weighted version has a ready replica; requests "
                          "are held at the weighted choice (which wakes it from zero)", now, previous, meta)
    return without_nulls({"observedGeneration": meta.get("generation"), "versions": versions, "conditions": [cond]})


def _condition(type_: str, status: str, reason: str, message: str, now: str, previous: dict[str, Any],
               meta: dict[str, Any]) -> dict[str, Any]:
    old = next((c for c in previous.get("conditions") or [] if c.get("type") == type_), None)
    since = old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime") else now
    return {"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": since,
            "observedGeneration": meta.get("generation")}


def versions_of(body: dict[str, Any]) -> set[str]:
    """The endpoints a ServedModel names (its versions), read defensively."""
    versions = ((body.get("spec") or {}).get("versions")) or []
    return {v["endpoint"] for v in versions if isinstance(v, dict) and isinstance(v.get("endpoint"), str)}


# -- the CRD and its reference ----------------------------------------------------------------------------------
def open_api_schema() -> dict[str, Any]:
    spec = crd_gen.to_structural(ServedModelSpec.model_json_schema(by_alias=True, mode="validation"))
    aliases = spec["properties"]["aliases"]
    aliases.pop("propertyNames", None)  # not structural; the CEL rule below checks alias names instead
    aliases.setdefault("x-kubernetes-validations", []).append({
        "rule": f"self.all(a, size(a) <= 128 && a.matches('{MODEL_NAME_PATTERN}'))",
        "message": ALIAS_NAME_MESSAGE})
    return {
        "type": "object",
        "description": "A model name clients send, served by several InferenceEndpoints (versions) by weight.",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": crd_gen.to_structural(ServedModelStatus.model_json_schema(by_alias=True, mode="validation")),
        },
        "required": ["spec"],
    }


def crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{SM_PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "names": {"kind": SM_KIND, "listKind": f"{SM_KIND}List", "plural": SM_PLURAL, "singular": SM_SINGULAR,
                      "shortNames": SM_SHORT_NAMES, "categories": ["sluice"]},
            "scope": "Namespaced",
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": open_api_schema()},
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": "Model", "type": "string", "jsonPath": ".spec.model"},
                    {"name": "Ready", "type": "string", "jsonPath": ".status.conditions[?(@.type=='Ready')].status"},
                    {"name": "Versions", "type": "string", "jsonPath": ".spec.versions[*].endpoint"},
                    {"name": "Weights", "type": "string", "jsonPath": ".spec.versions[*].weight"},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
            }],
        },
    }


def crd_yaml() -> str:
    header = ("# Generated by `python -m sluice_operator.served_model crd` from "
              "operator/sluice_operator/served_model.py; do not edit.\n")
    return header + yaml.safe_dump(crd(), sort_keys=False, width=110)


def reference() -> str:
    schema = open_api_schema()
    out = [
        "# ServedModel reference",
        "",
        "<!-- Generated by `python -m sluice_operator.served_model docs > docs/reference-servedmodel.md` from "
        "operator/sluice_operator/served_model.py; do not edit. -->",
        "",
        f"`apiVersion: {GROUP}/{VERSION}`, `kind: {SM_KIND}` (plural `{SM_PLURAL}`, short name "
        f"`{', '.join(SM_SHORT_NAMES)}`), namespaced, with the status subresource. Model versions by weight: "
        "docs/gateway.md, \"Model versions and rollouts\".",
        "",
    ]
    for part in ("spec", "status"):
        section, rules = docs_gen.field_table(schema, part)
        out += section
        if part == "spec":
            out += ["## Rules", "", "Checked by the API server (CEL `x-kubernetes-validations`), with these "
                    "messages; the gateway's backends file `models:` checks the same.", "",
                    "| where | message | CEL |", "|---|---|---|", *rules, ""]
    return "\n".join(out)


assert NAME_SCOPE_CLUSTER == "Cluster"  # the Literal above spells the contract's scopes

if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "crd"
    sys.stdout.write(crd_yaml() if what == "crd" else reference())
