"""What the engine needs at run time on a GPU (issue 15, acceptance item 6), read from the Dockerfile and from the
pods the operator renders: a C compiler and Python.h (Triton builds its CUDA launcher with them at the first
kernel launch), a non-root user, and TRITON_CACHE_DIR on the writable model-cache volume, so compiled kernels
outlive the pod. No Docker here: the Dockerfile is parsed."""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import PurePosixPath
from typing import Any

import pytest
from operator_schemas import EXAMPLES, ROOT, load_yaml

from sluice_operator.reconcile import reconcile
from sluice_operator.routing import COMPONENT as PICKER
from sluice_operator.spec import parse_endpoint

DOCKERFILE = ROOT / "engine_image" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in DOCKERFILE.read_text().splitlines()
                                          if not line.lstrip().startswith("#")))
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def env_of_image() -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in instructions():
        if word == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def apt_packages() -> set[str]:
    pkgs: set[str] = set()
    for word, rest in instructions():
        if word == "RUN":
            for cmd in rest.split("&&"):
                argv = shlex.split(cmd)
                if argv[:2] == ["apt-get", "install"]:
                    pkgs |= {a for a in argv[2:] if not a.startswith("-")}
    return pkgs


def test_the_image_has_a_c_compiler_and_python_headers():
    pkgs = apt_packages()
    assert {"gcc", "libc6-dev"} <= pkgs or "build-essential" in pkgs  # cc and the C library's headers
    assert "python3-dev" in pkgs  # Python.h of the interpreter the venv is made from
    assert "g++" in pkgs or "build-essential" in pkgs  # the CPU backend's C++ kernels, when serving on CPU
    # The build itself proves Python.h compiles where Triton looks for it.
    runs = " ".join(rest for word, rest in instructions() if word == "RUN")
    assert "#include <Python.h>" in runs and "sysconfig" in runs


def test_the_triton_cache_is_on_the_model_cache_volume_and_the_user_is_not_root():
    env = env_of_image()
    volumes = [v for word, rest in instructions() if word == "VOLUME" for v in re.findall(r'"([^"]+)"', rest)]
    assert env["SLUICE_CACHE_DIR"] in volumes
    assert PurePosixPath(env["TRITON_CACHE_DIR"]).is_relative_to(env["SLUICE_CACHE_DIR"])
    users = [rest for word, rest in instructions() if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    # The volume's directory belongs to that user (a fresh named volume copies the image's ownership).
    uid = users[-1].split(":")[0]
    assert any(f"chown {uid}:" in rest and env["SLUICE_CACHE_DIR"] in rest for word, rest in instructions()
               if word == "RUN")


# -- the pods the operator renders -----------------------------------------------------------------------------
def pod_templates(manifests: list[dict]) -> list[dict]:
    """The engine pods' templates (not the endpoint picker's: it runs `sluice gateway`, which compiles nothing)."""
    out = []
    for m in manifests:
        if m["kind"] == "Deployment" and m["metadata"]["labels"].get("app.kubernetes.io/component") != PICKER:
            out.append(m["spec"]["template"])
        elif m["kind"] == "LeaderWorkerSet":
            lwt = m["spec"]["leaderWorkerTemplate"]
            out += [lwt["leaderTemplate"], lwt["workerTemplate"]]
    return out


def with_cache(doc: dict[str, Any], cache: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    doc["spec"]["model"]["cache"] = cache
    return doc


CACHES = {
    "as-written": None,
    "pvc": {"type": "pvc", "claimName": "models"},
    "hostPath": {"type": "hostPath", "path": "/var/lib/sluice"},
    "shared": {"type": "shared", "size": "40Gi", "storageClassName": "nfs-rwx"},
}


@pytest.mark.parametrize("cache", CACHES, ids=str)
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_engine_container_writes_triton_kernels_to_a_mounted_writable_volume(path, cache):
    doc = load_yaml(path)
    if CACHES[cache] is not None:
        if not str(doc["spec"]["model"]["uri"]).startswith(("hf://", "s3://")):
            pytest.skip("a pvc:// model has no download cache to choose")
        doc = with_cache(doc, CACHES[cache])
    templates = pod_templates(reconcile(parse_endpoint(doc)))
    assert templates
    for template in templates:  # serving, warm pool, LeaderWorkerSet leader and workers
        (engine,) = template["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in engine["env"]}
        triton = PurePosixPath(env["TRITON_CACHE_DIR"])
        assert triton == PurePosixPath(env["SLUICE_CACHE_DIR"]) / "triton"
        mounts = [m for m in engine["volumeMounts"] if triton.is_relative_to(m["mountPath"])]
        assert mounts, f"{triton} is on no volume (the root filesystem is read-only)"
        mount = max(mounts, key=lambda m: len(m["mountPath"]))  # the innermost mount holds it
        assert not mount.get("readOnly"), mount
        assert mount["name"] in {v["name"] for v in template["spec"]["volumes"]}
        if cache in ("pvc", "hostPath"):  # a cache that outlives the pod: compiled kernels do too
            assert mount["name"] == "model-cache"
