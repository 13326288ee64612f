"""The serving workload: the engine pod template, as a Deployment or (multi-node) a LeaderWorkerSet.

Every pod runs one `sluice serve`, which starts one process per rank it holds (layout.py). In a
LeaderWorkerSet group the leader is node 0 (HTTP API, scheduler, the rendezvous at MASTER_PORT) and each
worker pod is node LWS_WORKER_INDEX, running ranks only and answering /health on the same port for its probes.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from . import adapters
from .config import OperatorConfig
from .engine_flags import render_args
from .layout import Layout, ceil_div
from .meta import ENDPOINT_LABEL, PREFILL, ROLE_LABEL, SERVES_LABEL, SERVING, labels, object_meta
from .model_cache import FETCH_HOME_VOLUME, OWN_CACHE_CONTAINER, fetch_home_volume
from .model_source import CONFIG_DIR, OBJECTIVES_KEY, OBJECTIVES_PATH, model_mount
from .pod_customization import customize_pod
from .spec import InferenceEndpoint, lora_enabled

if TYPE_CHECKING:
    from .disaggregation import PoolParts

PORT = 8000
MASTER_PORT = 29500  # node 0's torch.distributed rendezvous (--master-port), the leader's port named "dist"
SHM_GIB_PER_RANK = 2  # /dev/shm per rank of a pod: NCCL's shared-memory transport, torch's CUDA IPC
# What LeaderWorkerSet injects into every container of a group: the leader pod's DNS name (a headless Service
# that publishes not-ready pods, so the rendezvous resolves while the group loads) and the pod's index (0 for
# the leader). The kubelet expands $(VAR) in args from the container's env, webhook-injected variables included.
LWS_LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
LWS_WORKER_INDEX = "LWS_WORKER_INDEX"
RUN_AS = 10001  # the engine image's non-root user (engine_image/Dockerfile)
# TRITON_CACHE_DIR is SLUICE_CACHE_DIR/<this>, as the engine image sets it (/models-cache/triton).
TRITON_CACHE_SUBDIR = "triton"
STARTUP_PERIOD_S = 10
# Graceful shutdown: the preStop pause lets the Service and the gateway stop sending before SIGTERM; then the
# engine drains for --shutdown-timeout (in-flight requests finish, new ones get 503) and exits 0. The pod's
# grace period covers both plus a margin, so Kubernetes never SIGKILLs a drain that is keeping its promise.
PRESTOP_SLEEP_S = 5
DEFAULT_SHUTDOWN_TIMEOUT_S = 30
GRACE_MARGIN_S = 10
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"

CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
}


# fsGroup: volumes that support ownership management (emptyDir, most claims) are the engine group's.
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
                "seccompProfile": {"type": "RuntimeDefault"}}


def engine_scheduling_args(ep: InferenceEndpoint) -> list[str]:
    """The engines schedule by priority where requests get one (spec.routing.inferencePool: the picker sends each
    request's InferenceObjective priority; spec.routing.objectives: the gateway and the picker send those),
    unless engine.args chooses a policy itself. A request without one is
    priority 0: first come, first served, as under fcfs."""
    routing = ep.spec.routing
    prioritised = routing is not None and (routing.inference_pool is not None or bool(routing.objectives))
    if not prioritised or "scheduling-policy" in ep.spec.engine.args:
        return []
    return ["--scheduling-policy", "priority"]


def serve_args(ep: InferenceEndpoint, model_path: str) -> list[str]:
    """`sluice serve` flags (docs/engine-flags.md) for this endpoint."""
    spec = ep.spec
    args = ["--model", model_path, "--served-model-name", spec.model.name,
            "--device", "cpu" if spec.accelerator.type == "cpu" else "cuda",
            "--dtype", spec.engine.dtype]
    if spec.engine.max_model_len is not None:
        args += ["--max-model-len", str(spec.engine.max_model_len)]
    if spec.engine.quantization is not None:  # unset: the engine's default, and no flag (pod templates unchanged)
        args += ["--quantization", spec.engine.quantization]
    if spec.engine.kv_cache_dtype is not None:  # likewise
        args += ["--kv-cache-dtype", spec.engine.kv_cache_dtype]
    # The replica's layout (left out at 1, the engine's default): one process per rank, tensor-fastest.
    if spec.parallelism.tensor > 1:
        args += ["--tensor-parallel-size", str(spec.parallelism.tensor)]
    if spec.parallelism.pipeline > 1:
        args += ["--pipeline-parallel-size", str(spec.parallelism.pipeline)]
    args += ["--host", "0.0.0.0", "--port", str(PORT)]
    # Goodput and cost metrics (docs/engine-flags.md): slo and cost come from a file of the ConfigMap that the
    # engine re-reads while it runs, not from flags: editing them must not change the pod template (a
    # rollout that reloads every model).
    args += ["--objectives-file", OBJECTIVES_PATH]
    if spec.tracing is not None:
        args += ["--otlp-traces-endpoint", spec.tracing.otlp_endpoint,
                 "--trace-sample-ratio", f"{spec.tracing.sample_ratio:g}"]
    args += render_args({k: v for k, v in spec.engine.args.items() if k != "enable-lora"})
    args += engine_scheduling_args(ep)
    # LoRA adapters: which ones is the ConfigMap's adapters.json, re-read while the engine runs (adapters.py);
    # the flags depend only on LoRA being on, so adding or removing an adapter keeps them. Last: the switch
    # takes no value.
    if lora_enabled(spec):
        args += ["--lora-modules-file", adapters.ADAPTERS_PATH, "--enable-lora"]
    return args


def rendezvous_args(layout: Layout, *, leader: bool) -> list[str]:
    """How the pods of a LeaderWorkerSet group find each other: `--nnodes` (the group size), `--node-rank`
    (0 on the leader, the worker's index on a worker) and node 0's address and port. Nothing for one pod."""
    if not layout.multi_node:
        return []
    return ["--nnodes", str(layout.pods_per_replica),
            "--node-rank", "0" if leader else f"$({LWS_WORKER_INDEX})",
            "--master-addr", f"$({LWS_LEADER_ADDRESS})", "--master-port", str(MASTER_PORT)]


def shm_size(layout: Layout) -> str:
    return f"{SHM_GIB_PER_RANK * layout.ranks_per_pod}Gi"


def probes(ep: InferenceEndpoint, *, serves: bool = True) -> dict[str, Any]:
    """A pod that serves is ready when it takes requests (/ready); an LWS worker (ranks only, no API) when
    its group is alive (/health, 503 once any rank is lost)."""
    http = {"port": "http", "scheme": "HTTP"}
    return {
        # The server listens only once the model is loaded: the startup probe is the load-time budget.
        "startupProbe": {"httpGet": {"path": "/health", **http}, "periodSeconds": STARTUP_PERIOD_S,
                         "timeoutSeconds": 5,
                         "failureThreshold": ceil_div(ep.spec.startup_grace_seconds, STARTUP_PERIOD_S)},
        "readinessProbe": {"httpGet": {"path": "/ready" if serves else "/health", **http},
                           "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/health", **http}, "periodSeconds": 10, "timeoutSeconds": 5,
                          "failureThreshold": 3},
    }


def resources(ep: InferenceEndpoint, layout: Layout, pool: PoolParts | None = None) -> dict[str, Any]:
    own = pool.resources if pool is not None and pool.resources is not None else ep.spec.pod.resources
    out = copy.deepcopy(own or {})
    if layout.gpus_per_pod:
        gpu = ep.spec.accelerator.resource_name
        for kind in ("limits", "requests"):  # extended resources: requests must equal limits
            out.setdefault(kind, {})[gpu] = layout.gpus_per_pod
    return out


def component_of(role: str) -> str:
    return {SERVING: "server", PREFILL: "prefill"}.get(role, "standby")


def termination_grace_seconds(ep: InferenceEndpoint) -> int:
    drain = float(ep.spec.engine.args.get("shutdown-timeout", DEFAULT_SHUTDOWN_TIMEOUT_S))
    return PRESTOP_SLEEP_S + int(-(-drain // 1)) + GRACE_MARGIN_S


def pod_template(ep: InferenceEndpoint, layout: Layout, cfg: OperatorConfig, *, role: str, serves: bool,
                 config_map: str, config_hash: str, pool: PoolParts | None = None) -> dict[str, Any]:
    """`pool`: a disaggregated endpoint's pool (disaggregation.py): its flags, resources, env and ports."""
    spec, pod = ep.spec, ep.spec.pod
    mount = model_mount(ep, cfg, CONTAINER_SECURITY, config_map, run_as=RUN_AS)
    gpu = layout.gpus_per_pod > 0
    env = [
        {"name": "SLUICE_CACHE_DIR", "value": mount.engine_cache_dir},
        {"name": "HF_HOME", "value": f"{mount.engine_cache_dir}/huggingface"},
        # Triton's compiled kernels (and its launcher) beside the rest of the engine's cache: on a pvc or hostPath
        # cache a restarted or scaled-from-zero pod loads them instead of compiling them during warm-up.
        {"name": "TRITON_CACHE_DIR", "value": f"{mount.engine_cache_dir}/{TRITON_CACHE_SUBDIR}"},
        {"name": "HOME", "value": "/tmp"},
        *copy.deepcopy(pod.env),
        *copy.deepcopy(list(pool.env if pool is not None else ())),
    ]
    # The ConfigMap as a directory (never subPath): the kubelet then updates its files in place, and the
    # engine sees new objectives without a restart.
    mounts = [mount.cache_mount, {"name": "tmp", "mountPath": "/tmp"},
              {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}, *mount.engine_mounts,
              *adapters.claim_mounts(ep), *copy.deepcopy(list(pool.mounts if pool is not None else ()))]
    config_items = [{"key": OBJECTIVES_KEY, "path": OBJECTIVES_KEY}, *mount.config_items,
                    *adapters.config_items(ep)]
    volumes = [{"name": "tmp", "emptyDir": {}}, mount.cache_volume,
               {"name": "config", "configMap": {"name": config_map, "items": config_items}}, *mount.volumes,
               *adapters.claim_volumes(ep), *copy.deepcopy(list(pool.volumes if pool is not None else ()))]
    if gpu or layout.distributed:
        # NCCL, torch's CUDA IPC and the rank processes need more shared memory than the container's 64 MiB.
        # A tmpfs: what is written counts against the pod's memory; sizeLimit caps it.
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size(layout)}})
    ports = [{"name": "http", "containerPort": PORT, "protocol": "TCP"}]
    ports += copy.deepcopy(list(pool.ports if pool is not None else ()))
    if layout.multi_node and serves:  # node 0 hosts the rendezvous the workers dial
        ports.append({"name": "dist", "containerPort": MASTER_PORT, "protocol": "TCP"})
    engine: dict[str, Any] = {
        "name": "engine",
        "image": spec.engine.image or cfg.engine_image,
        "command": ["sluice", "serve"],
        "args": serve_args(ep, mount.model_path) + list(pool.args if pool is not None else ())
        + rendezvous_args(layout, leader=serves),
        "ports": ports,
        "env": env,
        "volumeMounts": mounts,
        "securityContext": CONTAINER_SECURITY,
        **probes(ep, serves=serves),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_S)]}}},
    }
    # NOTE: no model credentials here: only the fetch init container reads model.credentialsSecretRef. The
    # engine loads local files, and a Secret in the serving container is one exploit away from a client.
    res = resources(ep, layout, pool)
    if res:
        engine["resources"] = res
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": POD_SECURITY,
        "containers": [engine],
        "volumes": volumes,
        "terminationGracePeriodSeconds": termination_grace_seconds(ep),
    }
    # The adapters' fetch sidecars start before the model's fetch (adapters download beside the model), after
    # the hostPath cache is made the engine user's.
    init = list(mount.init_containers)
    first = 1 if init and init[0]["name"] == OWN_CACHE_CONTAINER else 0
    init[first:first] = adapters.sidecars(ep, cfg, CONTAINER_SECURITY)
    if init:
        pod_spec["initContainers"] = init
    if any(m["name"] == FETCH_HOME_VOLUME for c in init for m in c.get("volumeMounts", [])):
        volumes.append(fetch_home_volume())  # the fetch containers' own /tmp (model_cache.FETCH_HOME_MOUNT)
    node_selector = dict(pod.node_selector)
    if spec.accelerator.product:
        node_selector[spec.accelerator.product_label] = spec.accelerator.product
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    tolerations = copy.deepcopy(pod.tolerations)
    if gpu:  # GPU nodes are commonly tainted with their resource name
        tolerations.insert(0, {"key": spec.accelerator.resource_name, "operator": "Exists",
                               "effect": "NoSchedule"})
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if pod.affinity:
        pod_spec["affinity"] = copy.deepcopy(pod.affinity)
    if pod.priority_class_name:
        pod_spec["priorityClassName"] = pod.priority_class_name
    if pod.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s.name} for s in pod.image_pull_secrets]
    return customize_pod({
        "metadata": {
            "labels": {**labels(ep, component_of(role)), ROLE_LABEL: role,
                       SERVES_LABEL: "true" if serves else "false"},
            "annotations": {"sluice.dev/config-hash": config_hash},
        },
        "spec": pod_spec,
    }, ep)


def rolling_update(ep: InferenceEndpoint) -> dict[str, int | str]:
    """spec.rollout, as both Deployment's rollingUpdate and LeaderWorkerSet's rollingUpdateConfiguration
    spell it (LWS counts replicas as groups)."""
    return {"maxSurge": ep.spec.rollout.max_surge, "maxUnavailable": ep.spec.rollout.max_unavailable}


def workload(ep: InferenceEndpoint, layout: Layout, cfg: OperatorConfig, *, name: str, role: str,
             replicas: int | None, config_map: str, config_hash: str,
             pool: PoolParts | None = None) -> dict[str, Any]:
    """A Deployment (one pod per replica) or a LeaderWorkerSet (a group of pods per replica).

    `replicas=None` leaves the count to the autoscaler: the field stays out of what the operator applies,
    so server-side apply never fights KEDA's HPA over it.
    """
    meta = object_meta(ep, name, component_of(role))
    meta["labels"][ROLE_LABEL] = role

    def template(serves: bool) -> dict[str, Any]:
        return pod_template(ep, layout, cfg, role=role, serves=serves, config_map=config_map,
                            config_hash=config_hash, pool=pool)

    if not layout.multi_node:
        spec: dict[str, Any] = {
            "selector": {"matchLabels": {ENDPOINT_LABEL: ep.name, ROLE_LABEL: role}},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": rolling_update(ep)},
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": ep.spec.startup_grace_seconds + 600,
            "template": template(serves=True),
        }
        if replicas is not None:
            spec = {"replicas": replicas, **spec}
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": spec}

    # The leader (node 0) answers requests; workers hold the other nodes' ranks and serve /health only.
    spec = {
        "leaderWorkerTemplate": {
            "size": layout.pods_per_replica,
            # A group is only useful whole, and the engine stops every rank when one is lost: any pod's
            # restart recreates the group, so it meets again at a fresh rendezvous.
            "restartPolicy": "RecreateGroupOnPodRestart",
            "leaderTemplate": template(serves=True),
            "workerTemplate": template(serves=False),
        },
        "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": rolling_update(ep)},
        # Workers start with the leader: it is Ready only once every rank has joined (LeaderReady would wait
        # forever).
        "startupPolicy": "LeaderCreated",
        # A headless Service per group, named after its leader pod, that publishes pods before they are Ready:
        # LWS_LEADER_ADDRESS is <leader pod>.<that Service>.<namespace>. With the default (Shared) LWS names
        # its one headless Service after the LeaderWorkerSet, which is the endpoint's own Service's name: LWS
        # then creates none and the address names pods under a Service that selects only Ready leaders.
        "networkConfig": {"subdomainPolicy": "UniquePerReplica"},
    }
    if replicas is not None:
        spec = {"replicas": replicas, **spec}
    return {"apiVersion": LWS_API_VERSION, "kind": "LeaderWorkerSet", "metadata": meta, "spec": spec}
