"""Prometheus rules for an endpoint: recording rules (goodput, SLO attainment, latency percentiles, throughput,
cost per 1M tokens) and alerts (SLO burn, no ready replica while requests wait, KEDA fallback).

Every expression is built here, once, over a `Scope`: the label matchers that pick an endpoint's series.
- `prometheus_rule(ep)`: the PrometheusRule reconcile() renders per endpoint, scoped by the labels its
  ServiceMonitor puts on every series (`namespace`, `sluice_dev_endpoint`) and, for the gateway's series, by
  `endpoint="<ns>/<name>"`.
- `generic_rule_file()`: the same rules over every endpoint at once (the chart's optional rule file).
- dashboards.py: the same expressions with Grafana's variables as the scope.
So rules, chart and dashboards cannot disagree. docs/metrics.md lists every rule and alert.

`python -m sluice_operator.monitoring` prints the generic rule file (charts/sluice/rules/).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import yaml

from sluice_contract import (
    ENGINE_BUSY_SECONDS_METRIC,
    ENGINE_GENERATION_TOKENS_METRIC,
    ENGINE_GOODPUT_METRIC,
    ENGINE_GPU_HOUR_USD_METRIC,
    ENGINE_GPUS_METRIC,
    ENGINE_PROMPT_TOKENS_METRIC,
    ENGINE_REQUESTS_RUNNING_METRIC,
    ENGINE_SLO_CHECKED_METRIC,
    ENGINE_SLO_MET_METRIC,
    ENGINE_TPOT_METRIC,
    ENGINE_TTFT_METRIC,
    GATEWAY_BACKENDS_METRIC,
    GATEWAY_PENDING_METRIC,
    GATEWAY_SCALER_STREAMS_METRIC,
    GATEWAY_TENANT_LIMITED_METRIC,
    GATEWAY_TENANT_TOKENS_METRIC,
)

from .autoscaling import ENDPOINT_METRIC_LABEL, QUEUE_METRIC, endpoint_key, engines_waiting, queue_query
from .config import OperatorConfig
from .meta import monitoring_meta
from .spec import InferenceEndpoint

EP = ENDPOINT_METRIC_LABEL  # sluice_dev_endpoint: the ServiceMonitor's copy of the Service's sluice.dev/endpoint
ROLE = "sluice_dev_role"  # the ServiceMonitor's copy of sluice.dev/role: serving or standby
BY = f"namespace, {EP}"  # what every recording rule keeps: one series per endpoint
LEVEL = "sluice_endpoint"  # the recording rules' level (Prometheus naming: level:metric:operations)
WINDOW = "5m"
QUANTILES = ("0.5", "0.9", "0.99")
LATENCIES = (  # recorded name -> engine histogram
    ("time_to_first_token_seconds", ENGINE_TTFT_METRIC),
    ("time_per_output_token_seconds", ENGINE_TPOT_METRIC),
)
TOKENS = {"prompt": ENGINE_PROMPT_TOKENS_METRIC, "generation": ENGINE_GENERATION_TOKENS_METRIC}
DEFAULT_SLO_TARGET = 0.99
# Multi-window, multi-burn-rate alerts (the Google SRE workbook's, for a 30-day budget): (name, burn rate,
# long window, short window, for, severity). 14.4x spends 2% of the budget in 1h; 6x spends 5% in 6h.
BURN_ALERTS = (
    ("SluiceSLOBurnRateFast", 14.4, "1h", "5m", "2m", "critical"),
    ("SluiceSLOBurnRateSlow", 6.0, "6h", "30m", "15m", "warning"),
)
ATTAINMENT_WINDOWS = (WINDOW, "30m", "1h", "6h")
DEFAULT_NO_READY_FOR_S = 600  # the generic rules' wait: startupGraceSeconds' default
# KEDA's own counter of errors reading a trigger, per scaler (KEDA >= 2.14; older releases named it
# keda_scaler_errors). Its `namespace` label becomes `exported_namespace` when the Prometheus operator scrapes
# KEDA without honorLabels.
KEDA_SCALER_ERRORS = "keda_scaler_detail_errors_total"
AUTOSCALER_ABSENT_FOR = "1m"  # KEDA reconnects within seconds of a restart; a minute without is an outage
KEDA_FALLBACK_FOR = "2m"  # several polling intervals past the ScaledObject's failureThreshold (3 x 15 s)
QUEUE_ABSENT_FOR_S = 300  # an unscraped queue is a broken setup, not a blip: a few scrapes' worth of patience


@dataclass(frozen=True, slots=True)
class Scope:
    """Which series an expression reads: label matchers (PromQL, without braces) for the engines' series and
    for the gateway's, whose `endpoint` label is "<namespace>/<name>"."""

    engines: str
    gateway: str

    def sel(self, metric: str, *extra: str) -> str:
        return f"{metric}{{{','.join(m for m in (self.engines, *extra) if m)}}}"

    def gw(self, metric: str, *extra: str) -> str:
        return f"{metric}{{{','.join(m for m in (self.gateway, *extra) if m)}}}"


ALL_ENDPOINTS = Scope(engines=f'{EP}!=""', gateway='endpoint!=""')


def endpoint_scope(ep: InferenceEndpoint) -> Scope:
    return Scope(engines=f'namespace="{ep.namespace}",{EP}="{ep.name}"', gateway=f'endpoint="{endpoint_key(ep)}"')


def recorded(name: str) -> str:
    return f"{LEVEL}:{name}"


# -- expressions ---------------------------------------------------------------------------------------------
def _rate(s: Scope, metric: str, w: str, *extra: str, by: str = BY) -> str:
    return f"sum by ({by}) (rate({s.sel(metric, *extra)}[{w}]))"


def goodput(s: Scope, w: str = WINDOW) -> str:
    """Completed requests per second that met every objective set."""
    return _rate(s, ENGINE_GOODPUT_METRIC, w)


def completed(s: Scope, w: str = WINDOW) -> str:
    """Completed requests per second checked against the SLO (the attainment's denominator)."""
    return _rate(s, ENGINE_SLO_CHECKED_METRIC, w)


def attainment(s: Scope, w: str = WINDOW) -> str:
    return f"{goodput(s, w)} / {completed(s, w)}"


def objective_attainment(s: Scope, w: str = WINDOW) -> str:
    """Attainment per objective (label `objective`: ttft, tpot): which one is missed."""
    met = _rate(s, ENGINE_SLO_MET_METRIC, w, by=f"{BY}, objective")
    return f"{met} / ignoring (objective) group_left {completed(s, w)}"


def quantile(s: Scope, histogram: str, q: str, w: str = WINDOW, by: str = BY) -> str:
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({s.sel(histogram + '_bucket')}[{w}])))"


def token_rate(s: Scope, kind: str, w: str = WINDOW) -> str:
    """Tokens per second; kind: prompt or generation."""
    return _rate(s, TOKENS[kind], w)


def billed_units(s: Scope) -> str:
    """What a replica is billed for per hour of the price: its GPUs, and a CPU replica (0 GPUs) as one unit, so
    that cost.gpuHourUSD on a CPU endpoint prices the replica-hour instead of coming out as 0."""
    return f"clamp_min({s.sel(ENGINE_GPUS_METRIC)}, 1)"


def cost_per_second(s: Scope, by: str = BY) -> str:
    """USD per second the endpoint's engines cost, serving and standby, busy or idle (docs/metrics.md)."""
    return f"sum by ({by}) ({billed_units(s)} * {s.sel(ENGINE_GPU_HOUR_USD_METRIC)}) / 3600"


def busy_share(s: Scope, phase: str, w: str = WINDOW) -> str:
    """The fraction of engine time spent on `phase` work (prefill or decode): the cost attribution."""
    busy, only = ENGINE_BUSY_SECONDS_METRIC, f'phase="{phase}"'
    return f"{_rate(s, busy, w, only)} / {_rate(s, busy, w)}"


def cost_per_million(s: Scope, kind: str, w: str = WINDOW) -> str:
    """USD per 1M tokens. kind prompt: the prefill share of the cost over the prompt tokens; generation: the
    decode share over the generation tokens; total: the whole cost over all tokens."""
    cost = f"({cost_per_second(s)})"
    if kind == "total":
        return f"{cost} / ({token_rate(s, 'prompt', w)} + {token_rate(s, 'generation', w)}) * 1e6"
    phase = {"prompt": "prefill", "generation": "decode"}[kind]
    return f"{cost} * ({busy_share(s, phase, w)}) / {token_rate(s, kind, w)} * 1e6"


def _with_engine_labels(expr: str) -> str:
    """A gateway expression keeping `endpoint` ("<namespace>/<name>"), with the engines' labels (namespace,
    sluice_dev_endpoint) taken from it, so that it joins the engines' series."""
    return (f'label_replace(label_replace({expr}, "namespace", "$1", "endpoint", "([^/]+)/.*"), '
            f'"{EP}", "$1", "endpoint", "[^/]+/(.*)")')


def _gateway_by_endpoint(s: Scope, metric: str, *extra: str) -> str:
    """A gateway gauge summed per endpoint, joinable with the engines' series."""
    return _with_engine_labels(f"sum by (endpoint) ({s.gw(metric, *extra)})")


def tenant_token_rate(s: Scope, w: str = WINDOW, token_type: str | None = None) -> str:
    """Tokens per second per tenant as the gateway counted them from the engines' usage (label `type`: prompt,
    completion; one type only when `token_type` is given)."""
    only = (f'type="{token_type}"',) if token_type else ()
    inner = f"sum by (endpoint, tenant, type) (rate({s.gw(GATEWAY_TENANT_TOKENS_METRIC, *only)}[{w}]))"
    return f"sum by ({BY}, tenant, type) ({_with_engine_labels(inner)})"


def tenant_cost_per_second(s: Scope, w: str = WINDOW) -> str:
    """USD per second per tenant: its prompt tokens at the endpoint's price per prompt token plus its completion
    tokens at the price per generation token (cost_per_million). The tenants of an endpoint add up to its cost
    when all its traffic comes through the gateway."""
    parts = []
    for token_type, kind in (("prompt", "prompt"), ("completion", "generation")):
        tokens = f"sum by ({BY}, tenant) ({tenant_token_rate(s, w, token_type)})"
        parts.append(f"({tokens} * on ({BY}) group_left () ({cost_per_million(s, kind, w)}) / 1e6)")
    return " + ".join(parts)


def tenant_limited_rate(s: Scope, w: str = WINDOW) -> str:
    """Requests per second refused with 429 for a tenant's limit, by tenant and limit (requests, tokens)."""
    inner = f"sum by (endpoint, tenant, limit) (rate({s.gw(GATEWAY_TENANT_LIMITED_METRIC)}[{w}]))"
    return f"sum by ({BY}, tenant, limit) ({_with_engine_labels(inner)})"


def queued(s: Scope) -> str:
    """Requests waiting: in the engines (serving and standby) plus those the gateway holds. The autoscaler's
    demand; either side may have no series (no pods at zero; no gateway), hence `or`, not `+`."""
    return (f"sum by ({BY}) ({s.sel(QUEUE_METRIC)} or "
            f"{_gateway_by_endpoint(s, GATEWAY_PENDING_METRIC)})")


def ready_replicas(s: Scope) -> str:
    """Ready backends as the gateway sees them (serving and standby); without the gateway's series, the
    engines Prometheus scrapes (an engine serves /metrics only once its model is loaded)."""
    ready = _gateway_by_endpoint(s, GATEWAY_BACKENDS_METRIC, 'state="ready"')
    return (f"sum by ({BY}) ({ready}) "
            f"or count by ({BY}) ({s.sel(ENGINE_REQUESTS_RUNNING_METRIC)})")


def engines_by_role(s: Scope) -> str:
    return f"count by ({BY}, {ROLE}) ({s.sel(ENGINE_GPUS_METRIC)})"


def no_ready_replica(s: Scope) -> str:
    return f"({queued(s)}) > 0 unless on ({BY}) (({ready_replicas(s)}) > 0)"


def keda_errors(ep: InferenceEndpoint, w: str = "2m") -> str:
    """Errors per second reading the endpoint's ScaledObject's triggers, per scaler (KEDA's own metric)."""
    def part(ns_label: str) -> str:
        matchers = f'{ns_label}="{ep.namespace}",scaledObject="{ep.name}",type="scaledobject"'
        return f"sum by (scaler) (rate({KEDA_SCALER_ERRORS}{{{matchers}}}[{w}]))"
    return f"({part('exported_namespace')} or {part('namespace')}) > 0"


# -- rules ---------------------------------------------------------------------------------------------------
def _record(name: str, expr: str, **labels: str) -> dict[str, Any]:
    rule: dict[str, Any] = {"record": recorded(name), "expr": expr}
    if labels:
        rule["labels"] = labels
    return rule


def recording_rules(s: Scope) -> list[dict[str, Any]]:
    w = WINDOW
    return [
        _record(f"goodput_requests:rate{w}", goodput(s)),
        _record(f"slo_requests:rate{w}", completed(s)),
        *(_record(f"slo_attainment:ratio_rate{aw}", attainment(s, aw)) for aw in ATTAINMENT_WINDOWS),
        _record(f"slo_objective_attainment:ratio_rate{w}", objective_attainment(s)),
        *(_record(f"{name}:quantile_rate{w}", quantile(s, histogram, q), quantile=q)
          for name, histogram in LATENCIES for q in QUANTILES),
        _record(f"prompt_tokens:rate{w}", token_rate(s, "prompt")),
        _record(f"generation_tokens:rate{w}", token_rate(s, "generation")),
        _record("requests_queued:sum", queued(s)),
        _record("engines:count", engines_by_role(s)),
        _record("gpu_cost_usd_per_second:sum", cost_per_second(s)),
        _record(f"engine_busy_prefill:ratio_rate{w}", busy_share(s, "prefill")),
        _record(f"cost_usd_per_1m_prompt_tokens:rate{w}", cost_per_million(s, "prompt")),
        _record(f"cost_usd_per_1m_generation_tokens:rate{w}", cost_per_million(s, "generation")),
        _record(f"cost_usd_per_1m_tokens:rate{w}", cost_per_million(s, "total")),
        _record(f"tenant_tokens:rate{w}", tenant_token_rate(s)),
        _record(f"tenant_cost_usd_per_second:rate{w}", tenant_cost_per_second(s)),
    ]


def duration(seconds: int) -> str:
    """Prometheus' duration: 600 -> 10m."""
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _num(x: float) -> str:
    return f"{x:.6g}"


WHO = "{{ $labels.namespace }}/{{ $labels.sluice_dev_endpoint }}"


def burn_alerts(s: Scope, target: float) -> list[dict[str, Any]]:
    budget = 1 - target
    out = []
    for name, rate, long, short, for_, severity in BURN_ALERTS:
        # NOTE: the error ratio is at most 1; below a target of ~93% (fast) or ~83% (slow) burn x budget
        # exceeds 1, and the alert then fires only when every request misses (hence >= and the cap).
        threshold = _num(min(rate * budget, 1.0))
        errors = [f"(1 - {recorded(f'slo_attainment:ratio_rate{w}')}{{{s.engines}}}) >= {threshold}"
                  for w in (long, short)]
        out.append({
            "alert": name,
            "expr": " and ".join(errors),
            "for": for_,
            "labels": {"severity": severity},
            "annotations": {
                "summary": f"{WHO} spends its SLO error budget {_num(rate)}x too fast",
                "description": (
                    f"{{{{ $value | humanizePercentage }}}} of completed requests missed the endpoint's latency "
                    f"objectives over the last {long} (and over {short}); the SLO target is {_num(target * 100)}% "
                    f"attainment, an error budget of {_num(budget * 100)}%. Which objective is missed: "
                    f"{recorded('slo_objective_attainment:ratio_rate5m')}."),
            },
        })
    return out


def no_ready_replica_alert(s: Scope, wait_s: int) -> dict[str, Any]:
    return {
        "alert": "SluiceNoReadyReplica",
        "expr": no_ready_replica(s),
        "for": duration(wait_s),
        "labels": {"severity": "critical"},
        "annotations": {
            "summary": f"{WHO} has requests waiting and no ready replica",
            "description": (
                f"{{{{ $value }}}} requests wait (held by the gateway or queued in engines) and no serving or "
                f"standby replica has been ready for {duration(wait_s)}, longer than a replica may take to load "
                "(startupGraceSeconds). See the endpoint's status: kubectl describe ie."),
        },
    }


def keda_fallback_alert(ep: InferenceEndpoint) -> dict[str, Any]:
    return {
        "alert": "SluiceKedaFallback",
        "expr": keda_errors(ep),
        "for": KEDA_FALLBACK_FOR,
        "labels": {"severity": "warning", "namespace": ep.namespace, EP: ep.name},
        "annotations": {
            # Static rule labels are not in $labels when annotations are rendered: name the endpoint here.
            "summary": f"KEDA cannot read {ep.namespace}/{ep.name}'s {{{{ $labels.scaler }}}} trigger: fallback "
                       "replicas",
            "description": (
                "KEDA's ScaledObject has failed to read a trigger for longer than its failureThreshold, so it "
                "holds the fallback replica count (scaling.onMetricsOutage) instead of following the queue. Check "
                "that Prometheus (the operator's SLUICE_PROMETHEUS_URL) and the gateway's scaler answer; the "
                "endpoint's AutoscalerFallback condition carries KEDA's message."),
        },
    }


def autoscaler_absent_alert(ep: InferenceEndpoint) -> dict[str, Any]:
    """Fires while KEDA holds no StreamIsActive stream to any gateway replica for the endpoint: KEDA's operator
    is down (or cannot reach the gateway's scaler), so the endpoint will not scale from zero, and not with its
    queue; what runs keeps serving. The gateway's gauge is 0, not absent, for an endpoint nobody watches."""
    key = f"{ep.namespace}/{ep.name}"
    return {
        "alert": "SluiceAutoscalerNotWatching",
        "expr": f'max by (endpoint) ({GATEWAY_SCALER_STREAMS_METRIC}{{endpoint="{key}"}}) == 0',
        "for": AUTOSCALER_ABSENT_FOR,
        "labels": {"severity": "critical" if ep.spec.scaling and ep.spec.scaling.min_replicas == 0 else "warning",
                   "namespace": ep.namespace, EP: ep.name},
        "annotations": {
            "summary": f"KEDA is not watching {key}: it will not scale (from zero or with the queue)",
            "description": (
                "No gateway replica has KEDA's StreamIsActive stream for this endpoint's ScaledObject: KEDA's "
                "operator is down or cannot reach the gateway's scaler (the operator's "
                "SLUICE_GATEWAY_SCALER_ADDRESS). Replicas that run keep serving; requests to an endpoint at zero "
                "are held until --hold-timeout. Check KEDA's operator and the ScaledObject's Ready condition."),
        },
    }


def queue_absent_alert(ep: InferenceEndpoint, gateway: bool) -> dict[str, Any] | None:
    """Fires while the endpoint's queue cannot be read: KEDA's own query (autoscaled) or the engines' queue
    (a fixed count). Absent means Prometheus does not scrape the series, typically a ServiceMonitor its
    serviceMonitorSelector does not pick (SLUICE_MONITORING_LABELS). None for a fixed count of zero.

    With a gateway the query reads 0 while no backend is ready, so the wait is short; without one the
    engines report nothing until the model is loaded, so the wait is startupGraceSeconds."""
    scaling = ep.spec.scaling
    if scaling is None and ep.spec.fixed_replicas == 0:
        return None
    expr = queue_query(ep, gateway) if scaling is not None else engines_waiting(ep)
    wait = QUEUE_ABSENT_FOR_S if scaling is not None and gateway else max(QUEUE_ABSENT_FOR_S,
                                                                          ep.spec.startup_grace_seconds)
    consequence = ("KEDA counts every read as a failure and holds the fallback replicas "
                   "(scaling.onMetricsOutage) instead of following the queue" if scaling is not None else
                   "the dashboards and the no-ready-replica alert are blind to its queue")
    return {
        "alert": "SluiceQueueMetricAbsent",
        "expr": f"absent({expr})",
        "for": duration(wait),
        "labels": {"severity": "warning", "namespace": ep.namespace, EP: ep.name},
        "annotations": {
            "summary": f"{ep.namespace}/{ep.name}'s queue metric is missing from Prometheus",
            "description": (
                f"Prometheus has no series for the endpoint's queue ({QUEUE_METRIC}"
                + (f" and the gateway's {GATEWAY_PENDING_METRIC}" if scaling is not None and gateway else "")
                + f"), so {consequence}. Check that Prometheus selects the endpoint's ServiceMonitor"
                + (" and the gateway's" if scaling is not None and gateway else "")
                + " (kube-prometheus-stack: the label `release: <its release>`, the chart's monitoring.labels) "
                  "and that the targets are up."),
        },
    }


def slo_target(ep: InferenceEndpoint) -> float:
    slo = ep.spec.slo
    return slo.target if slo is not None and slo.target is not None else DEFAULT_SLO_TARGET


def endpoint_groups(ep: InferenceEndpoint, gateway: bool = True) -> list[dict[str, Any]]:
    """One group: rules in a group run in order, so the alerts read this evaluation's recorded series.
    `gateway`: whether the operator has one (the autoscaler's query, and so its absence, depend on it)."""
    s = endpoint_scope(ep)
    alerts = [*burn_alerts(s, slo_target(ep)), no_ready_replica_alert(s, ep.spec.startup_grace_seconds)]
    if ep.spec.scaling is not None:
        alerts.append(keda_fallback_alert(ep))
        if gateway:
            alerts.append(autoscaler_absent_alert(ep))
    absent = queue_absent_alert(ep, gateway)
    if absent is not None:
        alerts.append(absent)
    return [{"name": f"sluice.endpoint.{ep.namespace}.{ep.name}", "rules": recording_rules(s) + alerts}]


def prometheus_rule(ep: InferenceEndpoint, cfg: OperatorConfig | None = None) -> dict[str, Any]:
    cfg = cfg or OperatorConfig()
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": monitoring_meta(ep, cfg),
        "spec": {"groups": endpoint_groups(ep, gateway=bool(cfg.gateway_scaler_address))},
    }


def generic_groups() -> list[dict[str, Any]]:
    """Every endpoint at once, with the default SLO target and startupGraceSeconds; no KEDA alert (KEDA's
    series cannot tell Sluice's ScaledObjects from others)."""
    s = ALL_ENDPOINTS
    alerts = [*burn_alerts(s, DEFAULT_SLO_TARGET), no_ready_replica_alert(s, DEFAULT_NO_READY_FOR_S)]
    return [{"name": "sluice.endpoints", "rules": recording_rules(s) + alerts}]


GENERIC_HEADER = """\
# Generated by `python -m sluice_operator.monitoring` (operator/sluice_operator/monitoring.py); do not edit.
# Sluice's recording rules and alerts for every InferenceEndpoint at once, as a Prometheus rule file. The chart
# wraps it in a PrometheusRule (monitoring.rules.enabled); docs/metrics.md describes each rule.
"""


def generic_rule_file() -> str:
    return GENERIC_HEADER + yaml.safe_dump({"groups": generic_groups()}, sort_keys=False, width=1000)


if __name__ == "__main__":
    sys.stdout.write(generic_rule_file())
