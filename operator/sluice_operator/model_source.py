"""Getting the weights into the pod: fetch init container (or the shared cache's Job), and the engine's --model.

The engine loads only local directories (or .gguf files). hf:// and s3:// models are fetched into the cache
volume (model_cache.py), so a restart or a second pod on the same cache finds them there: by an init container
of each pod, or, with a shared cache, once by a Job the pods wait for. pvc:// models are mounted read-only
where they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import model_cache
from .config import OperatorConfig
from .model_cache import CACHE_DIR, COMPLETE_MARKER, PROGRESS_PERIOD_S, PROGRESS_PREFIX
from .spec import InferenceEndpoint

PVC_MODEL_DIR = "/models"
SCRATCH_CACHE_DIR = "/tmp/sluice-cache"
CONFIG_DIR = "/etc/sluice"  # the endpoint's ConfigMap, in the engine and fetch containers
OBJECTIVES_KEY = "objectives.json"  # spec.slo and spec.cost, re-read by the engine (--objectives-file)
OBJECTIVES_PATH = f"{CONFIG_DIR}/{OBJECTIVES_KEY}"
FETCH_CONTAINER = "fetch-model"  # the init container that fills the cache (status reads it: Downloading)

# Run by the engine image's Python (transformers brings huggingface_hub): from the endpoint's ConfigMap in a
# fetch init container, inline in the shared cache's Job. A directory with the completion marker is done and not
# checked against the Hub again (a cold start needs no network); otherwise finished files are skipped. Progress:
# the bytes in the model's directory so far (partial downloads included), every PROGRESS_PERIOD_S.
FETCH_HF_SCRIPT = f'''\
"""Fetch a Hugging Face Hub snapshot into the Sluice model cache, once."""
import json
import os
import threading
from pathlib import Path

target = Path(os.environ["SLUICE_MODEL_DIR"])
marker = target / "{COMPLETE_MARKER}"


def on_disk():
    total = 0
    for root, _, files in os.walk(target):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:  # renamed or removed while we looked
                pass
    return total


def report(stop):
    while not stop.wait({PROGRESS_PERIOD_S}):
        print(f"{PROGRESS_PREFIX} {{on_disk()}} bytes", flush=True)


if marker.is_file():
    print("model already complete in", target, flush=True)
    raise SystemExit(0)
from huggingface_hub import snapshot_download

stop = threading.Event()
threading.Thread(target=report, args=(stop,), daemon=True).start()
path = snapshot_download(
    os.environ["SLUICE_MODEL_REPO"],
    revision=os.environ.get("SLUICE_MODEL_REVISION") or None,
    local_dir=target,
)
stop.set()
print(f"{PROGRESS_PREFIX} {{on_disk()}} bytes", flush=True)
marker.write_text(json.dumps({{"source": os.environ["SLUICE_MODEL_REPO"],
                              "revision": os.environ.get("SLUICE_MODEL_REVISION") or None}}) + "\\n")
print("model ready in", path, flush=True)
'''

# The same steps for s3:// in the AWS CLI image's shell: skip when complete, report progress, mark complete.
# The reporter ticks every second, so the sleep it leaves behind when killed ends at once.
FETCH_S3_SCRIPT = (
    f'if [ -f "$1/{COMPLETE_MARKER}" ]; then echo "model already complete in $1"; exit 0; fi; '
    f'(n=0; while sleep 1; do n=$((n+1)); [ $((n % {PROGRESS_PERIOD_S})) -ne 0 ] || '
    f'echo "{PROGRESS_PREFIX} $(du -sb "$1" 2>/dev/null | cut -f1) bytes"; done) & '
    'aws s3 sync --only-show-errors "$0" "$1"; rc=$?; kill $! 2>/dev/null; [ $rc -eq 0 ] || exit $rc; '
    f'echo "{PROGRESS_PREFIX} $(du -sb "$1" | cut -f1) bytes"; echo "$0" > "$1/{COMPLETE_MARKER}"'
)


@dataclass(slots=True)
class ModelMount:
    model_path: str  # the engine's --model
    cache_volume: dict[str, Any]
    cache_mount: dict[str, Any]
    # The engine's SLUICE_CACHE_DIR (its compiled CPU kernels, GGUF conversions): the cache volume, unless that is
    # read-only (shared), then a directory of the pod's /tmp.
    engine_cache_dir: str = CACHE_DIR
    volumes: list[dict[str, Any]] = field(default_factory=list)
    engine_mounts: list[dict[str, Any]] = field(default_factory=list)
    init_containers: list[dict[str, Any]] = field(default_factory=list)
    config_items: list[dict[str, str]] = field(default_factory=list)  # ConfigMap keys the fetch step reads


def _dir_safe(text: str) -> str:
    return text.strip("/").replace("/", "--")


def model_dir(ep: InferenceEndpoint) -> str:
    """Where an hf:// or s3:// model lands in the cache (the engine's --model)."""
    model = ep.spec.model
    if model.scheme == "hf":
        return f"{CACHE_DIR}/hub/{model.location}/{_dir_safe(model.revision or 'main')}"
    return f"{CACHE_DIR}/s3/{model.location.rstrip('/')}"


def credentials_env_from(ep: InferenceEndpoint) -> list[dict[str, Any]]:
    ref = ep.spec.model.credentials_secret_ref
    return [{"secretRef": {"name": ref.name}}] if ref else []


def fetch_container(ep: InferenceEndpoint, cfg: OperatorConfig, security: dict[str, Any], *,
                    script_from_config: bool) -> dict[str, Any]:
    """The container that downloads an hf:// or s3:// model into the cache volume. `script_from_config`: the
    Hub script from the endpoint's ConfigMap (mounted at CONFIG_DIR), else inline (the shared Job, which no
    endpoint's ConfigMap may outlive)."""
    model, target = ep.spec.model, model_dir(ep)
    cache = {"name": model_cache.CACHE_VOLUME, "mountPath": CACHE_DIR}
    tmp = dict(model_cache.FETCH_HOME_MOUNT)  # its own /tmp and HOME, not the engine's (model_cache.py)
    if model.scheme == "hf":
        fetch: dict[str, Any] = {
            "name": FETCH_CONTAINER,
            "image": ep.spec.engine.image or cfg.engine_image,
            "command": (["python", f"{CONFIG_DIR}/fetch-hf.py"] if script_from_config
                        else ["python", "-c", FETCH_HF_SCRIPT]),
            "env": [
                {"name": "SLUICE_MODEL_REPO", "value": model.location},
                {"name": "SLUICE_MODEL_REVISION", "value": model.revision or ""},
                {"name": "SLUICE_MODEL_DIR", "value": target},
                {"name": "HF_HOME", "value": "/tmp/huggingface"},
                {"name": "HOME", "value": "/tmp"},
            ],
            "volumeMounts": [cache, tmp],
        }
        if script_from_config:
            fetch["volumeMounts"].append({"name": "config", "mountPath": CONFIG_DIR, "readOnly": True})
    else:  # s3
        fetch = {
            "name": FETCH_CONTAINER,
            "image": cfg.s3_fetch_image,
            "command": ["sh", "-c", FETCH_S3_SCRIPT, model.uri, target],
            "env": [{"name": "HOME", "value": "/tmp"}],
            "volumeMounts": [cache, tmp],
        }
    if model.credentials_secret_ref:
        fetch["envFrom"] = credentials_env_from(ep)
    fetch["securityContext"] = security
    return fetch


def shared_cache_manifests(ep: InferenceEndpoint, cfg: OperatorConfig, container_security: dict[str, Any],
                           pod_security: dict[str, Any]) -> list[dict[str, Any]]:
    """The shared claim and its fetch Job, when the endpoint uses a shared cache; else nothing."""
    if not model_cache.uses_shared_cache(ep):
        return []
    fetch = fetch_container(ep, cfg, container_security, script_from_config=False)
    return model_cache.shared_cache_manifests(ep, fetch, pod_security)


def model_mount(ep: InferenceEndpoint, cfg: OperatorConfig, security: dict[str, Any], config_map: str, *,
                run_as: int) -> ModelMount:
    """The engine pods' model volumes and init containers. `security`: the containers' securityContext;
    `run_as`: the engine's uid (and gid), which a hostPath cache is handed to."""
    model, cache = ep.spec.model, ep.spec.model.cache
    volume, mount = model_cache.cache_volume(ep), model_cache.cache_mount(ep)
    image = ep.spec.engine.image or cfg.engine_image
    init: list[dict[str, Any]] = []
    if cache.type == "hostPath":
        init.append(model_cache.own_cache_container(image, run_as, security))
    if model.scheme == "pvc":
        claim, _, path = model.location.partition("/")
        return ModelMount(
            model_path=f"{PVC_MODEL_DIR}/{path}", cache_volume=volume, cache_mount=mount,
            volumes=[{"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}],
            engine_mounts=[{"name": "model", "mountPath": PVC_MODEL_DIR, "readOnly": True}],
            init_containers=init,
        )
    target = model_dir(ep)
    if model_cache.uses_shared_cache(ep):  # the Job downloads; the pods wait for its completion marker
        init.append(model_cache.wait_container(image, target, security))
        return ModelMount(model_path=target, cache_volume=volume, cache_mount=mount, init_containers=init,
                          engine_cache_dir=SCRATCH_CACHE_DIR)
    init.append(fetch_container(ep, cfg, security, script_from_config=True))
    # The Hub script comes from the endpoint's ConfigMap, mounted as the pod's one "config" volume (workload.py).
    items = [{"key": "fetch-hf.py", "path": "fetch-hf.py"}] if model.scheme == "hf" else []
    return ModelMount(model_path=target, cache_volume=volume, cache_mount=mount, init_containers=init,
                      config_items=items)
