"""The operator's multi-tenancy policy: what an endpoint's author may make the operator run.

Creating an InferenceEndpoint creates pods with the operator's rights, not the author's: without a policy,
anyone who may create an endpoint runs any image, mounts any node directory read-write and reads any Secret
of the namespace into the engine. The cluster admin sets the policy once, in the chart (`policy`), which
passes it as SLUICE_* variables (config.py). An endpoint that breaks it is refused whole: nothing is applied
and its status says which field broke which rule (Ready=False, reason PolicyViolation).

What never depends on the policy (a path that can never be right, `/` as a hostPath) is the CRD's CEL rules'
job, in spec.py; this module holds what each installation decides.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterator
from dataclasses import dataclass

from .config import OperatorConfig
from .spec import InferenceEndpoint, SpecError


class PolicyViolation(SpecError):
    """The endpoint is valid but the operator's policy forbids it; the message names each field."""

    reason = "PolicyViolation"


@dataclass(frozen=True, slots=True)
class Violation:
    field: str  # where, as a user writes it: spec.pod.volumes[0].hostPath.path
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def image_allowed(image: str, prefixes: tuple[str, ...]) -> bool:
    """A prefix that ends in '/' matches what starts with it; any other matches at a boundary, so that
    `ghcr.io/acme` allows `ghcr.io/acme/engine:v1` and `ghcr.io/acme:v1` but not `ghcr.io/acme-evil/x`."""
    for prefix in prefixes:
        if prefix.endswith("/") and image.startswith(prefix):
            return True
        if image == prefix or (image.startswith(prefix) and image[len(prefix)] in "/:@"):
            return True
    return False


def path_allowed(path: str, prefixes: tuple[str, ...]) -> bool:
    """The directory is one of `prefixes` or beneath one, after normalization (`/a/../b` is `/b`)."""
    norm = posixpath.normpath(path)
    for prefix in prefixes:
        root = posixpath.normpath(prefix)
        if norm == root or norm.startswith(root.rstrip("/") + "/"):
            return True
    return False


def _host_paths(ep: InferenceEndpoint) -> Iterator[tuple[str, str]]:
    cache = ep.spec.model.cache
    if cache.type == "hostPath" and cache.path is not None:
        yield "spec.model.cache.path", cache.path
    for i, volume in enumerate(ep.spec.pod.volumes):
        if "hostPath" in volume:
            yield f"spec.pod.volumes[{i}].hostPath.path", volume["hostPath"].get("path", "")


def _pod_secrets(ep: InferenceEndpoint) -> Iterator[tuple[str, str]]:
    """Secrets whose data the engine container can read: env values and secret (or projected) volumes."""
    for i, env in enumerate(ep.spec.pod.env):
        ref = (env.get("valueFrom") or {}).get("secretKeyRef")
        if ref is not None:
            yield f"spec.pod.env[{i}].valueFrom.secretKeyRef.name", ref.get("name", "")
    for i, volume in enumerate(ep.spec.pod.volumes):
        if "secret" in volume:
            yield f"spec.pod.volumes[{i}].secret.secretName", volume["secret"].get("secretName", "")
        for j, source in enumerate((volume.get("projected") or {}).get("sources") or []):
            if "secret" in source:
                yield f"spec.pod.volumes[{i}].projected.sources[{j}].secret.name", source["secret"].get("name", "")


def violations(ep: InferenceEndpoint, cfg: OperatorConfig) -> list[Violation]:
    """Everything in the endpoint the policy forbids, in field order."""
    out: list[Violation] = []
    image = ep.spec.engine.image
    if image is not None and cfg.allowed_image_prefixes and image not in (cfg.engine_image, cfg.s3_fetch_image) \
            and not image_allowed(image, cfg.allowed_image_prefixes):
        out.append(Violation("spec.engine.image", f"image {image!r} is not allowed by the operator's policy; "
                             f"allowed: {', '.join(cfg.allowed_image_prefixes)} (chart value "
                             "policy.images.allowedPrefixes)"))
    for field, path in _host_paths(ep):
        if not cfg.host_path_allowed:
            out.append(Violation(field, "hostPath volumes are not allowed by the operator's policy (chart value "
                                 "policy.hostPath.allowed); use an emptyDir or pvc cache"))
        elif cfg.host_path_prefixes and not path_allowed(path, cfg.host_path_prefixes):
            # A hostPath model cache is handed to the engine's user by a root init container: a system directory
            # there would be the engine's to write.
            out.append(Violation(field, f"hostPath {path!r} is outside the directories the operator's policy "
                                 f"allows: {', '.join(cfg.host_path_prefixes)} (chart value "
                                 "policy.hostPath.pathPrefixes); use a directory under one of them"))
    for field, name in _pod_secrets(ep):
        if not cfg.pod_secret_refs_allowed:
            out.append(Violation(field, f"Secret {name!r}: the operator's policy allows no Secret in the engine "
                                 "container (chart value policy.secrets.podReferences); model credentials go in "
                                 "spec.model.credentialsSecretRef, which only the model fetch container reads"))
        elif cfg.allowed_secrets and name not in cfg.allowed_secrets:
            out.append(Violation(field, _not_listed(name, cfg)))
    creds = ep.spec.model.credentials_secret_ref
    if creds is not None and cfg.allowed_secrets and creds.name not in cfg.allowed_secrets:
        out.append(Violation("spec.model.credentialsSecretRef.name", _not_listed(creds.name, cfg)))
    return out


def _not_listed(name: str, cfg: OperatorConfig) -> str:
    return (f"Secret {name!r} is not one the operator's policy allows endpoints to read: "
            f"{', '.join(cfg.allowed_secrets)} (chart value policy.secrets.allowedNames)")


def check(ep: InferenceEndpoint, cfg: OperatorConfig) -> InferenceEndpoint:
    """The endpoint, if the policy allows it; else PolicyViolation naming every offending field."""
    found = violations(ep, cfg)
    if found:
        raise PolicyViolation(f"InferenceEndpoint {ep.name!r} breaks the operator's policy:\n"
                              + "\n".join(map(str, found)))
    return ep
