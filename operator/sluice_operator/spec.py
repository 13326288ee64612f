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
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

# The resource's names are the contract's (shared with the gateway); re-exported for the operator's modules.
from sluice_contract import API_VERSION as API_VERSION
from sluice_contract import GROUP as GROUP
from sluice_contract import KIND as KIND
from sluice_contract import NAME_SCOPE_CLUSTER, NAME_SCOPE_NAMESPACE, served_name
from sluice_contract import PLURAL as PLURAL
from sluice_contract import VERSION as VERSION

from . import core_schemas
from .config import ENGINE_IMAGE
from .engine_flags import (
    MAX_VALUE_LENGTH,
    OPERATOR_OWNED_FLAGS,
    PASSTHROUGH_FLAGS,
    ArgValue,
    check_arg,
    value_rules,
)

SINGULAR = "inferenceendpoint"
SHORT_NAMES = ["ie"]

MAX_NAME_LENGTH = 40  # child names add suffixes ("-warm"), and LWS pod names add group/worker indices
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"  # a storage size, e.g. 100Gi
MODEL_URI_PATTERN = r"^(hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+|pvc://[a-z0-9][a-z0-9.-]*/.+|s3://[a-z0-9][a-z0-9.-]*/.*)$"

# A node directory: absolute, not the root, no `..` segment (CEL has no path normalization).
HOST_PATH_CEL = "{p}.startsWith('/') && !{p}.matches('^/+$') && !{p}.matches('(^|/)[.][.](/|$)')"


def host_path_ok(path: str) -> bool:
    return path.startswith("/") and path.strip("/") != "" and ".." not in path.split("/")


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

    model_config = ConfigDict(alias_generator=to_camel, extra="forbid", strict=True, json_schema_extra=_add_rules)
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
        Rule("!has(self.path) || (" + HOST_PATH_CEL.format(p="self.path") + ")",
             "model.cache.path must be an absolute directory other than / without '..'",
             lambda c: c.path is None or host_path_ok(c.path), field_path=".path"),
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
        "The model name the engine answers to. Default: the last path component of uri. Through the gateway "
        "clients send `<namespace>/<servedName>` (see nameScope)."))
    name_scope: Literal["Namespace", "Cluster"] = Field(NAME_SCOPE_NAMESPACE, description=(
        "Where the gateway publishes the served name. Namespace: clients send `<namespace>/<servedName>`, "
        "and the plain servedName works only when the gateway serves this one namespace. Cluster: the plain "
        "servedName works from everywhere too; if two endpoints claim the same cluster-wide name, the one "
        "created first keeps it and the gateway reports the other (docs/gateway.md, model names)."))
    credentials_secret_ref: SecretRef | None = Field(None, description=(
        "A Secret whose keys become environment variables of the model fetch init container only (never of "
        "the serving container), e.g. HF_TOKEN or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY."))
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
        return served_name(self.served_name, self.uri)

    @property
    def cluster_wide(self) -> bool:
        return self.name_scope == NAME_SCOPE_CLUSTER


# -- LoRA adapters ---------------------------------------------------------------------------------------
# An adapter's name is a model id clients send (OpenAI's `model`) and a file name: exactly what the engine's
# --lora-modules-file accepts (sluice_engine/lora/modules_file.py, NAME; a test compares the two).
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
MAX_ADAPTERS = 64


class Adapter(_Object):
    """A PEFT LoRA adapter (adapter_config.json and adapter_model.safetensors) served beside the model as a model
    of its own name. Adding or removing one changes the endpoint's ConfigMap only: running engines load or
    unload it (docs/operator.md, LoRA adapters)."""

    RULES = (
        Rule(f"self.name.matches('{ADAPTER_NAME_PATTERN}')",
             "adapters[].name must be 1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit: "
             "it is a model name clients send and a file name",
             lambda a: re.fullmatch(ADAPTER_NAME_PATTERN, a.name) is not None, field_path=".name"),
        Rule(f"self.source.matches('{MODEL_URI_PATTERN}')",
             "adapters[].source must be hf://<org>/<name>, pvc://<claim>/<path> or s3://<bucket>/<prefix>",
             lambda a: re.fullmatch(MODEL_URI_PATTERN, a.source) is not None, field_path=".source"),
        Rule("!has(self.revision) || self.source.startsWith('hf://')",
             "adapters[].revision applies to hf:// sources only; pin pvc:// and s3:// adapters by their path",
             lambda a: a.revision is None or a.source.startswith("hf://"), field_path=".revision"),
    )
    name: str = Field(min_length=1, max_length=128, description=(
        "The model name the adapter answers to (a request's `model`), unique in the endpoint and other than the "
        "model's served name."))
    source: str = Field(max_length=1024, description=(
        "hf://<org>/<name> or s3://<bucket>/<prefix> (fetched into the model cache by the pods' fetch-adapters "
        "sidecars, with model.credentialsSecretRef), or pvc://<claim>/<path> (read where it is: the model's "
        "claim and a pvc cache's claim are mounted already; another claim is mounted read-only at "
        "/adapter-claims/<claim>)."))
    revision: str | None = Field(None, max_length=256, description=(
        "Hub revision (branch, tag or commit); hf:// only. Default: main."))

    @property
    def scheme(self) -> str:
        return self.source.split("://", 1)[0]

    @property
    def location(self) -> str:
        return self.source.split("://", 1)[1]


# -- engine ---------------------------------------------------------------------------------------------
_ARGS_SCHEMA = {
    "type": "object",
    "maxProperties": 32,
    "additionalProperties": {"x-kubernetes-int-or-string": True, "maxLength": MAX_VALUE_LENGTH},
    "description": "Extra `sluice serve` flags, without the leading dashes, e.g. `max-num-seqs: 128`. Values are "
                   'integers or strings: quote a fraction ("0.85"); a switch takes "true" or "false". Allowed: '
                   + ", ".join(PASSTHROUGH_FLAGS) + ".",
    "x-kubernetes-validations": [{
        "rule": "self.all(k, k in [" + ", ".join(f"'{f}'" for f in PASSTHROUGH_FLAGS) + "])",
        "message": "engine.args keys must be engine flags without the leading dashes, other than those the "
                   "operator sets (" + ", ".join(OPERATOR_OWNED_FLAGS) + "); allowed: "
                   + ", ".join(PASSTHROUGH_FLAGS),
    }, *value_rules()],
}


def _check_engine_args(cls, args: dict[str, Any]) -> dict[str, ArgValue]:
    """The field validator of engine.args and of a disaggregated pool's args."""
    for flag, value in args.items():
        check_arg(flag, value)
    return args


def _check_core_fields(cls, value: Any, info: ValidationInfo) -> Any:
    """The field validator of core/v1 fields (pod overrides, a pool's resources): the schema the CRD shows."""
    node = cls.model_fields[info.field_name].metadata
    schema = next(m.json_schema for m in node if isinstance(m, WithJsonSchema))
    problems = core_schemas.errors(schema, value, to_camel(info.field_name))
    if problems:
        raise ValueError("; ".join(problems))
    return value


# engine.quantization: which accelerator runs which format (the GPU ones are Triton kernels, the GGUF ones the
# CPU kernels). NOTE: the same names as the engine's --quantization choices (a test compares them).
GPU_QUANTIZATIONS = ("fp8", "awq", "gptq")
CPU_QUANTIZATIONS = ("q8_0", "q4_0", "q4_1")
QUANTIZATIONS = ("auto", "none", *CPU_QUANTIZATIONS, *GPU_QUANTIZATIONS)
# engine.kvCacheDtype: fp8 is the Triton attention kernels' (GPU only). NOTE: the engine's --kv-cache-dtype choices.
KV_CACHE_DTYPES = ("auto", "fp8")


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
    quantization: Literal[QUANTIZATIONS] | None = Field(None, description=(
        "Weight format the engine serves (flag --quantization). auto: what the checkpoint declares "
        "(config.json quantization_config, or the GGUF file's type); none: dense weights. GPU only: fp8 "
        "(e4m3 weights, per-tensor or per-channel scales), awq, gptq (4-bit, group-wise). CPU only: the GGUF "
        "formats q8_0, q4_0, q4_1. Default: unset (the engine's default)."))
    kv_cache_dtype: Literal[KV_CACHE_DTYPES] | None = Field(None, description=(
        "KV cache element type (flag --kv-cache-dtype), separate from the weights' quantization. auto: the "
        "dtype's. GPU only: fp8 (e4m3 with a per-tensor scale per layer for K and V: the checkpoint's "
        "k_scale/v_scale, else 1.0), half the bytes of a bfloat16 cache per token, so twice the tokens in the "
        "same memory. Default: unset (the engine's default, auto)."))

    _known_flags = field_validator("args")(classmethod(_check_engine_args))


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
        # `self.nodes < 1 ||`: the schema's minimum refuses 0 too, but the server evaluates every rule, and a
        # modulus by zero is an evaluation error beside that message.
        Rule("!has(self.nodes) || self.nodes < 1 || self.pipeline % self.nodes == 0",
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
    min_replicas: int = Field(1, ge=0, le=1000, description=(
        "Fewest replicas; 0 scales to zero when idle. 0 needs the gateway (it is what sees a request arrive at "
        "zero replicas): an operator without one refuses it (Ready False, reason ScaleToZeroNeedsGateway)."))
    max_replicas: int = Field(ge=1, le=1000, description="Most replicas.")
    target_queue_depth: int = Field(4, ge=1, description=(
        "Waiting requests per replica the autoscaler aims for: those waiting in the engines "
        "(sluice_num_requests_waiting) plus those the gateway holds (sluice_gateway_pending_requests). The "
        "target of both KEDA triggers: the Prometheus query's threshold and the gateway scaler's targetValue."))
    scale_down_delay_seconds: int = Field(300, ge=0, le=86400, description=(
        "Stabilization window before scaling in, and the idle time before scaling to zero."))
    warm_pool: WarmPool | None = Field(None, description="Standby pods.")
    on_metrics_outage: OnMetricsOutage | None = Field(None, description=(
        "Fallback when a trigger's metric cannot be read (Prometheus or the gateway unreachable, or the queue "
        "not scraped: an empty query is an error, never an empty queue) 3 times in a row. Default: "
        "max(minReplicas, 1) replicas."))


# -- rollouts ------------------------------------------------------------------------------------------
PERCENT_PATTERN = r"^(100|[1-9]?[0-9])%$"
_IntOrPercent = Annotated[int | str, WithJsonSchema({"x-kubernetes-int-or-string": True})]


def _int_or_percent(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= 0
    return isinstance(value, str) and re.match(PERCENT_PATTERN, value) is not None


def _valid_cel(f: str) -> str:
    return f"type(self.{f}) == int ? self.{f} >= 0 : self.{f}.matches('{PERCENT_PATTERN}')"


def _zero_cel(f: str) -> str:
    return f"(type(self.{f}) == int ? self.{f} == 0 : self.{f} == '0%')"


class Rollout(_Object):
    """How a changed pod template replaces running replicas: the Deployment's strategy.rollingUpdate, or the
    LeaderWorkerSet's rolloutStrategy.rollingUpdateConfiguration (counted in replicas, i.e. groups). The
    default replaces one replica at a time and needs no spare GPUs; an endpoint with one replica is then down
    while its new pod loads. Set maxSurge 1 and maxUnavailable 0 to keep serving at full size through a
    rollout, if the cluster has a spare replica's worth of GPUs."""

    RULES = (
        Rule(_valid_cel("maxSurge"), "rollout.maxSurge must be a count >= 0 or a percentage such as 25%",
             lambda r: _int_or_percent(r.max_surge), field_path=".maxSurge"),
        Rule(_valid_cel("maxUnavailable"), "rollout.maxUnavailable must be a count >= 0 or a percentage such as 25%",
             lambda r: _int_or_percent(r.max_unavailable), field_path=".maxUnavailable"),
        Rule(f"!({_zero_cel('maxSurge')} && {_zero_cel('maxUnavailable')})",
             "rollout.maxSurge and rollout.maxUnavailable must not both be 0: the rollout could not replace "
             "any replica",
             lambda r: not (r.max_surge in (0, "0%") and r.max_unavailable in (0, "0%"))),
    )
    max_surge: _IntOrPercent = Field(0, description=(
        "Replicas created above the desired count during a rollout (a count, or a percentage of the desired "
        "count, rounded up). Each needs its own GPUs."))
    max_unavailable: _IntOrPercent = Field(1, description=(
        "Replicas that may be unavailable during a rollout (a count, or a percentage, rounded down)."))


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

    gpu_hour_usd: float | None = Field(None, ge=0, alias="gpuHourUSD", description=(
        "Price of one GPU-hour, USD; on a CPU endpoint (no GPUs), the price of one replica-hour."))


class Tracing(_Object):
    """OpenTelemetry traces of the engines' requests (docs/metrics.md, Tracing)."""

    otlp_endpoint: str = Field(max_length=512, pattern=r"^https?://[^\s]+$", description=(
        "The OTLP/HTTP collector the engines send their spans to, e.g. http://otel-collector.observability:4318 "
        "(a URL without a path gets /v1/traces). Rendered as the engines' --otlp-traces-endpoint."))
    sample_ratio: float = Field(1.0, ge=0, le=1, description=(
        "The share of requests without a W3C traceparent that are traced (--trace-sample-ratio). A traceparent's "
        "sampled flag is always followed: behind the Sluice gateway, its --trace-sample-ratio decides."))


class LocalObjectReference(_Object):
    name: str = Field(min_length=1, max_length=253)


# What the operator sets on every engine pod itself: pod.labels, pod.annotations, pod.volumes and
# pod.volumeMounts may not take these (a test checks them against what reconcile renders).
OPERATOR_LABEL_PREFIX = "sluice.dev/"  # the endpoint, role and serves labels; the config-hash annotation
OPERATOR_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component",
                   "app.kubernetes.io/managed-by")
OPERATOR_VOLUMES = ("model-cache", "tmp", "dshm", "model", "config", "fetch-home", "kv-secret")
OPERATOR_VOLUME_PREFIX = "adapter-"  # a pvc:// adapter's claim, when the pods mount it for nothing else
OPERATOR_MOUNT_PATHS = ("/models-cache", "/tmp", "/dev/shm", "/models", "/etc/sluice", "/etc/sluice-kv",
                        "/adapter-claims")
MAX_POD_VOLUMES = 16
def _cel_list(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{i}'" for i in items) + "]"


def _core(name: str, *, max_items: int | None = None, **extra: Any) -> WithJsonSchema:
    """A core/v1 type's schema (core_schemas.py), or a list of it, as the CRD shows it."""
    node = {**core_schemas.schema(name), **extra}
    if max_items is not None:
        node = {"type": "array", "maxItems": max_items, "items": node}
    return WithJsonSchema(node)


def _bounded_names(node: dict[str, Any]) -> dict[str, Any]:
    # Bounds the CEL rules below need for their cost estimate (a volume name is a DNS label, a path <= PATH_MAX).
    node["properties"]["name"]["maxLength"] = 63
    return node


_VOLUME = _bounded_names(core_schemas.schema("Volume"))
_VOLUME["properties"]["hostPath"]["properties"]["path"]["maxLength"] = 4096
_MOUNT = _bounded_names(core_schemas.schema("VolumeMount"))
_MOUNT["properties"]["mountPath"]["maxLength"] = 4096
_StringMap = Annotated[dict[str, str], WithJsonSchema(
    {"type": "object", "maxProperties": 64, "additionalProperties": {"type": "string"}})]


class PodOverrides(_Object):
    """Pod-level settings passed through to the engine pods. Fields named after core/v1 types are checked
    against those types' schemas (Kubernetes 1.30): a misspelt field is refused, not dropped."""

    RULES = (
        Rule(f"!has(self.labels) || self.labels.all(k, !k.startsWith('{OPERATOR_LABEL_PREFIX}') && "
             f"!(k in {_cel_list(OPERATOR_LABELS)}))",
             f"pod.labels must not set the operator's own labels ({OPERATOR_LABEL_PREFIX}*, "
             + ", ".join(OPERATOR_LABELS) + "): its Services and selectors rely on them",
             lambda p: all(not k.startswith(OPERATOR_LABEL_PREFIX) and k not in OPERATOR_LABELS for k in p.labels),
             field_path=".labels"),
        Rule(f"!has(self.annotations) || self.annotations.all(k, !k.startsWith('{OPERATOR_LABEL_PREFIX}'))",
             f"pod.annotations must not set the operator's own annotations ({OPERATOR_LABEL_PREFIX}*)",
             lambda p: all(not k.startswith(OPERATOR_LABEL_PREFIX) for k in p.annotations),
             field_path=".annotations"),
        Rule(f"!has(self.volumes) || self.volumes.all(v, !(v.name in {_cel_list(OPERATOR_VOLUMES)}) && "
             f"!v.name.startsWith('{OPERATOR_VOLUME_PREFIX}'))",
             "pod.volumes must not use the names of the operator's volumes (" + ", ".join(OPERATOR_VOLUMES)
             + f", {OPERATOR_VOLUME_PREFIX}*)",
             lambda p: all(v.get("name") not in OPERATOR_VOLUMES
                           and not str(v.get("name", "")).startswith(OPERATOR_VOLUME_PREFIX) for v in p.volumes),
             field_path=".volumes"),
        Rule("!has(self.volumes) || self.volumes.all(v, !has(v.hostPath) || ("
             + HOST_PATH_CEL.format(p="v.hostPath.path") + "))",
             "pod.volumes[].hostPath.path must be an absolute directory other than / without '..'",
             lambda p: all(host_path_ok(v["hostPath"].get("path", "")) for v in p.volumes if "hostPath" in v),
             field_path=".volumes"),
        Rule("!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes) && "
             "self.volumes.exists(v, v.name == m.name))",
             "pod.volumeMounts[].name must name one of pod.volumes",
             lambda p: all(m.get("name") in {v.get("name") for v in p.volumes} for m in p.volume_mounts),
             field_path=".volumeMounts"),
        Rule(f"!has(self.volumeMounts) || self.volumeMounts.all(m, !(m.mountPath in {_cel_list(OPERATOR_MOUNT_PATHS)})"
             f" && {_cel_list(OPERATOR_MOUNT_PATHS)}.all(d, !m.mountPath.startsWith(d + '/')))",
             "pod.volumeMounts[].mountPath must not be or be under a directory the operator mounts ("
             + ", ".join(OPERATOR_MOUNT_PATHS) + ")",
             lambda p: all(not any(m.get("mountPath", "") == d or m.get("mountPath", "").startswith(d + "/")
                                   for d in OPERATOR_MOUNT_PATHS) for m in p.volume_mounts),
             field_path=".volumeMounts"),
    )
    resources: Annotated[dict[str, Any] | None, _core("ResourceRequirements")] = Field(None, description=(
        "Engine container resources (core/v1 ResourceRequirements). The operator sets the GPU limit itself."))
    node_selector: dict[str, str] = Field(default_factory=dict, description="Added to the product selector.")
    tolerations: Annotated[list[dict[str, Any]], _core("Toleration", max_items=32)] = Field(
        default_factory=list, description="core/v1 Tolerations, added to the GPU toleration the operator sets.")
    affinity: Annotated[dict[str, Any] | None, _core("Affinity")] = Field(None, description="core/v1 Affinity.")
    topology_spread_constraints: Annotated[list[dict[str, Any]], _core("TopologySpreadConstraint", max_items=8)] = (
        Field(default_factory=list, description=(
            "core/v1 TopologySpreadConstraints, e.g. replicas spread over zones (a labelSelector on "
            "sluice.dev/endpoint selects this endpoint's pods).")))
    priority_class_name: str | None = Field(None, max_length=253, description="PriorityClass of the pods.")
    service_account_name: str | None = Field(None, max_length=253, pattern=DNS_SUBDOMAIN, description=(
        "ServiceAccount of the pods, e.g. one bound to a cloud identity (IRSA, GKE Workload Identity). "
        "Default: the namespace's default. Its API token is not mounted (automountServiceAccountToken false); "
        "identity webhooks project their own token."))
    runtime_class_name: str | None = Field(None, max_length=253, pattern=DNS_SUBDOMAIN, description=(
        "RuntimeClass of the pods, e.g. nvidia or a sandboxed runtime."))
    scheduler_name: str | None = Field(None, max_length=253, pattern=DNS_SUBDOMAIN, description=(
        "The scheduler that places the pods. Default: the cluster's default scheduler."))
    labels: _StringMap = Field(default_factory=dict, description=(
        "Extra labels of the engine pods (not of the workload); the operator's own labels always win."))
    annotations: _StringMap = Field(default_factory=dict, description="Extra annotations of the engine pods.")
    env: Annotated[list[dict[str, Any]], _core("EnvVar", max_items=64)] = Field(default_factory=list, description=(
        "core/v1 EnvVars of the engine container (a Secret named in valueFrom is subject to the operator's policy)."))
    volumes: Annotated[list[dict[str, Any]], WithJsonSchema(
        {"type": "array", "maxItems": MAX_POD_VOLUMES, "items": _VOLUME})] = Field(
        default_factory=list, description=(
            "Extra core/v1 Volumes of the engine pods (hostPath and Secret volumes are subject to the "
            "operator's policy)."))
    volume_mounts: Annotated[list[dict[str, Any]], WithJsonSchema(
        {"type": "array", "maxItems": MAX_POD_VOLUMES, "items": _MOUNT})] = Field(
        default_factory=list, description="core/v1 VolumeMounts of the engine container, of pod.volumes.")
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list, description="Image pull Secrets.")

    _core_fields = field_validator("resources", "tolerations", "affinity", "topology_spread_constraints", "env",
                                   "volumes", "volume_mounts")(classmethod(_check_core_fields))


# -- prefill/decode disaggregation ------------------------------------------------------------------------
DEFAULT_BLOCK_SIZE = 16  # the engine's --block-size default
KV_PORT = 8100  # the decode engines' KV receiver (--kv-port), the container port named kv
SIZE_PATTERN = r"^[0-9]*\.?[0-9]+([kKmMgGtT]i?)?[bB]?$"  # what the engine's parse_size takes, e.g. 2GiB


class _PoolScaling(_Object):
    RULES = (
        Rule("self.minReplicas <= self.maxReplicas", "minReplicas must not exceed maxReplicas",
             lambda s: s.min_replicas <= s.max_replicas, field_path=".minReplicas"),
    )
    min_replicas: int = Field(1, ge=1, le=1000, description="Fewest replicas of the pool.")
    max_replicas: int = Field(ge=1, le=1000, description="Most replicas of the pool.")
    scale_down_delay_seconds: int = Field(300, ge=0, le=86400, description="Stabilization window before scaling in.")


class PrefillScaling(_PoolScaling):
    """KEDA scaling of the prefill pool on its backlog: prompt tokens not computed yet per replica."""

    target_prompt_tokens: int = Field(8192, ge=1, description=(
        "Prompt tokens waiting to be computed (sluice_num_prompt_tokens_waiting) per prefill replica the "
        "autoscaler aims for."))


class DecodeScaling(_PoolScaling):
    """KEDA scaling of the decode pool on the sequences it carries: running plus waiting requests per replica."""

    target_requests: int = Field(32, ge=1, description=(
        "Requests running and waiting (sluice_num_requests_running + sluice_num_requests_waiting) per decode "
        "replica the autoscaler aims for."))


class _Pool(_Object):
    RULES = (
        Rule("!(has(self.replicas) && has(self.scaling))",
             "set either replicas (a fixed count) or scaling, not both",
             lambda p: p.replicas is None or p.scaling is None),
    )
    replicas: int | None = Field(None, ge=0, le=1000, description=(
        "A fixed replica count (mutually exclusive with scaling). Default: 1 when scaling is unset."))
    resources: Annotated[dict[str, Any] | None, _core("ResourceRequirements")] = Field(None, description=(
        "The pool's engine container resources (core/v1 ResourceRequirements), in place of pod.resources. The "
        "operator sets the GPU limit itself."))
    args: Annotated[dict[str, Any], WithJsonSchema(_ARGS_SCHEMA)] = Field(default_factory=dict, description=(
        "Engine flags of this pool only, over engine.args (e.g. a larger max-num-batched-tokens for prefill). "
        "block-size must be the same in both pools."))

    _known_flags = field_validator("args")(classmethod(_check_engine_args))

    _core_fields = field_validator("resources")(classmethod(_check_core_fields))

    @property
    def fixed_replicas(self) -> int | None:
        if self.scaling is not None:
            return None
        return 1 if self.replicas is None else self.replicas


class PrefillPool(_Pool):
    """Engines that compute prompts (`--kv-role prefill`) and push their KV blocks to the decode engine that asked."""

    scaling: PrefillScaling | None = Field(None, description="Autoscaling (mutually exclusive with replicas).")


class DecodePool(_Pool):
    """Engines clients talk to (the endpoint's Service): each sends a request's prompt to the prefill pool first
    (`--prefill-url`), takes its blocks into its KV offload tier and decodes; a failed hop means computing the
    prompt itself."""

    scaling: DecodeScaling | None = Field(None, description="Autoscaling (mutually exclusive with replicas).")
    kv_offload_bytes: str = Field("1GiB", pattern=SIZE_PATTERN, max_length=32, description=(
        "Host memory of each decode engine for the blocks prefill engines push (--kv-offload-bytes), e.g. 4GiB; "
        "it is in the pod's memory, so size the container's memory for it."))
    min_prompt_tokens: int = Field(256, ge=0, description=(
        "Prompts shorter than this are computed by the decode engine itself (--prefill-min-prompt-tokens): a "
        "hop costs more than it saves."))


class Disaggregation(_Object):
    """Prefill/decode disaggregation: two pools of engines, each with its own replicas and resources, the KV
    cache of each prompt moving from a prefill engine to the decode engine serving the request (TCP)."""

    prefill: PrefillPool = Field(default_factory=PrefillPool, description="The prefill pool (<name>-prefill).")
    decode: DecodePool = Field(default_factory=DecodePool, description="The decode pool (<name>).")


def pool_block_size(spec: EndpointSpec, pool: _Pool) -> int:
    """The KV block size a pool's engines run with: its args', else engine.args', else the engine's default."""
    return int(pool.args.get("block-size", spec.engine.args.get("block-size", DEFAULT_BLOCK_SIZE)))


def _block_size_cel(pool: str) -> str:
    p = f"self.disaggregation.{pool}"
    return (f"(has({p}) && has({p}.args) && 'block-size' in {p}.args ? int({p}.args['block-size']) : "
            "(has(self.engine) && has(self.engine.args) && 'block-size' in self.engine.args ? "
            f"int(self.engine.args['block-size']) : {DEFAULT_BLOCK_SIZE}))")


# -- routing: Gateway API Inference Extension -------------------------------------------------------------
# Names as the Gateway API spells them: a namespace is a DNS label, a listener's sectionName a DNS subdomain, a
# hostname a DNS name with an optional leading wildcard label (the HTTPRoute CRD's own patterns).
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
SECTION_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
HOSTNAME_PATTERN = r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
MAX_GATEWAY_NAMESPACES = 16


class Picker(_Object):
    """The endpoint picker (EPP) the gateway consults for every request: `sluice gateway --endpoint-picker`."""

    replicas: int = Field(1, ge=1, le=16, description=(
        "Picker replicas. Each one finds the endpoint's ready pods on its own (no state shared between them), "
        "so 2 keeps routing up through a picker's restart when failureMode is FailClose."))
    resources: Annotated[dict[str, Any] | None, _core("ResourceRequirements")] = Field(None, description=(
        "The picker container's resources (core/v1 ResourceRequirements). Default: requests of 100m CPU and "
        "128Mi memory, a 512Mi memory limit."))

    _core_fields = field_validator("resources")(classmethod(_check_core_fields))


class GatewayParentRef(_Object):
    """A Gateway (gateway.networking.k8s.io) the HTTPRoute attaches to. Kind Gateway only: the parent the
    Inference Extension's gateways implement."""

    name: str = Field(min_length=1, max_length=253, description="The Gateway's name.")
    namespace: str | None = Field(None, min_length=1, max_length=63, pattern=DNS_LABEL_PATTERN, description=(
        "The Gateway's namespace. Default: the endpoint's. A Gateway in another namespace admits the route "
        "only if its listener's allowedRoutes.namespaces lets this namespace in."))
    section_name: str | None = Field(None, min_length=1, max_length=253, pattern=SECTION_NAME_PATTERN,
                                     description="The Gateway's listener to attach to. Default: every listener "
                                                 "that admits the route.")
    port: int | None = Field(None, ge=1, le=65535, description="The listener port to attach to. Default: any.")


class HttpRoute(_Object):
    """An HTTPRoute `<name>` sending the listener's traffic (path prefix /) to the InferencePool."""

    RULES = (
        Rule("!has(self.hostnames) || self.hostnames.all(h, self.hostnames.exists_one(g, g == h))",
             "routing.inferencePool.httpRoute.hostnames must be unique",
             lambda r: len(set(r.hostnames)) == len(r.hostnames), field_path=".hostnames"),
    )
    parent_refs: list[GatewayParentRef] = Field(min_length=1, max_length=32, description=(
        "The Gateways (and listeners) the route attaches to: the platform team's, e.g. "
        "{name: shared-gw, namespace: infra, sectionName: http}."))
    hostnames: list[Annotated[str, Field(min_length=1, max_length=253, pattern=HOSTNAME_PATTERN)]] = Field(
        default_factory=list, max_length=16, description=(
            "Host headers the route matches, e.g. llama.example.com or *.example.com. Default: every host the "
            "listener accepts."))


class InferencePoolRouting(_Object):
    """The Gateway API Inference Extension objects (docs/gateway-api.md): an InferencePool `<name>` selecting the
    serving engine pods, the endpoint picker that pool names (Deployment and Service `<name>-epp`), optionally an
    HTTPRoute `<name>` to a Gateway, and NetworkPolicy rules admitting the gateway's data plane."""

    RULES = (
        Rule("has(self.httpRoute) || (has(self.gatewayNamespaces) && size(self.gatewayNamespaces) > 0)",
             "routing.inferencePool needs gatewayNamespaces (or an httpRoute, whose Gateways' namespaces are then "
             "admitted): the engines and the picker admit the gateway's data plane from those namespaces only",
             lambda r: r.http_route is not None or bool(r.gateway_namespaces)),
        Rule("!has(self.gatewayNamespaces) || self.gatewayNamespaces.all(n, self.gatewayNamespaces.exists_one(m, m == n))",
             "routing.inferencePool.gatewayNamespaces must be unique",
             lambda r: len(set(r.gateway_namespaces)) == len(r.gateway_namespaces), field_path=".gatewayNamespaces"),
    )
    picker: Picker = Field(default_factory=Picker, description=(
        "The endpoint picker: a Deployment and Service `<name>-epp` (gRPC ext-proc on port 9002, /metrics on "
        "8080) running the operator's engine image, which holds the whole sluice distribution."))
    failure_mode: Literal["FailOpen", "FailClose"] = Field("FailClose", description=(
        "What the gateway does when the picker does not answer (the InferencePool's endpointPickerRef."
        "failureMode). FailClose: the request fails, so no request bypasses the picker's choice (load, prefix "
        "affinity, a replica still loading). FailOpen: the gateway picks a pool pod itself."))
    max_inflight_per_pod: int = Field(0, ge=0, le=4096, description=(
        "Flow control in the picker: no engine pod gets more than this many requests in flight from it; beyond, "
        "requests wait in the picker's queue by priority (InferenceObjective), tenant by tenant within a "
        "priority (x-gateway-inference-fairness-id), and sheddable ones (priority below 0) get 429. Set it near "
        "the engines' max-num-seqs. 0: no limit (queueing is left to each engine)."))
    http_route: HttpRoute | None = Field(None, description=(
        "An HTTPRoute `<name>` attaching the pool to a Gateway the platform runs. Unset: no route; a platform "
        "team may write its own with backendRefs [{group: inference.networking.k8s.io, kind: InferencePool, "
        "name: <name>}]."))
    gateway_namespaces: list[Annotated[str, Field(min_length=1, max_length=63, pattern=DNS_LABEL_PATTERN)]] = Field(
        default_factory=list, max_length=MAX_GATEWAY_NAMESPACES, description=(
            "Namespaces whose pods (the gateway's data plane, e.g. Envoy Gateway's proxies) may open connections "
            "to the engines' HTTP port and the picker's gRPC port (NetworkPolicy). Default: the namespaces of "
            "httpRoute.parentRefs (the endpoint's for a parentRef without one). Some implementations run their "
            "proxies elsewhere than the Gateway (Envoy Gateway: envoy-gateway-system): name that namespace."))

    def admitted_namespaces(self, own: str) -> list[str]:
        """The namespaces the NetworkPolicies admit the gateway from (gatewayNamespaces, else the parents')."""
        if self.gateway_namespaces:
            return list(self.gateway_namespaces)
        assert self.http_route is not None
        return sorted({ref.namespace or own for ref in self.http_route.parent_refs})


class Objective(_Object):
    """A request class and its priority, as a Gateway API Inference Extension InferenceObjective has them."""

    name: str = Field(..., min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", description=(
        "What requests name in the header x-gateway-inference-objective."))
    priority: int = Field(..., ge=-(2**31 - 1), le=2**31 - 1, description=(
        "Higher is more important; below 0 is sheddable (the picker's flow control answers 429 rather than queue "
        "it). The engine receives it as its request priority (lower is sooner): -priority."))


class Routing(_Object):
    """How clients reach the engines besides the endpoint's Service and the Sluice gateway."""

    RULES = (
        Rule("!has(self.objectives) || self.objectives.all(o, self.objectives.exists_one(p, p.name == o.name))",
             "routing.objectives names must be unique", lambda r: len({o.name for o in r.objectives})
             == len(r.objectives), field_path=".objectives"),
    )

    objectives: list[Objective] = Field(default_factory=list, max_length=64, description=(
        "Request priorities by the header x-gateway-inference-objective, for the Sluice gateway and the endpoint "
        "picker alike (users without the Inference Extension get its InferenceObjectives this way; where both "
        "name one, the InferenceObjective wins in the picker). A request naming none, or one not listed, is "
        "priority 0; a client's own `priority` field is replaced. Set: the engines run --scheduling-policy "
        "priority (unless engine.args sets one)."))
    inference_pool: InferencePoolRouting | None = Field(None, description=(
        "Gateway API Inference Extension routing (inference.networking.k8s.io/v1): set, the operator renders an "
        "InferencePool, its endpoint picker and, with httpRoute, an HTTPRoute, so a Gateway the platform runs "
        "(Envoy Gateway, Istio, GKE, ...) routes to the engines through the picker."))


# -- the spec -------------------------------------------------------------------------------------------
def _tp(s: EndpointSpec) -> tuple[int, int, int | None]:
    return s.parallelism.tensor, s.parallelism.pipeline, s.accelerator.gpus_per_node


_T = "(has(self.parallelism) ? self.parallelism.tensor : 1)"
_P = "(has(self.parallelism) ? self.parallelism.pipeline : 1)"
_HAS_G = "has(self.accelerator) && has(self.accelerator.gpusPerNode)"
_G = "self.accelerator.gpusPerNode"
_HAS_N = "has(self.parallelism) && has(self.parallelism.nodes)"
_HAS_Q = "has(self.engine) && has(self.engine.quantization)"
_HAS_KV = "has(self.engine) && has(self.engine.kvCacheDtype)"
_CPU = "(has(self.accelerator) && self.accelerator.type == 'cpu')"


def _cel_list(values: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"
_N = "self.parallelism.nodes"
_HAS_ADAPTERS = "(has(self.adapters) && size(self.adapters) > 0)"
_LORA_ARG = "(has(self.engine) && has(self.engine.args) && 'enable-lora' in self.engine.args && " \
            "string(self.engine.args['enable-lora']) == '{}')"
_LORA = f"({_HAS_ADAPTERS} || {_LORA_ARG.format('true')})"
# An adapter's name against the served name. servedName when set (and not empty), else the last path component
# of model.uri (sluice_contract.served_name): the uri ends with '/<name>', possibly followed by slashes. CEL
# has no split: a name with a '.' makes the regex's '.' a wildcard, so `contains` also asks for '/<name>/'
# verbatim (what the regex alone would confuse, e.g. 'x.y' and '.../xzy/', then needs both in one uri). The
# name-pattern guard keeps an invalid name (its own rule's failure) out of the regex.
_ADAPTER_IS_SERVED = (
    f"a.name.matches('{ADAPTER_NAME_PATTERN}') && ("
    "(has(self.model.servedName) && size(self.model.servedName) > 0) ? a.name == self.model.servedName : "
    "(self.model.uri.endsWith('/' + a.name) || (self.model.uri.matches('/' + a.name + '/+$') && "
    "self.model.uri.contains('/' + a.name + '/'))))")


def lora_enabled(s: EndpointSpec) -> bool:
    """Whether the engines run with --enable-lora: for spec.adapters, or kept on by engine.args."""
    return bool(s.adapters) or s.engine.args.get("enable-lora") == "true"


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
        Rule(f"!({_HAS_N} && {_HAS_G}) || {_N} < 1 || {_T} * {_P} / {_N} <= {_G}",
             "parallelism.nodes is too few: tensor x pipeline / nodes GPUs per node must not exceed "
             "accelerator.gpusPerNode",
             lambda s: (lambda t, p, g, n: n is None or g is None or t * p // n <= g)(
                 *_tp(s), s.parallelism.nodes),
             field_path=".parallelism"),
        Rule(f"!({_HAS_Q}) || !{_CPU} || !(self.engine.quantization in {_cel_list(GPU_QUANTIZATIONS)})",
             "engine.quantization fp8, awq and gptq run on GPUs only (Triton kernels) and accelerator.type is cpu; "
             "on a CPU use q8_0, q4_0, q4_1 (GGUF), none or auto",
             lambda s: s.accelerator.type != "cpu" or s.engine.quantization not in GPU_QUANTIZATIONS,
             field_path=".engine"),
        Rule(f"!({_HAS_Q}) || {_CPU} || !(self.engine.quantization in {_cel_list(CPU_QUANTIZATIONS)})",
             "engine.quantization q8_0, q4_0 and q4_1 (GGUF) run on CPUs only (accelerator.type cpu); on a GPU "
             "use fp8, awq, gptq, none or auto",
             lambda s: s.accelerator.type == "cpu" or s.engine.quantization not in CPU_QUANTIZATIONS,
             field_path=".engine"),
        Rule(f"!({_HAS_KV}) || !{_CPU} || self.engine.kvCacheDtype != 'fp8'",
             "engine.kvCacheDtype fp8 runs on GPUs only (the Triton attention kernels) and accelerator.type is "
             "cpu; on a CPU use auto",
             lambda s: s.accelerator.type != "cpu" or s.engine.kv_cache_dtype != "fp8",
             field_path=".engine"),
        # spec.adapters: a list-map by name (the API server's "Duplicate value" too), and this rule for the
        # message and for `sluice render`.
        Rule("!has(self.adapters) || self.adapters.all(a, self.adapters.exists_one(b, b.name == a.name))",
             "adapters[].name must be unique: each adapter is served as the model of that name",
             lambda s: len({a.name for a in s.adapters}) == len(s.adapters), field_path=".adapters"),
        Rule(f"!has(self.adapters) || self.adapters.all(a, !({_ADAPTER_IS_SERVED}))",
             "adapters[].name must not be the model's served name (model.servedName, else the last path "
             "component of model.uri): clients tell the model and its adapters apart by name",
             lambda s: all(a.name != s.model.name for a in s.adapters), field_path=".adapters"),
        # Tensor and pipeline parallel ranks in one pod each hold their shard of every adapter. Across pods (a
        # LeaderWorkerSet group) each pod's sidecars fetch on their own, and a rank that found no files at the
        # adapter's path when the leader loads it would fail the step: not until the group agrees on readiness.
        Rule(f"!{_LORA} || ((!({_HAS_N}) || {_N} <= 1) && (!({_HAS_G}) || {_T} * {_P} <= {_G}))",
             "LoRA adapters (spec.adapters, engine.args enable-lora) run on replicas of one pod for now: "
             "tensor x pipeline within accelerator.gpusPerNode, parallelism.nodes 1",
             lambda s: not lora_enabled(s) or ((s.parallelism.nodes or 1) <= 1 and (
                 lambda t, p, g: g is None or t * p <= g)(*_tp(s))),
             field_path=".parallelism"),
        Rule("!has(self.disaggregation) || (!has(self.replicas) && !has(self.scaling))",
             "with disaggregation, set replicas or scaling per pool (disaggregation.prefill, disaggregation.decode), "
             "not spec.replicas or spec.scaling",
             lambda s: s.disaggregation is None or (s.replicas is None and s.scaling is None)),
        Rule(f"!has(self.disaggregation) || ({_T} == 1 && {_P} == 1 && (!({_HAS_N}) || {_N} <= 1))",
             "disaggregation runs engines of one rank for now: parallelism.tensor, pipeline and nodes must be 1 "
             "(moving KV blocks between multi-rank engines is not built yet)",
             lambda s: s.disaggregation is None or (s.parallelism.tensor == 1 and s.parallelism.pipeline == 1
                                                     and (s.parallelism.nodes or 1) <= 1),
             field_path=".parallelism"),
        Rule(f"!has(self.disaggregation) || {_block_size_cel('prefill')} == {_block_size_cel('decode')}",
             "disaggregation.prefill and disaggregation.decode must use the same KV block size (args block-size, "
             "else engine.args block-size): the decode engines take the prefill engines' blocks as they are and "
             "refuse another layout",
             lambda s: s.disaggregation is None or pool_block_size(s, s.disaggregation.prefill) == pool_block_size(
                 s, s.disaggregation.decode),
             field_path=".disaggregation"),
        Rule(f"!({_HAS_ADAPTERS} && {_LORA_ARG.format('false')})",
             "engine.args enable-lora \"false\" contradicts spec.adapters: the engines serve adapters with LoRA "
             "on; remove the key",
             lambda s: not (s.adapters and s.engine.args.get("enable-lora") == "false"), field_path=".engine"),
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
    rollout: Rollout = Field(default_factory=Rollout, description=(
        "How a changed pod template rolls out. Default: one replica at a time, no spare GPUs (maxSurge 0, "
        "maxUnavailable 1)."))
    slo: Slo | None = Field(None, description=(
        "Latency objectives. Changing them reaches the engines through the ConfigMap and restarts no pod."))
    cost: Cost | None = Field(None, description="Cost inputs. Changing them restarts no pod.")
    pod: PodOverrides = Field(default_factory=PodOverrides, description="Pod-level escape hatches.")
    adapters: list[Adapter] = Field(
        default_factory=list, max_length=MAX_ADAPTERS,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description=(
            "PEFT LoRA adapters served beside the model, each as a model of its own name. Adding or removing one "
            "changes the ConfigMap only: running engines fetch and load it, or unload it, without a restart. The "
            "engines run with --enable-lora while the list is not empty (or engine.args enable-lora is \"true\"), "
            "so the first adapter added, and the last removed, roll the pods once; so does the first adapter on "
            "a pvc claim the pods do not mount yet, and the last one removed from it. One rank only "
            "(parallelism.tensor and pipeline 1)."))
    tracing: Tracing | None = Field(None, description=(
        "OpenTelemetry tracing: each request an engine serves becomes a span (queue, prefill, decode), under the "
        "caller's traceparent (the gateway's, through the Sluice gateway). Unset: off. Changing it rolls the pods."))
    routing: Routing | None = Field(None, description=(
        "Routing through a Gateway API gateway (routing.inferencePool: docs/gateway-api.md). Unset: clients use "
        "the endpoint's Service or the Sluice gateway only."))
    disaggregation: Disaggregation | None = Field(None, description=(
        "Prefill/decode disaggregation: a prefill pool (<name>-prefill) computes prompts and pushes their KV "
        "blocks to the decode pool (<name>, the endpoint's Service), so long prompts never stall decoding and "
        "each pool scales on its own signal. Both pools serve model, engine and accelerator as set above; "
        "replicas and scaling are set per pool. One-rank engines only for now (parallelism 1)."))

    @property
    def fixed_replicas(self) -> int | None:
        """The replica count when not autoscaled, else None (with disaggregation: the decode pool's)."""
        if self.disaggregation is not None:
            return self.disaggregation.decode.fixed_replicas
        if self.scaling is not None:
            return None
        return 1 if self.replicas is None else self.replicas


# -- status ---------------------------------------------------------------------------------------------
class Condition(_Object):
    type: str = Field(max_length=316, description=(
        "Ready, ModelReady, Scheduled, Progressing, Degraded, Reconciled (False with NameConflict or ApplyFailed "
        "when an object could not be applied), with scaling AutoscalerReady, AutoscalerActive and "
        "AutoscalerFallback (KEDA's Ready, Active and Fallback), with adapters AdaptersReady (every adapter "
        "loaded on every ready serving replica), and with routing.inferencePool InferencePoolAccepted and "
        "InferencePoolResolvedRefs (the InferencePool's Accepted and ResolvedRefs over the Gateways that route to "
        "it)."))
    status: Literal["True", "False", "Unknown"]
    reason: str | None = Field(None, max_length=1024, description=(
        "CamelCase cause, e.g. InsufficientCapacity, ModelLoading, ScaledToZero, InvalidSpec, PolicyViolation, "
        "NameConflict (an object of that name exists and is not the endpoint's: it is left untouched), "
        "ApplyFailed (the API server refused an object; the message is its own), or KEDA's own."))
    message: str | None = Field(None, max_length=32768)
    last_transition_time: str | None = Field(None, json_schema_extra={"format": "date-time"})
    observed_generation: int | None = Field(None, ge=0)


class ReplicaStatus(_Object):
    desired: int | None = Field(None, ge=0, description="Replicas the workload aims for.")
    ready: int | None = Field(None, ge=0, description="Replicas ready to serve.")
    standby: int | None = Field(None, ge=0, description="Ready warm-pool pods (set when scaling.warmPool is).")
    prefill_desired: int | None = Field(None, ge=0, description=(
        "Prefill replicas the prefill workload aims for (set with disaggregation; desired and ready are then the "
        "decode pool's)."))
    prefill_ready: int | None = Field(None, ge=0, description="Prefill replicas ready (set with disaggregation).")


class AdapterStatus(_Object):
    name: str = Field(max_length=128, description="The adapter (spec.adapters[].name).")
    loaded: bool = Field(description="Loaded on every ready serving replica (and there is one).")
    loaded_replicas: int = Field(ge=0, description="Ready serving replicas that have it loaded.")
    message: str | None = Field(None, max_length=4096, description=(
        "On which replicas it is loaded, and which it is not on yet: still downloading (the fetch-adapters "
        "sidecars' logs say why), or refused by the engine (rank, shapes; the engine's log says why)."))


class EndpointStatus(_Object):
    """The observed state, written by the operator only."""

    observed_generation: int | None = Field(None, ge=0)
    phase: Literal["Pending", "Loading", "Ready", "Idle", "Degraded", "Failed"] | None = Field(
        None, description="Pending: no serving pod runs yet (InsufficientCapacity: none can be scheduled). "
                          "Loading: pods run, the model loads. Ready: at least one replica serves. Idle: scaled "
                          "to zero. Degraded: serving, with a workload failure or an object the API server "
                          "refused. Failed: nothing serves, or an object's name is taken (NameConflict).")
    url: str | None = Field(None, description=(
        "OpenAI-compatible base URL inside the cluster: the gateway's for an autoscaled endpoint (it holds "
        "requests while replicas start), else the endpoint's Service."))
    replicas: ReplicaStatus | None = None
    selector: str | None = Field(None, description="Label selector of the serving pods (scale subresource).")
    conditions: list[Condition] = Field(default_factory=list, json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    adapters: list[AdapterStatus] | None = Field(None, max_length=MAX_ADAPTERS, json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]}, description=(
        "The LoRA adapters of spec.adapters and whether each is loaded on every ready serving replica, as each "
        "replica's /v1/models lists them (asked at every status pass while one is not loaded everywhere)."))


# -- the resource ---------------------------------------------------------------------------------------
# For every layout, not only multi-node: a Service's name, and a LeaderWorkerSet's name as LWS's webhook checks it
# (NameIsDNS1035Label), must each be a DNS-1035 label of at most 63 characters, which these rules imply for
# `<name>` and `<name>-warm` (tests/operator/test_operator_spec.py checks the LeaderWorkerSets' names).
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
    model_config = ConfigDict(alias_generator=to_camel, extra="forbid", strict=True)

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

    reason = "InvalidSpec"  # the Ready condition's reason when the operator refuses the endpoint


def format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        path = ""
        for part in e["loc"]:
            path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{path or '(document)'}: {msg}")
    return "\n".join(lines)


def without_nulls(node: Any) -> Any:
    """The document as the API server validates it: a field set to null is dropped first (no field of the
    schema is nullable), so `scaling: null` means no scaling and a required field set to null is missing.
    Items of a list are kept: a null item is refused by both."""
    if isinstance(node, dict):
        return {k: without_nulls(v) for k, v in node.items() if v is not None}
    if isinstance(node, list):
        return [without_nulls(v) for v in node]
    return node


def parse_endpoint(doc: Any) -> InferenceEndpoint:
    """Validate one InferenceEndpoint document; SpecError names every offending field."""
    if not isinstance(doc, dict):
        raise SpecError(f"expected an InferenceEndpoint object, got {type(doc).__name__}")
    try:
        return InferenceEndpoint.model_validate(without_nulls(doc))
    except ValidationError as e:
        name = (doc.get("metadata") or {}).get("name", "?") if isinstance(doc.get("metadata"), dict) else "?"
        raise SpecError(f"invalid InferenceEndpoint {name!r}:\n" + format_errors(e)) from None
