"""The model cache volume of the engine pods, and the shared cache: one claim, filled once by one Job.

Cache types (spec.model.cache.type):
- emptyDir: per pod; every pod's fetch init container downloads.
- pvc: the user's claim; every pod's fetch init container checks it (and the first downloads).
- hostPath: a node directory. The kubelet creates it root-owned, and fsGroup does not apply to hostPath
  volumes, so an init container running as root makes only that directory the engine user's (not recursive:
  what is below was written by that user already, and a chown -R of a 100 GB cache would slow every start).
- shared: a PersistentVolumeClaim `sluice-model-<hash>` and a Job of the same name that downloads into it
  once. The hash is of the model uri, revision and storage class, so every endpoint of the namespace that
  serves that model (from that class) uses the same claim and the same download.

Ownership of the shared objects: no endpoint controls them. Each endpoint that uses them adds its own
non-controller ownerReference, so Kubernetes' garbage collector deletes the claim and the Job once the last of
those endpoints is gone (and drops the reference of each deleted one before). An endpoint that stops using a
cache (another model, revision or cache type) removes its reference; the last one deletes them itself.

Waiting for the download: the operator holds the serving workload at zero replicas (and pauses KEDA) until
the Job has completed, so no pod holds a GPU while it waits and no Deployment runs into its progress deadline
during a long download. The claim then carries an annotation saying it is complete, so the download never runs
again, even if the Job is deleted. Each serving pod also has an init container that waits for the completion
marker the Job writes last: a pod never loads a half-written model, whatever scaled it up.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from .meta import MANAGED_BY, PLACEHOLDER_UID
from .spec import API_VERSION, KIND, InferenceEndpoint, ModelSource

CACHE_DIR = "/models-cache"  # SLUICE_CACHE_DIR of the engine image (engine_image/Dockerfile)
CACHE_VOLUME = "model-cache"
MODEL_CACHE_LABEL = "sluice.dev/model-cache"  # on the shared claim and Job: the cache's hash
COMPONENT = "model-cache"
# Set on the shared claim by the operator once its Job has completed: the claim holds the whole model.
COMPLETE_ANNOTATION = "sluice.dev/model-complete"
MODEL_URI_ANNOTATION, MODEL_REVISION_ANNOTATION = "sluice.dev/model-uri", "sluice.dev/model-revision"
# Written last by every fetch (the Job's and the init containers'), in the model's directory. The same name as
# the engine's marker of a finished GGUF conversion (sluice_engine.model_fetch.COMPLETE_MARKER).
COMPLETE_MARKER = ".sluice-complete"
# Each fetch prints `sluice-fetch: <bytes> bytes` every PROGRESS_PERIOD_S: the bytes of the model's directory so
# far (partial files included). The operator reads the newest such line from the Job pod's log.
PROGRESS_PREFIX = "sluice-fetch:"
PROGRESS_PERIOD_S = 10
PROGRESS_LINE = re.compile(rf"^{PROGRESS_PREFIX} (\d+) bytes", re.MULTILINE)
WAIT_CONTAINER = "wait-for-model"
OWN_CACHE_CONTAINER = "own-model-cache"
WAIT_PERIOD_S = 5
FETCH_BACKOFF_LIMIT = 4  # Job retries of a failed download (network, Hub rate limits) before it is Failed
TMP_MOUNT = {"name": "tmp", "mountPath": "/tmp"}  # every container: the root filesystem is read-only
# NOTE(security): the containers that hold model credentials (the model's fetch, the adapters' fetch sidecars)
# have their own /tmp, which is their HOME (and HF_HOME's parent): an emptyDir the engine container does not
# mount. Were it the engine's /tmp, a compromised engine could plant ~/.aws/config (a credential_process the AWS
# CLI runs), a Python user site or a Hub token there, for a container holding the credentials to pick up.
FETCH_HOME_VOLUME = "fetch-home"
FETCH_HOME_MOUNT = {"name": FETCH_HOME_VOLUME, "mountPath": "/tmp"}


def fetch_home_volume() -> dict[str, Any]:
    return {"name": FETCH_HOME_VOLUME, "emptyDir": {}}
KEDA_PAUSED_REPLICAS = "autoscaling.keda.sh/paused-replicas"


# -- names and ownership ------------------------------------------------------------------------------------
def cache_key(model: ModelSource) -> str:
    """What makes two endpoints' shared caches one: the model, its revision, and the claim's storage class."""
    ident = [model.uri, model.revision or "", model.cache.storage_class_name or ""]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:12]


def shared_cache_name(model: ModelSource) -> str:
    """The shared claim's and its fetch Job's name."""
    return f"sluice-model-{cache_key(model)}"


def uses_shared_cache(ep: InferenceEndpoint) -> bool:
    return ep.spec.model.cache.type == "shared" and ep.spec.model.scheme != "pvc"


def sharing_reference(ep: InferenceEndpoint) -> dict[str, Any]:
    """The endpoint as one of several owners: not the controller, and never blocking the object's deletion."""
    return {"apiVersion": API_VERSION, "kind": KIND, "name": ep.name, "uid": ep.metadata.uid or PLACEHOLDER_UID,
            "controller": False, "blockOwnerDeletion": False}


def _shared_meta(ep: InferenceEndpoint) -> dict[str, Any]:
    model = ep.spec.model
    return {
        "name": shared_cache_name(model),
        "namespace": ep.namespace,
        # No sluice.dev/endpoint label: the object is no one endpoint's (the prune pass lists by that label).
        "labels": {"app.kubernetes.io/name": "sluice", "app.kubernetes.io/component": COMPONENT,
                   "app.kubernetes.io/managed-by": MANAGED_BY, MODEL_CACHE_LABEL: cache_key(model)},
        "annotations": {MODEL_URI_ANNOTATION: model.uri, MODEL_REVISION_ANNOTATION: model.revision or ""},
        "ownerReferences": [sharing_reference(ep)],
    }


# -- the shared claim and its fetch Job ---------------------------------------------------------------------
def shared_claim(ep: InferenceEndpoint) -> dict[str, Any]:
    cache = ep.spec.model.cache
    spec: dict[str, Any] = {
        # The Job writes on one node; serving pods on any node mount it read-only at the same time.
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": cache.size}},
    }
    if cache.storage_class_name:
        spec["storageClassName"] = cache.storage_class_name
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": _shared_meta(ep), "spec": spec}


def fetch_job(ep: InferenceEndpoint, fetch: dict[str, Any], pod_security: dict[str, Any]) -> dict[str, Any]:
    """The Job that fills the shared claim once: `fetch` is the fetch container (model_source.fetch_container)."""
    meta = _shared_meta(ep)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",  # a retry is a fresh pod; the fetch resumes from the files on the claim
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        # fsGroup: the claim's files are the engine group's (for volume types that support ownership management).
        "securityContext": pod_security,
        "containers": [fetch],
        "volumes": [{"name": CACHE_VOLUME, "persistentVolumeClaim": {"claimName": meta["name"]}},
                    fetch_home_volume()],
    }
    if ep.spec.pod.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s.name} for s in ep.spec.pod.image_pull_secrets]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "backoffLimit": FETCH_BACKOFF_LIMIT,
            # No activeDeadlineSeconds: a large model on a slow link may take hours, and that is not a failure.
            "template": {"metadata": {"labels": dict(meta["labels"])}, "spec": pod_spec},
        },
    }


def shared_cache_manifests(ep: InferenceEndpoint, fetch: dict[str, Any],
                           pod_security: dict[str, Any]) -> list[dict[str, Any]]:
    return [shared_claim(ep), fetch_job(ep, fetch, pod_security)]


# -- the engine pods' side ------------------------------------------------------------------------------------
def cache_volume(ep: InferenceEndpoint) -> dict[str, Any]:
    cache = ep.spec.model.cache
    if cache.type == "pvc":
        return {"name": CACHE_VOLUME, "persistentVolumeClaim": {"claimName": cache.claim_name}}
    if cache.type == "hostPath":
        return {"name": CACHE_VOLUME, "hostPath": {"path": cache.path, "type": "DirectoryOrCreate"}}
    if uses_shared_cache(ep):
        return {"name": CACHE_VOLUME, "persistentVolumeClaim": {"claimName": shared_cache_name(ep.spec.model),
                                                                "readOnly": True}}
    empty: dict[str, Any] = {"sizeLimit": cache.size_limit} if cache.size_limit else {}
    return {"name": CACHE_VOLUME, "emptyDir": empty}


def cache_mount(ep: InferenceEndpoint) -> dict[str, Any]:
    mount: dict[str, Any] = {"name": CACHE_VOLUME, "mountPath": CACHE_DIR}
    if uses_shared_cache(ep):  # the Job alone writes it
        mount["readOnly"] = True
    return mount


def own_cache_container(image: str, uid: int, container_security: dict[str, Any]) -> dict[str, Any]:
    """hostPath: make the node directory the engine user's (it may be new, created by the kubelet as root)."""
    security = {**container_security, "runAsNonRoot": False, "runAsUser": 0,
                # CHOWN for the owner; FOWNER to set the mode of a directory it no longer owns.
                "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}}
    return {
        "name": OWN_CACHE_CONTAINER,
        "image": image,
        "command": ["sh", "-c", f'chown {uid}:{uid} "$0" && chmod 0775 "$0"', CACHE_DIR],
        "volumeMounts": [{"name": CACHE_VOLUME, "mountPath": CACHE_DIR}, TMP_MOUNT],
        "securityContext": security,
    }


def wait_container(image: str, model_dir: str, container_security: dict[str, Any]) -> dict[str, Any]:
    """shared: start the engine only once the Job's completion marker is on the claim."""
    marker = f"{model_dir}/{COMPLETE_MARKER}"
    script = (f'until [ -f "$0" ]; do echo "waiting for the model download to complete ($0)"; '
              f"sleep {WAIT_PERIOD_S}; done")
    return {
        "name": WAIT_CONTAINER,
        "image": image,
        "command": ["sh", "-c", script, marker],
        "volumeMounts": [{"name": CACHE_VOLUME, "mountPath": CACHE_DIR, "readOnly": True}, TMP_MOUNT],
        "securityContext": container_security,
    }


# -- the shared cache's state, from the live claim, Job and fetch log -----------------------------------------
@dataclass(frozen=True, slots=True)
class CacheState:
    """What the endpoint's status says about its shared cache (status.py)."""

    name: str
    complete: bool
    failed: str | None = None  # the Job's failure message, when it gave up
    bytes_done: int | None = None  # from the fetch's progress lines, when the operator could read its log
    claim_phase: str | None = None

    @property
    def message(self) -> str:
        if self.complete:
            return f"the model is in the shared cache (claim {self.name})"
        if self.failed:
            return (f"the download Job {self.name} failed: {self.failed}; delete the Job to retry "
                    "(the operator creates it again)")
        done = f", {format_bytes(self.bytes_done)} so far" if self.bytes_done is not None else ""
        where = f" (claim {self.name} is {self.claim_phase})" if self.claim_phase not in (None, "Bound") else ""
        return f"downloading the model into the shared cache by Job {self.name}{done}{where}"


def claim_complete(claim: dict[str, Any] | None) -> bool:
    annotations = ((claim or {}).get("metadata") or {}).get("annotations") or {}
    return annotations.get(COMPLETE_ANNOTATION) == "true"


def job_condition(job: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    for c in ((job or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_ and c.get("status") == "True":
            return c
    return None


def job_complete(job: dict[str, Any] | None) -> bool:
    return job_condition(job, "Complete") is not None


def cache_state(name: str, claim: dict[str, Any] | None, job: dict[str, Any] | None,
                log: str | None = None) -> CacheState:
    phase = ((claim or {}).get("status") or {}).get("phase") if claim else None
    if claim_complete(claim) or (claim is not None and job_complete(job)):
        return CacheState(name, complete=True, claim_phase=phase)
    failed = job_condition(job, "Failed")
    if failed:
        return CacheState(name, complete=False, failed=failed.get("message") or failed.get("reason") or "Failed",
                          claim_phase=phase)
    return CacheState(name, complete=False, bytes_done=progress_bytes(log), claim_phase=phase)


def progress_bytes(log: str | None) -> int | None:
    """The newest progress line's byte count in a fetch log."""
    found = PROGRESS_LINE.findall(log or "")
    return int(found[-1]) if found else None


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n:.1f} TiB"
