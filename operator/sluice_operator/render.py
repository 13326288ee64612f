"""`sluice render`: print the objects the operator would apply for InferenceEndpoint documents, offline."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, TextIO

import yaml

from .config import OperatorConfig
from .policy import check as check_policy
from .reconcile import reconcile
from .spec import SpecError, parse_endpoint


def load_documents(text: str, source: str) -> list[Any]:
    try:
        return [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as e:
        raise SpecError(f"{source}: not valid YAML: {e}") from None


def render_text(text: str, source: str = "<stdin>", cfg: OperatorConfig | None = None) -> list[dict[str, Any]]:
    """All manifests for every InferenceEndpoint in a YAML stream; SpecError names the bad field (PolicyViolation,
    one the operator's policy forbids).

    The operator's settings come from the same SLUICE_* environment variables the chart gives the operator
    (config.ENV), so `SLUICE_ENGINE_IMAGE=... sluice render` previews that operator's objects."""
    cfg = cfg or OperatorConfig.from_env()
    docs = load_documents(text, source)
    if not docs:
        raise SpecError(f"{source}: no InferenceEndpoint found")
    manifests: list[dict[str, Any]] = []
    for doc in docs:
        manifests += reconcile(check_policy(parse_endpoint(doc), cfg), cfg)
    return manifests


def dump(manifests: list[dict[str, Any]], output: str, out: TextIO) -> None:
    if output == "json":
        json.dump({"apiVersion": "v1", "kind": "List", "items": manifests}, out, indent=2)
        out.write("\n")
    else:
        yaml.safe_dump_all(manifests, out, sort_keys=False, width=110)


def run(filename: str, output: str = "yaml", out: TextIO | None = None) -> int:
    """Entry of `sluice render -f FILE [-o yaml|json]` (`-` reads stdin). Errors raise SpecError."""
    if filename == "-":
        text, source = sys.stdin.read(), "<stdin>"
    else:
        try:
            text, source = Path(filename).read_text(), filename
        except OSError as e:
            raise SpecError(f"cannot read {filename}: {e.strerror}") from None
    dump(render_text(text, source), output, out or sys.stdout)
    return 0
