"""The names the operator and the gateway agree on: labels, the endpoint key, the served-name rule, the
names clients send, and the metric names the operator's queries read. Standard library only: the gateway
imports it without pulling in pydantic, and the operator without pulling in aiohttp or grpc.

Change a value here deliberately: objects already in a cluster carry the old labels, and the rules,
dashboards and ScaledObjects of running endpoints query the old metric names (docs/gateway.md,
docs/operator.md).
"""

from __future__ import annotations

# -- the resource ------------------------------------------------------------------------------------------
GROUP = "sluice.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceEndpoint"
PLURAL = "inferenceendpoints"

# -- labels on what the operator creates -------------------------------------------------------------------
# On every child object and pod: the InferenceEndpoint's name. The EndpointSlice controller copies a
# Service's labels onto its slices, which is how the gateway finds an endpoint's backends.
ENDPOINT_LABEL = f"{GROUP}/endpoint"
# "serving" on the autoscaled workload's pods and Service, "standby" on the warm pool's: the gateway tells the
# two classes of backend apart by it.
ROLE_LABEL = f"{GROUP}/role"
SERVING, STANDBY = "serving", "standby"
# "prefill" on a disaggregated endpoint's prefill pool (spec.disaggregation): its engines are reached by the
# decode engines only, never by clients, so the gateway leaves that Service's slices out.
PREFILL = "prefill"
# Read by the gateway when a slice carries the pods' pool label instead of the role.
POOL_LABEL = f"{GROUP}/pool"
SERVES_LABEL = f"{GROUP}/serves"  # "true" on pods that answer HTTP (LeaderWorkerSet workers do not)
# Set by the EndpointSlice controller on every slice of a Service (Kubernetes' own label).
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def endpoint_key(namespace: str, name: str) -> str:
    """How the gateway names an endpoint: in its metrics (label `endpoint`), in the external scaler's
    trigger metadata (`endpoint`), and in API keys files."""
    return f"{namespace}/{name}"


# -- the model name ----------------------------------------------------------------------------------------
def served_name(served: str | None, uri: str) -> str:
    """The name the engine answers to: spec.model.servedName, else the last path component of the uri
    (hf://Org/Model-7B -> Model-7B). The operator passes it to the engine as --served-model-name."""
    if served:
        return served
    location = uri.split("://", 1)[-1].rstrip("/")
    return location.rsplit("/", 1)[-1]


# spec.model.nameScope: where the gateway publishes the served name.
NAME_SCOPE_NAMESPACE = "Namespace"  # clients send <namespace>/<servedName>
NAME_SCOPE_CLUSTER = "Cluster"  # ... or the plain <servedName>, from any namespace
NAME_SCOPES = (NAME_SCOPE_NAMESPACE, NAME_SCOPE_CLUSTER)


def namespaced_model(namespace: str, served: str) -> str:
    """The name a client sends to reach `served` in `namespace` through the gateway. It cannot collide
    across namespaces: the namespace is part of it (a namespace name holds no '/')."""
    return f"{namespace}/{served}"


def model_names(namespace: str, served: str, scope: str, only_namespace: bool) -> tuple[str, ...]:
    """Every name an endpoint claims at the gateway, the namespaced one first. The plain served name is
    claimed too when the endpoint publishes it cluster-wide (`scope` Cluster) or when the gateway serves
    this one namespace only (`only_namespace`: no other namespace can claim it)."""
    if scope not in NAME_SCOPES:
        raise ValueError(f"model name scope must be one of {', '.join(NAME_SCOPES)}, got {scope!r}")
    names = [namespaced_model(namespace, served)]
    if scope == NAME_SCOPE_CLUSTER or only_namespace:
        names.append(served)
    return tuple(names)


# -- metrics the operator's queries read ---------------------------------------------------------------------
# Series names as Prometheus stores them: a counter's with its _total, a histogram's without the _bucket, _sum
# or _count the queries add. Read by the autoscaler's query, the rules and the dashboards (sluice_operator:
# autoscaling.py, monitoring.py, dashboards.py).
#
# The gateway's, which it exports under these names.
GATEWAY_PENDING_METRIC = "sluice_gateway_pending_requests"  # gauge {endpoint}: held for a ready backend
GATEWAY_INFLIGHT_METRIC = "sluice_gateway_inflight_requests"  # gauge {endpoint}: sent, not finished
GATEWAY_BACKENDS_METRIC = "sluice_gateway_backends"  # gauge {endpoint, role, state}
GATEWAY_STANDBY_REQUESTS_METRIC = "sluice_gateway_standby_requests_total"  # counter {endpoint}: sent to the warm pool
GATEWAY_SCALER_STREAMS_METRIC = "sluice_gateway_scaler_streams"  # gauge {endpoint}: KEDA's StreamIsActive streams open
# counter {tenant, endpoint, type}: tokens by tenant (the API keys file's) and type (prompt, completion)
GATEWAY_TENANT_TOKENS_METRIC = "sluice_gateway_tenant_tokens_total"
GATEWAY_TENANT_REQUESTS_METRIC = "sluice_gateway_tenant_requests_total"  # counter {tenant, endpoint}
GATEWAY_TENANT_LIMITED_METRIC = "sluice_gateway_tenant_rate_limited_total"  # counter {tenant, endpoint, limit}: 429s
# The engines', one series per replica (the ServiceMonitor adds namespace, sluice_dev_endpoint, sluice_dev_role,
# pod). The engine names them in sluice_engine/metrics.py; tests/operator/test_monitoring.py checks that it exports each.
ENGINE_REQUESTS_WAITING_METRIC = "sluice_num_requests_waiting"  # gauge: the queue targetQueueDepth counts
ENGINE_REQUESTS_RUNNING_METRIC = "sluice_num_requests_running"  # gauge: the running batch
ENGINE_KV_CACHE_USAGE_METRIC = "sluice_kv_cache_usage_perc"  # gauge, 0-1
ENGINE_SLO_TTFT_METRIC = "sluice_slo_ttft_seconds"  # gauge: the objective (0: none)
ENGINE_SLO_TPOT_METRIC = "sluice_slo_tpot_seconds"  # gauge: the objective (0: none)
ENGINE_GPU_HOUR_USD_METRIC = "sluice_gpu_hour_usd"  # gauge: price of a GPU-hour (0: not set)
ENGINE_GPUS_METRIC = "sluice_num_gpus"  # gauge; present on every loaded replica, so it also lists endpoints
ENGINE_PROMPT_TOKENS_METRIC = "sluice_prompt_tokens_total"
ENGINE_GENERATION_TOKENS_METRIC = "sluice_generation_tokens_total"
ENGINE_PREFIX_CACHE_QUERIES_METRIC = "sluice_prefix_cache_queries_total"  # prompt tokens looked up
ENGINE_PREFIX_CACHE_HITS_METRIC = "sluice_prefix_cache_hits_total"  # prompt tokens found
ENGINE_PREEMPTIONS_METRIC = "sluice_num_preemptions_total"
ENGINE_FINISHED_REQUESTS_METRIC = "sluice_request_success_total"  # {finished_reason}
ENGINE_SLO_CHECKED_METRIC = "sluice_request_slo_total"  # completed requests checked against the SLO
ENGINE_GOODPUT_METRIC = "sluice_request_goodput_total"  # ... of which met every objective set
ENGINE_SLO_MET_METRIC = "sluice_request_slo_met_total"  # {objective}: ... of which met that one
ENGINE_BUSY_SECONDS_METRIC = "sluice_engine_busy_seconds_total"  # {phase}: prefill or decode
ENGINE_TTFT_METRIC = "sluice_time_to_first_token_seconds"  # histogram
ENGINE_TPOT_METRIC = "sluice_request_time_per_output_token_seconds"  # histogram
ENGINE_ITL_METRIC = "sluice_inter_token_latency_seconds"  # histogram
ENGINE_E2E_LATENCY_METRIC = "sluice_e2e_request_latency_seconds"  # histogram
ENGINE_QUEUE_TIME_METRIC = "sluice_request_queue_time_seconds"  # histogram
ENGINE_PREFILL_TIME_METRIC = "sluice_request_prefill_time_seconds"  # histogram
ENGINE_ITERATION_TOKENS_METRIC = "sluice_iteration_tokens"  # histogram: tokens per engine step
# The external scaler's metric (GetMetricSpec / GetMetrics): held + in-flight requests over every gateway
# replica, per serving replica of the endpoint.
SCALER_METRIC_NAME = "sluice-gateway-demand"
# The external-push trigger's metadata keys the gateway reads.
TRIGGER_ENDPOINT = "endpoint"
TRIGGER_MODEL = "model"
