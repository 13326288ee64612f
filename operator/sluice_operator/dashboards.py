"""Grafana dashboards for Sluice endpoints, generated from the PromQL in monitoring.py.

`python -m sluice_operator.dashboards charts/sluice/dashboards` writes one JSON file per dashboard; the chart
ships them as ConfigMaps for Grafana's dashboard sidecar (monitoring.dashboards.enabled), and a test fails
while the files are stale. The panels query the engines' and the gateway's own series (not the recording
rules), so they work with or without the rules installed, at any zoom ($__rate_interval).

- `sluice-endpoint`: one endpoint (variables namespace, endpoint): goodput and SLO attainment, latency
  percentiles, throughput, queue depth and replicas (serving, standby, held requests), KV usage and prefix
  hit rate, cost per 1M tokens.
- `sluice-overview`: every endpoint of the chosen namespaces side by side.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice_contract import (
    ENGINE_BUSY_SECONDS_METRIC,
    ENGINE_E2E_LATENCY_METRIC,
    ENGINE_FINISHED_REQUESTS_METRIC,
    ENGINE_GPU_HOUR_USD_METRIC,
    ENGINE_GPUS_METRIC,
    ENGINE_ITERATION_TOKENS_METRIC,
    ENGINE_ITL_METRIC,
    ENGINE_KV_CACHE_USAGE_METRIC,
    ENGINE_PREEMPTIONS_METRIC,
    ENGINE_PREFILL_TIME_METRIC,
    ENGINE_PREFIX_CACHE_HITS_METRIC,
    ENGINE_PREFIX_CACHE_QUERIES_METRIC,
    ENGINE_QUEUE_TIME_METRIC,
    ENGINE_REQUESTS_RUNNING_METRIC,
    ENGINE_REQUESTS_WAITING_METRIC,
    ENGINE_SLO_TPOT_METRIC,
    ENGINE_SLO_TTFT_METRIC,
    ENGINE_TPOT_METRIC,
    ENGINE_TTFT_METRIC,
    GATEWAY_BACKENDS_METRIC,
    GATEWAY_INFLIGHT_METRIC,
    GATEWAY_PENDING_METRIC,
    GATEWAY_STANDBY_REQUESTS_METRIC,
)

from . import monitoring as m
from .monitoring import EP, ROLE, Scope

W = "$__rate_interval"  # Grafana's: at least four scrape intervals, growing with the zoom
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
ENDPOINT = Scope(engines=f'namespace="$namespace",{EP}="$endpoint"', gateway='endpoint="$namespace/$endpoint"')
# Multi-value variables expand to (a|b) in a regex matcher.
NAMESPACES = Scope(engines=f'namespace=~"$namespace",{EP}!=""', gateway='endpoint=~"$namespace/.*"')
WHO = f"{{{{namespace}}}}/{{{{{EP}}}}}"  # legend: namespace/endpoint
PANEL_HEIGHT = 8


# -- building blocks -----------------------------------------------------------------------------------------
def target(expr: str, legend: str) -> dict[str, Any]:
    return {"expr": expr, "legendFormat": legend}


def _fields(unit: str, lo: float | None, hi: float | None) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": unit}
    if lo is not None:
        defaults["min"] = lo
    if hi is not None:
        defaults["max"] = hi
    return {"defaults": defaults, "overrides": []}


def timeseries(title: str, description: str, targets: list[dict[str, Any]], unit: str, *, width: int = 8,
               lo: float | None = 0, hi: float | None = None) -> dict[str, Any]:
    return {
        "type": "timeseries", "title": title, "description": description, "datasource": DATASOURCE,
        "targets": targets, "fieldConfig": _fields(unit, lo, hi),
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "gridPos": {"w": width, "h": PANEL_HEIGHT},
    }


def stat(title: str, description: str, expr: str, unit: str, *, width: int = 4) -> dict[str, Any]:
    return {
        "type": "stat", "title": title, "description": description, "datasource": DATASOURCE,
        "targets": [target(expr, title)], "fieldConfig": _fields(unit, None, None),
        "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "colorMode": "value", "graphMode": "area", "textMode": "value"},
        "gridPos": {"w": width, "h": 4},
    }


def row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "gridPos": {"w": 24, "h": 1}}


def _layout(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Place panels left to right, wrapping at Grafana's 24 columns; ids and refIds in order."""
    x = y = row_height = 0
    for i, panel in enumerate(panels, start=1):
        pos = panel["gridPos"]
        if panel["type"] == "row" or x + pos["w"] > 24:
            x, y, row_height = 0, y + row_height, 0
        pos["x"], pos["y"] = x, y
        x += pos["w"]
        row_height = max(row_height, pos["h"])
        panel["id"] = i
        for n, t in enumerate(panel.get("targets", [])):
            t["refId"] = chr(ord("A") + n)
            t["datasource"] = DATASOURCE
            t["range"] = True
    return panels


def variable(name: str, label: str, query: str, *, multi: bool = False) -> dict[str, Any]:
    return {
        "name": name, "label": label, "type": "query", "datasource": DATASOURCE,
        "query": {"query": query, "refId": f"{name}-variable"}, "definition": query,
        "refresh": 2,  # on time range change: endpoints that existed in the range, even if scaled to zero now
        "sort": 1, "multi": multi, "includeAll": multi, "current": {}, "hide": 0, "regex": "", "options": [],
    }


DATASOURCE_VARIABLE = {"name": "datasource", "label": "Data Source", "type": "datasource", "query": "prometheus",
                       "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": []}


@dataclass(slots=True)
class Dashboard:
    uid: str
    title: str
    description: str
    variables: list[dict[str, Any]]
    panels: list[dict[str, Any]] = field(default_factory=list)

    def json(self) -> dict[str, Any]:
        return {
            "uid": self.uid, "title": self.title, "description": self.description,
            "tags": ["sluice", "llm-inference"], "editable": False, "graphTooltip": 1, "timezone": "",
            "time": {"from": "now-3h", "to": "now"}, "refresh": "30s", "schemaVersion": 39, "version": 1,
            "annotations": {"list": []},
            "links": [{"type": "dashboards", "tags": ["sluice"], "asDropdown": True, "title": "Sluice",
                       "includeVars": True, "keepTime": True}],
            "templating": {"list": [DATASOURCE_VARIABLE, *self.variables]},
            "panels": _layout(self.panels),
        }


# -- the dashboards ------------------------------------------------------------------------------------------
def _quantiles(s: Scope, histogram: str) -> list[dict[str, Any]]:
    return [target(m.quantile(s, histogram, q, W), f"p{round(float(q) * 100)}") for q in m.QUANTILES]


def _mean_by_pod(s: Scope, histogram: str) -> str:
    """A histogram's mean per replica over the window: the rate of its sum over the rate of its count."""
    return (f"sum by (pod) (rate({s.sel(histogram + '_sum')}[{W}])) / "
            f"sum by (pod) (rate({s.sel(histogram + '_count')}[{W}]))")


def endpoint_dashboard() -> Dashboard:
    s = ENDPOINT
    objective = "max({}) > 0"  # an SLO gauge, drawn only where the objective is set
    d = Dashboard("sluice-endpoint", "Sluice / Endpoint", (
        "One InferenceEndpoint: goodput against its SLO, latency percentiles, throughput, queue and replicas, "
        "KV and prefix cache, cost per 1M tokens. Definitions: docs/metrics.md."),
        [variable("namespace", "Namespace", f"label_values({ENGINE_GPUS_METRIC}, namespace)"),
         variable("endpoint", "Endpoint", f'label_values({ENGINE_GPUS_METRIC}{{namespace="$namespace"}}, {EP})')])
    d.panels = [
        row("Goodput and SLO"),
        stat("Goodput", "Completed requests per second that met every objective set.", m.goodput(s, W), "reqps"),
        stat("SLO attainment", "Goodput / completed requests.", m.attainment(s, W), "percentunit"),
        stat("Generation tokens/s", "Output tokens per second, all replicas.", m.token_rate(s, "generation", W),
             "short"),
        stat("Waiting requests", "Queued in the engines plus held by the gateway.", m.queued(s), "short"),
        stat("USD per 1M generation tokens", "The decode share of the GPU cost over the generation tokens.",
             m.cost_per_million(s, "generation", W), "currencyUSD"),
        stat("USD per hour", "GPU cost of serving and standby replicas, busy or idle.",
             f"{m.cost_per_second(s)} * 3600", "currencyUSD"),
        timeseries("Goodput and finished requests", "Goodput against completed requests, and every finished "
                   "request by reason (stop, length, abort, error).", [
                       target(m.goodput(s, W), "goodput"),
                       target(m.completed(s, W), "completed"),
                       target(f"sum by (finished_reason) (rate({s.sel(ENGINE_FINISHED_REQUESTS_METRIC)}[{W}]))",
                              "finished: {{finished_reason}}")], "reqps", width=12),
        timeseries("SLO attainment", "The fraction of completed requests that met the SLO, overall and per "
                   "objective (an objective that is not set is met trivially).", [
                       target(m.attainment(s, W), "all objectives"),
                       target(m.objective_attainment(s, W), "{{objective}}")], "percentunit", width=12, hi=1),
        row("Latency"),
        timeseries("Time to first token", "TTFT percentiles (arrival to first token) and the objective.", [
            *_quantiles(s, ENGINE_TTFT_METRIC),
            target(objective.format(s.sel(ENGINE_SLO_TTFT_METRIC)), "objective")], "s"),
        timeseries("Time per output token", "TPOT percentiles per completed request (vLLM's: first token "
                   "excluded) and the objective.", [
                       *_quantiles(s, ENGINE_TPOT_METRIC),
                       target(objective.format(s.sel(ENGINE_SLO_TPOT_METRIC)), "objective")], "s"),
        timeseries("Inter-token latency", "Time between a request's successive output steps.",
                   _quantiles(s, ENGINE_ITL_METRIC), "s"),
        timeseries("End-to-end latency", "Arrival to last token, completed requests.",
                   _quantiles(s, ENGINE_E2E_LATENCY_METRIC), "s"),
        timeseries("Queue time", "Arrival to first scheduled, completed requests.",
                   _quantiles(s, ENGINE_QUEUE_TIME_METRIC), "s"),
        timeseries("Prefill time", "First scheduled to first token, completed requests.",
                   _quantiles(s, ENGINE_PREFILL_TIME_METRIC), "s"),
        row("Throughput"),
        timeseries("Tokens per second", "Prompt tokens (prefix-cache hits included) and generated tokens.", [
            target(m.token_rate(s, "prompt", W), "prompt"),
            target(m.token_rate(s, "generation", W), "generation")], "short"),
        timeseries("Tokens per engine step", "Mean tokens computed per step, per replica: how full the batches "
                   "are.", [target(_mean_by_pod(s, ENGINE_ITERATION_TOKENS_METRIC), "{{pod}}")],
                   "short"),
        timeseries("Engine busy time", "Seconds per second each replica spends in engine steps, by phase (the "
                   "basis of the cost split).", [
                       target(f"sum by (pod, phase) (rate({s.sel(ENGINE_BUSY_SECONDS_METRIC)}[{W}]))",
                              "{{pod}} {{phase}}")], "percentunit"),
        row("Queue and replicas"),
        timeseries("Requests", "Running and waiting in the engines; held (no ready backend) and in flight at the "
                   "gateway.", [
                       target(f"sum({s.sel(ENGINE_REQUESTS_RUNNING_METRIC)})", "running"),
                       target(f"sum({s.sel(ENGINE_REQUESTS_WAITING_METRIC)})", "waiting in engines"),
                       target(f"sum({s.gw(GATEWAY_PENDING_METRIC)})", "held by the gateway"),
                       target(f"sum({s.gw(GATEWAY_INFLIGHT_METRIC)})", "in flight at the gateway")],
                   "short"),
        timeseries("Replicas", "Backends as the gateway sees them (by role and readiness), and engines "
                   "Prometheus scrapes (by role).", [
                       target(f"sum by (role, state) ({s.gw(GATEWAY_BACKENDS_METRIC)})",
                              "{{role}} {{state}} (gateway)"),
                       target(f"count by ({ROLE}) ({s.sel(ENGINE_GPUS_METRIC)})", f"{{{{{ROLE}}}}} (scraped)")],
                   "short"),
        timeseries("Preemptions and warm-pool requests", "Requests preempted by recompute, and requests the "
                   "gateway sent to the warm pool.", [
                       target(f"sum(rate({s.sel(ENGINE_PREEMPTIONS_METRIC)}[{W}]))", "preemptions"),
                       target(f"sum(rate({s.gw(GATEWAY_STANDBY_REQUESTS_METRIC)}[{W}]))",
                              "sent to standby")], "reqps"),
        row("KV cache and prefix cache"),
        timeseries("KV cache usage", "Fraction of KV blocks held by requests, per replica.", [
            target(f"max by (pod) ({s.sel(ENGINE_KV_CACHE_USAGE_METRIC)})", "{{pod}}")], "percentunit", width=12,
            hi=1),
        timeseries("Prefix cache hit rate", "Prompt tokens served from the prefix cache / prompt tokens looked "
                   "up.", [target(f"sum(rate({s.sel(ENGINE_PREFIX_CACHE_HITS_METRIC)}[{W}])) / "
                                  f"sum(rate({s.sel(ENGINE_PREFIX_CACHE_QUERIES_METRIC)}[{W}]))", "hit rate")],
                   "percentunit", width=12, hi=1),
        row("Prefill/decode disaggregation (spec.disaggregation)"),
        timeseries("TTFT by pool", "TTFT percentiles per pool: on the prefill pool (role prefill) the prompt's "
                   "computation; on the decode pool (role serving) what clients see, the hop included.", [
                       target(m.quantile(s, ENGINE_TTFT_METRIC, q, W, by=ROLE), f"{{{{{ROLE}}}}} p{round(float(q) * 100)}")
                       for q in ("0.5", "0.99")], "s"),
        timeseries("TPOT by pool", "TPOT percentiles per pool: the decode pool's is the endpoint's.", [
            target(m.quantile(s, ENGINE_TPOT_METRIC, q, W, by=ROLE), f"{{{{{ROLE}}}}} p{round(float(q) * 100)}")
            for q in ("0.5", "0.99")], "s"),
        timeseries("Prefill backlog and hops", "Prompt tokens not computed yet per pool (what scales the prefill "
                   "pool), and the decode engines' prefill hops by outcome (failed: computed by the decode "
                   "engine itself).", [
                       target(f"sum by ({ROLE}) ({s.sel('sluice_num_prompt_tokens_waiting')})",
                              f"{{{{{ROLE}}}}} prompt tokens waiting"),
                       target(f"sum by (outcome) (rate({s.sel('sluice_kv_prefill_hops_total')}[{W}]))",
                              "hops {{outcome}}/s"),
                       target(f"sum by (result) (rate({s.sel('sluice_kv_pushes_total')}[{W}]))",
                              "KV pushes {{result}}/s")], "short"),
        row("Cost"),
        timeseries("USD per 1M tokens", "GPU cost (serving and standby, idle included) split between prompt and "
                   "generation tokens by engine time; gaps: no traffic.", [
                       target(m.cost_per_million(s, "prompt", W), "prompt"),
                       target(m.cost_per_million(s, "generation", W), "generation"),
                       target(m.cost_per_million(s, "total", W), "all tokens")], "currencyUSD"),
        timeseries("USD per hour by role", "What the replicas cost, serving and standby.", [
            target(f"sum by ({ROLE}) ({m.billed_units(s)} * {s.sel(ENGINE_GPU_HOUR_USD_METRIC)})",
                   f"{{{{{ROLE}}}}}")], "currencyUSD"),
        timeseries("GPUs by role", "Accelerators the replicas hold.", [
            target(f"sum by ({ROLE}) ({s.sel(ENGINE_GPUS_METRIC)})", f"{{{{{ROLE}}}}}")], "short"),
        row("Tenants (the gateway's API keys file)"),
        timeseries("USD per hour by tenant", "Each tenant's prompt and completion tokens at the endpoint's price "
                   "per token (the cost rows above); 'none': requests no tenant's key carried.", [
                       target(f"sum by (tenant) ({m.tenant_cost_per_second(s, W)}) * 3600", "{{tenant}}")],
                   "currencyUSD"),
        timeseries("Tokens/s by tenant", "Prompt and completion tokens per second, from the engines' usage as the "
                   "gateway counted it.", [
                       target(f"sum by (tenant, type) ({m.tenant_token_rate(s, W)})", "{{tenant}} {{type}}")],
                   "short"),
        timeseries("Rate-limited requests/s by tenant", "429s for a tenant's requests or tokens per minute limit.",
                   [target(f"sum by (tenant, limit) ({m.tenant_limited_rate(s, W)})", "{{tenant}} {{limit}}")],
                   "reqps"),
    ]
    return d


def overview_dashboard() -> Dashboard:
    s = NAMESPACES
    d = Dashboard("sluice-overview", "Sluice / Overview", (
        "Every InferenceEndpoint of the chosen namespaces side by side. Definitions: docs/metrics.md."),
        [variable("namespace", "Namespace", f"label_values({ENGINE_GPUS_METRIC}, namespace)", multi=True)])
    d.panels = [
        timeseries("Goodput", "Completed requests per second that met their SLO.", [target(m.goodput(s, W), WHO)],
                   "reqps"),
        timeseries("SLO attainment", "Goodput / completed requests.", [target(m.attainment(s, W), WHO)],
                   "percentunit", hi=1),
        timeseries("TTFT p99", "Time to first token, 99th percentile.",
                   [target(m.quantile(s, ENGINE_TTFT_METRIC, "0.99", W), WHO)], "s"),
        timeseries("Generation tokens per second", "Output tokens per second.",
                   [target(m.token_rate(s, "generation", W), WHO)], "short"),
        timeseries("Waiting requests", "Queued in the engines plus held by the gateway.",
                   [target(m.queued(s), WHO)], "short"),
        timeseries("Replicas", "Engines Prometheus scrapes, by role.",
                   [target(m.engines_by_role(s), f"{WHO} {{{{{ROLE}}}}}")], "short"),
        timeseries("USD per 1M generation tokens", "The decode share of the GPU cost over the generation "
                   "tokens.", [target(m.cost_per_million(s, "generation", W), WHO)], "currencyUSD"),
        timeseries("USD per 1M prompt tokens", "The prefill share of the GPU cost over the prompt tokens.",
                   [target(m.cost_per_million(s, "prompt", W), WHO)], "currencyUSD"),
        timeseries("USD per hour", "GPU cost of serving and standby replicas, busy or idle.",
                   [target(f"{m.cost_per_second(s)} * 3600", WHO)], "currencyUSD"),
    ]
    return d


def dashboards() -> dict[str, dict[str, Any]]:
    """File name -> dashboard JSON."""
    return {f"{d.uid}.json": d.json() for d in (endpoint_dashboard(), overview_dashboard())}


def render(dashboard: dict[str, Any]) -> str:
    return json.dumps(dashboard, indent=1) + "\n"


def write(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, dashboard in dashboards().items():
        path = directory / name
        path.write_text(render(dashboard))
        paths.append(path)
    return paths


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m sluice_operator.dashboards DIRECTORY  (charts/sluice/dashboards)")
    for p in write(Path(sys.argv[1])):
        print(p)
