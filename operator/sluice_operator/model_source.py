"""Getting the weights into the pod: cache volume, fetch init container, and the engine's --model path.

The engine loads only local directories (or .gguf files). hf:// and s3:// models are fetched by an init
container into the cache volume, so a restart or a second pod on a shared cache finds them there; pvc://
models are mounted read-only where they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config import OperatorConfig
from .spec import InferenceEndpoint

CACHE_DIR = "/models-cache"  # SLUICE_CACHE_DIR of the engine image (engine_image/Dockerfile)
PVC_MODEL_DIR = "/models"
CONFIG_DIR = "/etc/sluice"  # the endpoint's ConfigMap, in the engine and fetch containers
OBJECTIVES_KEY = "objectives.json"  # spec.slo and spec.cost, re-read by the engine (--objectives-file)
OBJECTIVES_PATH = f"{CONFIG_DIR}/{OBJECTIVES_KEY}"
FETCH_CONTAINER = "fetch-model"  # the init container that fills the cache (status reads it: ModelDownloading)

# Mounted from the endpoint's ConfigMap and run by the engine image's Python (transformers brings
# huggingface_hub). Finished files are skipped, so a warm cache makes this a quick check.
FETCH_HF_SCRIPT = '''\
"""Fetch a Hugging Face Hub snapshot into the Sluice model cache."""
import os

from huggingface_hub import snapshot_download

path = snapshot_download(
    os.environ["SLUICE_MODEL_REPO"],
    revision=os.environ.get("SLUICE_MODEL_REVISION") or None,
    local_dir=os.environ["SLUICE_MODEL_DIR"],
)
print("model ready in", path, flush=True)
'''


@dataclass(slots=True)
class ModelMount:
    model_path: str  # the engine's --model
    volumes: list[dict[str, Any]] = field(default_factory=list)
    engine_mounts: list[dict[str, Any]] = field(default_factory=list)
    init_containers: list[dict[str, Any]] = field(default_factory=list)
    config_items: list[dict[str, str]] = field(default_factory=list)  # ConfigMap keys the fetch step reads


def _dir_safe(text: str) -> str:
    return text.strip("/").replace("/", "--")


def cache_volume(ep: InferenceEndpoint) -> dict[str, Any]:
    cache = ep.spec.model.cache
    if cache.type == "pvc":
        return {"name": "model-cache", "persistentVolumeClaim": {"claimName": cache.claim_name}}
    if cache.type == "hostPath":
        return {"name": "model-cache", "hostPath": {"path": cache.path, "type": "DirectoryOrCreate"}}
    empty: dict[str, Any] = {"sizeLimit": cache.size_limit} if cache.size_limit else {}
    return {"name": "model-cache", "emptyDir": empty}


def credentials_env_from(ep: InferenceEndpoint) -> list[dict[str, Any]]:
    ref = ep.spec.model.credentials_secret_ref
    return [{"secretRef": {"name": ref.name}}] if ref else []


def model_mount(ep: InferenceEndpoint, cfg: OperatorConfig, security: dict[str, Any],
                config_map: str) -> ModelMount:
    model = ep.spec.model
    common_mounts = [{"name": "model-cache", "mountPath": CACHE_DIR}, {"name": "tmp", "mountPath": "/tmp"}]
    if model.scheme == "pvc":
        claim, _, path = model.location.partition("/")
        return ModelMount(
            model_path=f"{PVC_MODEL_DIR}/{path}",
            volumes=[{"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}],
            engine_mounts=[{"name": "model", "mountPath": PVC_MODEL_DIR, "readOnly": True}],
        )
    if model.scheme == "hf":
        target = f"{CACHE_DIR}/hub/{model.location}/{_dir_safe(model.revision or 'main')}"
        fetch = {
            "name": FETCH_CONTAINER,
            "image": ep.spec.engine.image or cfg.engine_image,
            "command": ["python", f"{CONFIG_DIR}/fetch-hf.py"],
            "env": [
                {"name": "SLUICE_MODEL_REPO", "value": model.location},
                {"name": "SLUICE_MODEL_REVISION", "value": model.revision or ""},
                {"name": "SLUICE_MODEL_DIR", "value": target},
                {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
                {"name": "HOME", "value": "/tmp"},
            ],
            "volumeMounts": [*common_mounts, {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}],
        }
        volumes: list[dict[str, Any]] = []
        config_items = [{"key": "fetch-hf.py", "path": "fetch-hf.py"}]
    else:  # s3
        target = f"{CACHE_DIR}/s3/{model.location.rstrip('/')}"
        fetch = {
            "name": FETCH_CONTAINER,
            "image": cfg.s3_fetch_image,
            "command": ["aws", "s3", "sync", "--only-show-errors", model.uri, target],
            "env": [{"name": "HOME", "value": "/tmp"}],
            "volumeMounts": common_mounts,
        }
        volumes, config_items = [], []
    if ep.spec.model.credentials_secret_ref:
        fetch["envFrom"] = credentials_env_from(ep)
    fetch["securityContext"] = security
    return ModelMount(model_path=target, volumes=volumes, init_containers=[fetch], config_items=config_items)
