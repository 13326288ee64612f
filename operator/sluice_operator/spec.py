"""The InferenceEndpoint resource as pydantic models: the single source of truth.

The CRD's openAPIV3Schema is generated from these models (crd.py), field descriptions included. Cross-field
rules are `Rule`s: one CEL expression for the API server (`x-kubernetes-validations`) and the same check in
Python for `sluice render` and the operator, with one message a user can act on. The CEL side assumes the
API server has applied the schema's defaults (it does, before validation); tests check the two agree.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from .config import ENGINE_IMAGE
from .engine_flags import OPERATOR_OWNED_FLAGS, PASSTHROUGH_FLAGS, ArgValue, check_arg

GROUP = "sluice.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceEndpoint"
PLURAL = "inferenceendpoints"
SINGULAR = "inferenceendpoint"
SHORT_NAMES = ["ie"]

MAX_NAME_LENGTH = 40  # child names add suffixes ("-warm"), and LWS pod names add group/worker indices
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"  # a storage size, e.g. 100Gi
MODEL_URI_PATTERN = r"^(hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+|pvc://[a-z0-9][a-z0-9.-]*/.+|s3://[a-z0-9][a-z0-9.-]*/.*)$"


@dataclass(frozen=True, slots=True)
class Rule:
    """A cross-field rule, written twice: CEL for the API server, `holds` for Python."""

    cel: str
    message: str
    holds: Callable[[Any], bool]
    field_path: str | None = None  # where the API server reports a failure, relative to the rule's object

    def crd(self) -> dict[str, str]:
        out = {"rule": self.cel, "message": self.message}
        if self.field_path:
            out["fieldPath"] = self.field_path
        return out


def _add_rules(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    rules: tuple[Rule, ...] = getattr(cls, "RULES", ())
    if rules:
        schema["x-kubernetes-validations"] = [r.crd() for r in rules]


class _Object(BaseModel):
    """Base of every spec object: camelCase in YAML, unknown fields rejected, rules checked."""

    model_config = ConfigDict(alias_generator=to_camel, extra="forbid", json_schema_extra=_add_rules)
    RULES: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self):
        for rule in self.RULES:
            if not rule.holds(self):
                raise ValueError(rule.message)
        return self


# -- model ----------------------------------------------------------------------------------------------
class SecretRef(_Object):
    """A Secret in the endpoint's namespace."""

    name: str = Field(min_length=1, max_length=253, description="Name of the Secret.")


class ModelCache(_Object):
    """Where downloaded weights and converted models live, so restarts and scale-ups do not re-download."""

    RULES = (
        Rule("self.type != 'pvc' || has(self.claimName)",
             "model.cache.claimName is required when model.cache.type is pvc",
             lambda c: c.type != "pvc" or c.claim_name is not None),
        Rule("self.type != 'hostPath' || has(self.path)",
             "model.cache.path is required when model.cache.type is hostPath",
             lambda c: c.type != "hostPath" or c.path is not None),
        Rule("self.type != 'shared' || has(self.size)",
             "model.cache.size is required when model.cache.type is shared: the claim's storage request, room "
             "for the weights, e.g. 100Gi",
             lambda c: c.type != "shared" or c.size is not None),
        Rule("self.type == 'shared' || (!has(self.size) && !has(self.storageClassName))",
             "model.cache.size and model.cache.storageClassName apply to model.cache.type shared only",
             lambda c: c.type == "shared" or (c.size is None and c.storage_class_name is None)),
    )
    type: Literal["emptyDir", "pvc", "hostPath", "shared"] = Field(
        "emptyDir",
        description="emptyDir: per pod, lost with it (every pod downloads). pvc: your claim, filled by every "
                    "pod's fetch init container (ReadWriteMany to share across nodes). hostPath: a node-local "
                    "directory, reused by every pod on the node (the operator makes it writable by the engine's "
                    "user). shared: a claim the operator creates and fills once, by one Job per model, revision "
                    "and storage class in the namespace, shared by every endpoint that serves that model; "
                    "serving pods mount it read-only and start once the download is complete.",
    )
    claim_name: str | None = Field(None, max_length=253, description="The PersistentVolumeClaim (type pvc).")
    path: str | None = Field(None, pattern=r"^/", max_length=4096,
                             description="Absolute directory on the node (type hostPath).")
    size_limit: str | None = Field(None, max_length=64, description="Size limit of the emptyDir, e.g. 50Gi.")
    size: str | None = Field(None, pattern=QUANTITY_PATTERN, max_length=64, description=(
        "Storage the shared claim requests (type shared), e.g. 100Gi. Set when the claim is created: the first "
        "endpoint of a model decides it; grow the claim itself (kubectl) if its StorageClass allows expansion."))
    storage_class_name: str | None = Field(None, max_length=253, description=(
        "StorageClass of the shared claim (type shared). It must offer ReadWriteMany volumes (NFS, CephFS, "
        "EFS, Filestore, ...): the fetch Job writes, serving pods on any node read. Default: the cluster's "
        "default class."))


class ModelSource(_Object):
    """The weights to serve and how to fetch them."""

    RULES = (
        Rule(f"self.uri.matches('{MODEL_URI_PATTERN}')",
             "model.uri must be hf://<org>/<name>, pvc://<claim>/<path> or s3://<bucket>/<prefix>",
             lambda m: re.match(MODEL_URI_PATTERN, m.uri) is not None,
             field_path=".uri"),
        Rule("!has(self.revision) || self.uri.startsWith('hf://')",
             "model.revision applies to hf:// models only; pin pvc:// and s3:// models by their path",
             lambda m: m.revision is None or m.uri.startswith("hf://"), field_path=".revision"),
        Rule("!has(self.cache) || self.cache.type != 'shared' || !self.uri.startsWith('pvc://')",
             "model.cache.type shared downloads hf:// and s3:// models; a pvc:// model is read where it is",
             lambda m: m.cache.type != "shared" or m.scheme != "pvc", field_path=".cache"),
    )
    uri: str = Field(max_length=1024, description=(
        "hf://<org>/<name> (Hugging Face Hub, fetched by an init container), pvc://<claim>/<path> (mounted "
        "read-only) or s3://<bucket>/<prefix> (fetched by an init container)."))
    revision: str | None = Field(None, max_length=256, description="Hub revision (branch, tag or commit); hf:// only.")
    served_name: str | None = Field(None, max_length=256, description=(
        "The model name clients send. Default: the last path component of uri."))
    credentials_secret_ref: SecretRef | None = Field(None, description=(
        "A Secret whose keys become environment variables of the fetch and engine containers, e.g. HF_TOKEN "
        "or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY."))
    cache: ModelCache = Field(default_factory=ModelCache, description="The model cache volume.")

    @property
    def scheme(self) -> str:
        return self.uri.split("://", 1)[0]

    @property
    def location(self) -> str:
        """The uri without its scheme: `org/name`, `claim/path` or `bucket/prefix`."""
        return self.uri.split("://", 1)[1]

    @property
    def name(self) -> str:
        return self.served_name or self.location.rstrip("/").rsplit("/", 1)[-1]


# -- engine ---------------------------------------------------------------------------------------------
_ARGS_SCHEMA = {
    "type": "object",
    "maxProperties": 32,
    "additionalProperties": {"x-kubernetes-int-or-string": True},
    "description": "Extra `sluice serve` flags, without the leading dashes, e.g. `max-num-seqs: 128`. Values are "
                   'integers or strings: quote a fraction ("0.85"); a switch takes "true" or "false". Allowed: '
                   + ", ".join(PASSTHROUGH_FLAGS) + ".",
    "x-kubernetes-validations": [{
        "rule": "self.all(k, k in [" + ", ".join(f"'{f}'" for f in PASSTHROUGH_FLAGS) + "])",
        "message": "engine.args keys must be engine flags without the leading dashes, other than those the "
                   "operator sets (" + ", ".join(OPERATOR_OWNED_FLAGS) + "); allowed: "
                   + ", ".join(PASSTHROUGH_FLAGS),
    }],
}


class Engine(_Object):
    """The serving engine container."""

    image: str | None = Field(None, max_length=512, description=(
        f"Engine image. Default: the operator's engine image, {ENGINE_IMAGE} (the release image of the "
        "bundled engine at the operator's version) unless the operator was installed with another one "
        "(chart value engine.image, env SLUICE_ENGINE_IMAGE)."))
    args: Annotated[dict[str, Any], WithJsonSchema(_ARGS_SCHEMA)] = Field(default_factory=dict)
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="Weights and activations dtype (auto: float32 on CPU, bfloat16 on GPU).")
    max_model_len: int | None = Field(None, ge=1, description="Context window. Default: the model's.")

    @field_validator("args")
    @classmethod
    def _known_flags(cls, args: dict[str, Any]) -> dict[str, ArgValue]:
        for flag, value in args.items():
            check_arg(flag, value)
        return args


# -- placement ------------------------------------------------------------------------------------------
class Accelerator(_Object):
    """What each pod runs on."""

    RULES = (
        Rule("self.type != 'cpu' || (!has(self.product) && !has(self.gpusPerNode))",
             "accelerator.product and accelerator.gpusPerNode apply to GPUs only; remove them when "
             "accelerator.type is cpu",
             lambda a: a.type != "cpu" or (a.product is None and a.gpus_per_node is None)),
    )
    type: Literal["gpu", "cpu"] = Field("gpu", description="gpu, or cpu for a CPU-only endpoint (no GPU requested).")
    resource_name: str = Field("nvidia.com/gpu", max_length=253, description="Extended resource of one GPU.")
    product: str | None = Field(None, max_length=63, description=(
        "GPU product; pods are pinned to nodes whose productLabel has this value, e.g. NVIDIA-H100-80GB-HBM3."))
    product_label: str = Field("nvidia.com/gpu.product", max_length=316,
                               description="Node label that names the GPU product.")
    gpus_per_node: int | None = Field(None, ge=1, le=64, description=(
        "GPUs one node offers. Needed only when tensor x pipeline can exceed one node: the replica then "
        "spans ceil(tensor x pipeline / gpusPerNode) nodes as a LeaderWorkerSet group (or parallelism.nodes, "
        "when set)."))


class Parallelism(_Object):
    """How one replica splits the model over devices (one engine rank each). Data parallelism is the replica
    count."""

    RULES = (
        Rule("!has(self.nodes) || self.pipeline % self.nodes == 0",
             "parallelism.pipeline must be a multiple of parallelism.nodes: every node holds whole pipeline stages",
             lambda p: p.nodes is None or p.pipeline % p.nodes == 0, field_path=".nodes"),
    )
    tensor: int = Field(1, ge=1, le=64, description="Tensor-parallel size; one group never spans nodes.")
    pipeline: int = Field(1, ge=1, le=64, description="Pipeline-parallel stages; stages may span nodes.")
    nodes: int | None = Field(None, ge=1, le=64, description=(
        "Pods (one per node) one replica spreads its tensor x pipeline ranks over, each holding whole pipeline "
        "stages; more than 1 makes the replica a LeaderWorkerSet group. Default: as few as hold the GPUs, "
        "ceil(tensor x pipeline / gpusPerNode), and 1 on CPU or without gpusPerNode. Set it to spread a CPU "
        "endpoint's pipeline stages over pods, or GPUs wider than they need."))


# -- scaling --------------------------------------------------------------------------------------------
class WarmPool(_Object):
    """Standby pods kept loaded outside the autoscaled workload (Deployment and Service <name>-warm); the
    gateway sends them requests while serving pods are cold."""

    replicas: int = Field(1, ge=0, description="Standby pods.")


class OnMetricsOutage(_Object):
    """What the autoscaler does when it cannot read the queue metric."""

    replicas: int = Field(ge=0, description="Replicas to hold (never scaling in below the current count).")


class Scaling(_Object):
    """Queue-depth autoscaling through KEDA (mutually exclusive with replicas)."""

    RULES = (
        Rule("self.minReplicas <= self.maxReplicas",
             "scaling.minReplicas must not exceed scaling.maxReplicas",
             lambda s: s.min_replicas <= s.max_replicas, field_path=".minReplicas"),
        Rule("!has(self.warmPool) || self.warmPool.replicas <= self.maxReplicas",
             "scaling.warmPool.replicas must not exceed scaling.maxReplicas",
             lambda s: s.warm_pool is None or s.warm_pool.replicas <= s.max_replicas, field_path=".warmPool"),
        Rule("!has(self.onMetricsOutage) || self.onMetricsOutage.replicas <= self.maxReplicas",
             "scaling.onMetricsOutage.replicas must not exceed scaling.maxReplicas",
             lambda s: s.on_metrics_outage is None or s.on_metrics_outage.replicas <= s.max_replicas,
             field_path=".onMetricsOutage"),
    )
    min_replicas: int = Field(1, ge=0, le=1000, description="Fewest replicas; 0 scales to zero when idle.")
    max_replicas: int = Field(ge=1, le=1000, description="Most replicas.")
    target_queue_depth: int = Field(4, ge=1, description=(
        "Waiting requests per replica the autoscaler aims for: those waiting in the engines "
        "(sluice_num_requests_waiting) plus those the gateway holds (sluice_gateway_pending_requests)."))
    scale_down_delay_seconds: int = Field(300, ge=0, le=86400, description=(
        "Stabilization window before scaling in, and the idle time before scaling to zero."))
    warm_pool: WarmPool | None = Field(None, description="Standby pods.")
    on_metrics_outage: OnMetricsOutage | None = Field(None, description=(
        "Fallback when the metric is unavailable. Default: max(minReplicas, 1) replicas."))


# -- objectives, cost and pod escape hatches --------------------------------------------------------------
class Slo(_Object):
    """Latency objectives; a request meeting both counts toward goodput."""

    ttft_ms: float | None = Field(None, gt=0, description="Time to first token, milliseconds.")
    tpot_ms: float | None = Field(None, gt=0, description="Time per output token after the first, milliseconds.")
    target: float | None = Field(None, gt=0, lt=1, description=(
        "The fraction of completed requests that must meet the objectives (SLO attainment), e.g. 0.99. The "
        "endpoint's SLO burn-rate alerts spend the error budget 1 - target. Default: 0.99."))


class Cost(_Object):
    """Cost inputs for reporting."""

    gpu_hour_usd: float | None = Field(None, ge=0, alias="gpuHourUSD", description="Price of one GPU-hour, USD.")


_FreeForm = Annotated[dict[str, Any], WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True})]
_FreeFormList = Annotated[list[dict[str, Any]], WithJsonSchema(
    {"type": "array", "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}})]


class LocalObjectReference(_Object):
    name: str = Field(min_length=1, max_length=253)


class PodOverrides(_Object):
    """Pod-level settings passed through to the engine pods (validated by the API server when applied)."""

    resources: _FreeForm | None = Field(None, description=(
        "Engine container resources (core/v1 ResourceRequirements). The operator sets the GPU limit itself."))
    node_selector: dict[str, str] = Field(default_factory=dict, description="Added to the product selector.")
    tolerations: _FreeFormList = Field(default_factory=list, description=(
        "core/v1 Tolerations, added to the GPU toleration the operator sets."))
    affinity: _FreeForm | None = Field(None, description="core/v1 Affinity.")
    priority_class_name: str | None = Field(None, max_length=253, description="PriorityClass of the pods.")
    env: _FreeFormList = Field(default_factory=list, description="core/v1 EnvVars of the engine container.")
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list, description="Image pull Secrets.")


# -- the spec -------------------------------------------------------------------------------------------
def _tp(s: EndpointSpec) -> tuple[int, int, int | None]:
    return s.parallelism.tensor, s.parallelism.pipeline, s.accelerator.gpus_per_node


_T = "(has(self.parallelism) ? self.parallelism.tensor : 1)"
_P = "(has(self.parallelism) ? self.parallelism.pipeline : 1)"
_HAS_G = "has(self.accelerator) && has(self.accelerator.gpusPerNode)"
_G = "self.accelerator.gpusPerNode"
_HAS_N = "has(self.parallelism) && has(self.parallelism.nodes)"
_N = "self.parallelism.nodes"


class EndpointSpec(_Object):
    """The desired state of an InferenceEndpoint."""

    RULES = (
        Rule("!(has(self.replicas) && has(self.scaling))",
             "set either replicas (a fixed count) or scaling (autoscaling), not both",
             lambda s: s.replicas is None or s.scaling is None),
        Rule(f"!({_HAS_G}) || {_T} * {_P} <= {_G} || {_T} <= {_G}",
             "parallelism.tensor must not exceed accelerator.gpusPerNode: a tensor-parallel group runs on one "
             "node; span nodes with parallelism.pipeline instead",
             lambda s: (lambda t, p, g: g is None or t * p <= g or t <= g)(*_tp(s)),
             field_path=".parallelism"),
        Rule(f"{_HAS_N} || !({_HAS_G}) || {_T} * {_P} <= {_G} || {_P} % (({_T} * {_P} + {_G} - 1) / {_G}) == 0",
             "parallelism.pipeline must split evenly over the ceil(tensor x pipeline / gpusPerNode) nodes of a "
             "multi-node replica (every node holds the same number of stages); or set parallelism.nodes",
             lambda s: s.parallelism.nodes is not None or (
                 lambda t, p, g: g is None or t * p <= g or p % -(-(t * p) // g) == 0)(*_tp(s)),
             field_path=".parallelism"),
        Rule(f"!({_HAS_N} && {_HAS_G}) || {_T} * {_P} / {_N} <= {_G}",
             "parallelism.nodes is too few: tensor x pipeline / nodes GPUs per node must not exceed "
             "accelerator.gpusPerNode",
             lambda s: (lambda t, p, g, n: n is None or g is None or t * p // n <= g)(
                 *_tp(s), s.parallelism.nodes),
             field_path=".parallelism"),
    )
    model: ModelSource = Field(description="The model to serve.")
    engine: Engine = Field(default_factory=Engine, description="The engine container.")
    accelerator: Accelerator = Field(default_factory=Accelerator, description=(
        "What each pod runs on. Default: one nvidia.com/gpu per tensor x pipeline; type cpu for CPU only."))
    parallelism: Parallelism = Field(default_factory=Parallelism, description="Model parallelism per replica.")
    replicas: int | None = Field(None, ge=0, le=1000, description=(
        "A fixed replica count (mutually exclusive with scaling). Default: 1 when scaling is unset."))
    scaling: Scaling | None = Field(None, description="Autoscaling (mutually exclusive with replicas).")
    startup_grace_seconds: int = Field(600, ge=10, le=86400, description=(
        "The longest the engine may take to load the model before its pod is restarted (the fetch init "
        "container runs before and is not counted); also the autoscaler's initial cooldown. Set it above the "
        "worst load time."))
    slo: Slo | None = Field(None, description="Latency objectives.")
    cost: Cost | None = Field(None, description="Cost inputs.")
    pod: PodOverrides = Field(default_factory=PodOverrides, description="Pod-level escape hatches.")

    @property
    def fixed_replicas(self) -> int | None:
        """The replica count when not autoscaled, else None."""
        if self.scaling is not None:
            return None
        return 1 if self.replicas is None else self.replicas


# -- status ---------------------------------------------------------------------------------------------
class Condition(_Object):
    type: str = Field(max_length=316, description=(
        "Ready, ModelReady, Scheduled, Progressing, Degraded, and with scaling AutoscalerReady, "
        "AutoscalerActive and AutoscalerFallback (KEDA's Ready, Active and Fallback)."))
    status: Literal["True", "False", "Unknown"]
    reason: str | None = Field(None, max_length=1024, description=(
        "CamelCase cause, e.g. InsufficientCapacity, ModelLoading, ScaledToZero, or KEDA's own."))
    message: str | None = Field(None, max_length=32768)
    last_transition_time: str | None = Field(None, json_schema_extra={"format": "date-time"})
    observed_generation: int | None = Field(None, ge=0)


class ReplicaStatus(_Object):
    desired: int | None = Field(None, ge=0, description="Replicas the workload aims for.")
    ready: int | None = Field(None, ge=0, description="Replicas ready to serve.")
    standby: int | None = Field(None, ge=0, description="Ready warm-pool pods (set when scaling.warmPool is).")


class EndpointStatus(_Object):
    """The observed state, written by the operator only."""

    observed_generation: int | None = Field(None, ge=0)
    phase: Literal["Pending", "Loading", "Ready", "Idle", "Degraded", "Failed"] | None = Field(
        None, description="Pending: no serving pod runs yet (InsufficientCapacity: none can be scheduled). "
                          "Loading: pods run, the model loads. Ready: at least one replica serves. Idle: scaled "
                          "to zero. Degraded: serving, with a workload failure. Failed: nothing serves.")
    url: str | None = Field(None, description=(
        "OpenAI-compatible base URL inside the cluster: the gateway's for an autoscaled endpoint (it holds "
        "requests while replicas start), else the endpoint's Service."))
    replicas: ReplicaStatus | None = None
    selector: str | None = Field(None, description="Label selector of the serving pods (scale subresource).")
    conditions: list[Condition] = Field(default_factory=list, json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})


# -- the resource ---------------------------------------------------------------------------------------
NAME_RULES = (
    Rule(f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
         f"metadata.name must be at most {MAX_NAME_LENGTH} characters: the names of the objects it creates add "
         "suffixes",
         lambda name: len(name) <= MAX_NAME_LENGTH),
    Rule("self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
         "metadata.name must start with a lowercase letter and hold only lowercase letters, digits and '-' "
         "(it names a Service)",
         lambda name: re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) is not None),
)


class ObjectMeta(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    namespace: str | None = None
    uid: str | None = None
    generation: int | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        for rule in NAME_RULES:
            if not rule.holds(name):
                raise ValueError(rule.message)
        return name


class InferenceEndpoint(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, extra="forbid")

    api_version: Literal["sluice.dev/v1alpha1"]
    kind: Literal["InferenceEndpoint"]
    metadata: ObjectMeta
    spec: EndpointSpec
    status: EndpointStatus | None = None

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        return self.metadata.namespace or "default"


class SpecError(ValueError):
    """An invalid InferenceEndpoint; the message names each offending field."""


def format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        path = ""
        for part in e["loc"]:
            path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{path or '(document)'}: {msg}")
    return "\n".join(lines)


def parse_endpoint(doc: Any) -> InferenceEndpoint:
    """Validate one InferenceEndpoint document; SpecError names every offending field."""
    if not isinstance(doc, dict):
        raise SpecError(f"expected an InferenceEndpoint object, got {type(doc).__name__}")
    try:
        return InferenceEndpoint.model_validate(doc)
    except ValidationError as e:
        name = (doc.get("metadata") or {}).get("name", "?") if isinstance(doc.get("metadata"), dict) else "?"
        raise SpecError(f"invalid InferenceEndpoint {name!r}:\n" + format_errors(e)) from None
