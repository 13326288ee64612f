"""Prometheus rules and Grafana dashboards (operator/sluice_operator/monitoring.py and dashboards.py, and the
chart's generated copies):

- `promtool check rules` on every example's PrometheusRule and on the chart's rule file;
- `promtool test rules`: input series in, recorded series and alerts out (goodput, SLO attainment, latency
  quantiles, cost per 1M tokens with and without standby replicas, burn rate, no ready replica, KEDA fallback);
- every PromQL expression in rules and dashboards parses, and names only metrics that exist: the engine's, the
  gateway's, KEDA's or a recording rule's;
- the generated files are fresh; the chart renders the PrometheusRule and the dashboard ConfigMaps;
- a live Prometheus on loopback scrapes a running `sluice serve` with the endpoint's rules, and the goodput and
  cost series are read back through its HTTP API (slow).

promtool and prometheus come from scripts/get-promtool.sh (Debian's prometheus package, unpacked into
.tools/bin); scripts/test.sh runs it first. Where it cannot fetch them these tests skip and say why, except
under CI (CI set), where they fail.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from functools import cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import httpx
import kubernetes_validate
import promql_parser
import pytest
import yaml
from helm import CHART, RELEASE, RELEASE_NS, run_helm
from operator_schemas import EXAMPLES, crd_schema, load_yaml, reference_crd, schema_errors
from servers import free_port

from sluice_operator import autoscaling, dashboards, monitoring
from sluice_operator.config import OperatorConfig
from sluice_operator.reconcile import reconcile
from sluice_operator.spec import parse_endpoint

ROOT = Path(__file__).parents[2]
RULE_FILE = CHART / "rules" / "sluice.rules.yaml"
DASHBOARD_DIR = CHART / "dashboards"
KEDA_METRICS = {monitoring.KEDA_SCALER_ERRORS}
GRAFANA_VARIABLES = {"$__rate_interval": "5m"}  # what Grafana substitutes before PromQL is parsed


# -- tools -----------------------------------------------------------------------------------------------------
def _find(tool: str) -> str | None:
    local = ROOT / ".tools" / "bin" / tool
    return str(local) if os.access(local, os.X_OK) else shutil.which(tool)


@pytest.fixture(scope="session")
def prom_tools() -> dict[str, str]:
    """Paths of promtool and prometheus."""
    found = {t: _find(t) for t in ("promtool", "prometheus")}
    if None in found.values():  # pytest run directly, without scripts/test.sh: try once to fetch them
        subprocess.run(["bash", str(ROOT / "scripts" / "get-promtool.sh")], cwd=ROOT, timeout=600, check=False)
        found = {t: _find(t) for t in found}
    missing = [t for t, path in found.items() if path is None]
    if missing:
        why = (f"{' and '.join(missing)} not found in .tools/bin or on PATH, and scripts/get-promtool.sh could "
               "not fetch them (it needs apt-get and the Debian registry)")
        if os.environ.get("CI"):
            pytest.fail(why + "; under CI the rule tests must run")
        pytest.skip(why + "; Prometheus rule tests skipped")
    return found  # type: ignore[return-value]


@pytest.fixture(scope="session")
def promtool(prom_tools: dict[str, str]) -> str:
    return prom_tools["promtool"]


def endpoint(name: str, **spec_changes: Any) -> Any:
    doc = load_yaml(next(p for p in EXAMPLES if p.name == name))
    doc["spec"].update(spec_changes)
    return parse_endpoint(doc)


def rule_file(groups: list[dict[str, Any]], path: Path) -> Path:
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


# -- generated files -------------------------------------------------------------------------------------------
def test_chart_rule_file_is_fresh() -> None:
    assert RULE_FILE.read_text() == monitoring.generic_rule_file(), (
        f"{RULE_FILE.relative_to(ROOT)} is stale; regenerate it with\n"
        f"  python -m sluice_operator.monitoring > {RULE_FILE.relative_to(ROOT)}")


def test_dashboards_are_fresh() -> None:
    want = {name: dashboards.render(d) for name, d in dashboards.dashboards().items()}
    have = {p.name: p.read_text() for p in DASHBOARD_DIR.glob("*.json")}
    assert have == want, (f"{DASHBOARD_DIR.relative_to(ROOT)} is stale; regenerate it with\n"
                          f"  python -m sluice_operator.dashboards {DASHBOARD_DIR.relative_to(ROOT)}")


# -- the PrometheusRule ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_endpoint_gets_a_scoped_prometheus_rule(path: Path) -> None:
    ep = parse_endpoint(load_yaml(path))
    (rule,) = [m for m in reconcile(ep) if m["kind"] == "PrometheusRule"]
    assert schema_errors(crd_schema(reference_crd("monitoring.coreos.com_prometheusrules.yaml"), "v1"), rule) == []
    (group,) = rule["spec"]["groups"]
    names = [r.get("record") or r["alert"] for r in group["rules"]]
    assert len(set(zip(names, [json.dumps(r.get("labels")) for r in group["rules"]], strict=True))) == len(names)
    alerts = {r["alert"] for r in group["rules"] if "alert" in r}
    expected = {"SluiceSLOBurnRateFast", "SluiceSLOBurnRateSlow", "SluiceNoReadyReplica", "SluiceQueueMetricAbsent"}
    assert alerts == expected | ({"SluiceKedaFallback", "SluiceAutoscalerNotWatching"} if ep.spec.scaling else set())
    for r in group["rules"]:  # every engine selector is scoped to this endpoint
        for selector in _selectors(r["expr"]):
            if selector.name.startswith("sluice_gateway_"):
                assert _matchers(selector)["endpoint"] == ("=", f"{ep.namespace}/{ep.name}"), r["expr"]
            elif selector.name.startswith(("sluice_", monitoring.LEVEL)):
                assert _matchers(selector)["namespace"] == ("=", ep.namespace), r["expr"]
                assert _matchers(selector)["sluice_dev_endpoint"] == ("=", ep.name), r["expr"]
            else:
                assert _matchers(selector)["scaledObject"] == ("=", ep.name), r["expr"]


def test_rules_can_be_left_to_the_chart() -> None:
    ep = endpoint("gpu-8b.yaml")
    assert "PrometheusRule" not in {m["kind"] for m in reconcile(ep, OperatorConfig(endpoint_rules=False))}
    assert OperatorConfig.from_env({"SLUICE_ENDPOINT_RULES": "false"}).endpoint_rules is False
    assert OperatorConfig.from_env({"SLUICE_ENDPOINT_RULES": "true"}) == OperatorConfig()
    with pytest.raises(ValueError, match="SLUICE_ENDPOINT_RULES"):
        OperatorConfig.from_env({"SLUICE_ENDPOINT_RULES": "maybe"})


def test_the_service_monitor_labels_series_by_endpoint_and_role() -> None:
    (monitor,) = [m for m in reconcile(endpoint("scale-to-zero.yaml")) if m["kind"] == "ServiceMonitor"]
    # -> sluice_dev_endpoint and sluice_dev_role: what every rule selects and groups by
    assert monitor["spec"]["targetLabels"] == ["sluice.dev/endpoint", "sluice.dev/role"]


def _rule_files(tmp_path: Path) -> list[Path]:
    files = [rule_file(monitoring.endpoint_groups(parse_endpoint(load_yaml(p))), tmp_path / p.name)
             for p in EXAMPLES]
    return [*files, RULE_FILE]


def test_promtool_check_rules(promtool: str, tmp_path: Path) -> None:
    files = _rule_files(tmp_path)
    proc = subprocess.run([promtool, "check", "rules", *map(str, files)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("SUCCESS") == len(files), proc.stdout


# -- PromQL: parses, and names only metrics that exist ---------------------------------------------------------
def _exposed(registry: Any) -> dict[str, set[str]]:
    """Series names a prometheus_client registry exposes -> their label names (from the families, so metrics
    with no sample yet count too)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    out: dict[str, set[str]] = {}
    for family in registry.collect():
        labels = {k for s in family.samples for k in s.labels} | ({"le"} if family.type == "histogram" else set())
        for suffix in suffixes[family.type]:
            out[family.name + suffix] = labels - ({"le"} if suffix != "_bucket" else set())
    return out


@cache
def engine_metrics() -> dict[str, set[str]]:
    """The engine's /metrics, from its collector in process (an engine stand-in; real EngineMetrics)."""
    from sluice_engine.metrics import EngineMetrics, PrometheusExporter, StatsSnapshot

    engine = MagicMock()
    engine.served_model_name, engine.cfg.endpoint_label, engine.metrics = "m", None, EngineMetrics()
    # With the series a disaggregated endpoint's engines export too: KV pushes (exported once there is one) and
    # the decode engines' prefill hops (--prefill-url).
    engine.stats_snapshot.return_value = dataclasses.replace(StatsSnapshot.zero(), kv_pushes={"ok": 0})
    return _exposed(PrometheusExporter(engine, prefill_hops={}).registry)


@cache
def gateway_metrics() -> set[str]:
    from sluice_autoscaler.metrics import GatewayMetrics

    return set(_exposed(GatewayMetrics(MagicMock(), MagicMock()).prom))


def recorded_names() -> set[str]:
    return {r["record"] for r in monitoring.generic_groups()[0]["rules"] if "record" in r}


# Labels Prometheus attaches to the engines' series: the ServiceMonitor's target labels and its own.
TARGET_LABELS = {"namespace", "sluice_dev_endpoint", "sluice_dev_role", "pod", "instance", "job", "service"}


def _selectors(expr: str) -> list[Any]:
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    found: list[Any] = []

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)  # raises ValueError on a syntax error
    return found


def _matchers(selector: Any) -> dict[str, tuple[str, str]]:
    ops = {"MatchOp.Equal": "=", "MatchOp.NotEqual": "!=", "MatchOp.Re": "=~", "MatchOp.NotRe": "!~"}
    return {m.name: (ops.get(str(m.op), str(m.op)), m.value) for m in selector.matchers.matchers}


def all_expressions() -> list[tuple[str, str]]:
    """(where, PromQL) for every expression in the rules (every example, the chart's file) and dashboards."""
    out = []
    for path in EXAMPLES:
        for r in monitoring.endpoint_groups(parse_endpoint(load_yaml(path)))[0]["rules"]:
            out.append((f"{path.name}: {r.get('record') or r['alert']}", r["expr"]))
    for r in yaml.safe_load(RULE_FILE.read_text())["groups"][0]["rules"]:
        out.append((f"{RULE_FILE.name}: {r.get('record') or r['alert']}", r["expr"]))
    for name, d in dashboards.dashboards().items():
        for panel in d["panels"]:
            for t in panel.get("targets", []):
                out.append((f"{name}: {panel['title']} {t['refId']}", t["expr"]))
        for var in d["templating"]["list"]:
            if var["type"] == "query":  # label_values(SELECTOR, label): the selector is PromQL
                selector = re.fullmatch(r"label_values\((.*), *\w+\)", var["definition"])
                assert selector, var["definition"]
                out.append((f"{name}: variable {var['name']}", selector[1]))
    return out


def test_every_expression_parses_and_every_metric_exists() -> None:
    engine, gateway, rules = engine_metrics(), gateway_metrics(), recorded_names()
    known = set(engine) | gateway | rules | KEDA_METRICS
    used: set[str] = set()
    for where, expr in all_expressions():
        try:
            selectors = _selectors(expr)
        except ValueError as e:
            pytest.fail(f"{where}: {e}\n{expr}")
        assert selectors, f"{where}: no metric\n{expr}"
        for selector in selectors:
            assert selector.name in known, f"{where}: {selector.name} is no engine, gateway, KEDA or rule metric"
            used.add(selector.name)
            if selector.name in engine:  # label matchers name labels the series carry
                unknown = set(_matchers(selector)) - engine[selector.name] - TARGET_LABELS
                assert not unknown, f"{where}: {selector.name} has no label {unknown}"
    # The panels cover what the issue asks for (and the rules use the cost inputs).
    for name in ("sluice_request_goodput_total", "sluice_kv_cache_usage_perc", "sluice_prefix_cache_hits_total",
                 "sluice_gateway_pending_requests", "sluice_gpu_hour_usd", "sluice_engine_busy_seconds_total"):
        assert name in used, name


def test_the_contract_names_series_the_engine_and_the_gateway_export() -> None:
    """sluice_contract's metric names are what the operator's queries read; the engine keeps its own literals
    (sluice_engine/metrics.py), so this is where the two meet."""
    import sluice_contract

    names = {k: v for k, v in vars(sluice_contract).items() if k.endswith("_METRIC")}
    engine, gateway = set(engine_metrics()), gateway_metrics()
    for constant, name in names.items():
        if constant.startswith("ENGINE_"):
            # a histogram is named without the suffixes the queries add
            assert name in engine or f"{name}_bucket" in engine, f"{constant} = {name!r}: no engine series"
        else:
            assert constant.startswith("GATEWAY_") and name in gateway, f"{constant} = {name!r}: no gateway series"
    assert len(names) > 20


def test_every_recording_rule_is_documented() -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    for name in recorded_names() | {r["alert"] for r in monitoring.generic_groups()[0]["rules"] if "alert" in r}:
        assert f"`{name}`" in doc, f"docs/metrics.md does not describe {name}"
    assert "`SluiceKedaFallback`" in doc and "`SluiceQueueMetricAbsent`" in doc


# -- promtool test rules ---------------------------------------------------------------------------------------
def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


def engine_labels(ep: Any, pod: str, role: str = "serving") -> dict[str, str]:
    """What the ServiceMonitor puts on an engine's series."""
    return {"namespace": ep.namespace, "sluice_dev_endpoint": ep.name, "sluice_dev_role": role, "pod": pod,
            "job": ep.name, "model_name": ep.spec.model.name}


def gateway_labels(ep: Any, **extra: str) -> dict[str, str]:
    return {"endpoint": f"{ep.namespace}/{ep.name}", "namespace": "sluice-system", "pod": "sluice-gateway-0",
            **extra}


def recorded_sample(ep: Any, name: str | None, value: float, **labels: str) -> dict[str, Any]:
    inner = ",".join(f'{k}="{v}"' for k, v in {"namespace": ep.namespace, "sluice_dev_endpoint": ep.name,
                                                **labels}.items())
    return {"labels": f"{monitoring.recorded(name) if name else ''}{{{inner}}}", "value": value}


def close_to(expr: str, value: float) -> str:
    """1 where `expr` is within a relative 1e-9 of `value` (promtool compares floats exactly), else 0."""
    return f"abs({expr} - {value!r}) <= bool {1e-9 * max(1.0, abs(value))!r}"


def expect(ep: Any, at: str, name: str, value: float | None, **labels: str) -> dict[str, Any]:
    """A promql_expr_test: the recorded series `name` (with `labels`) is `value` at `at`; None: absent."""
    scope = {"namespace": ep.namespace, "sluice_dev_endpoint": ep.name, **labels}
    selector = monitoring.recorded(name) + "{" + ",".join(f'{k}="{v}"' for k, v in scope.items()) + "}"
    if value is None:
        return {"expr": selector, "eval_time": at, "exp_samples": []}
    return {"expr": close_to(selector, value), "eval_time": at,
            "exp_samples": [recorded_sample(ep, None, 1, **labels)]}


def _annotations(rule: dict[str, Any], labels: dict[str, str], value: str) -> dict[str, str]:
    """The rule's annotations as Prometheus renders them, for the template forms the rules use."""
    def expand(text: str) -> str:
        text = text.replace("{{ $value | humanizePercentage }}", value).replace("{{ $value }}", value)
        return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m[1], ""), text)
    return {k: expand(v) for k, v in rule["annotations"].items()}


def firing(groups: list[dict[str, Any]], alert: str, at: str, labels: dict[str, str] | None,
           value: str = "") -> dict[str, Any]:
    """An alert_rule_test: `alert` fires at `at` with these labels (its own severity added); None: silent."""
    if labels is None:
        return {"eval_time": at, "alertname": alert, "exp_alerts": []}
    rule = next(r for r in groups[0]["rules"] if r.get("alert") == alert)
    labels = {**labels, **rule["labels"]}
    return {"eval_time": at, "alertname": alert,
            "exp_alerts": [{"exp_labels": labels, "exp_annotations": _annotations(rule, labels, value)}]}


def promtool_test(promtool: str, tmp_path: Path, groups: list[dict[str, Any]], tests: list[dict[str, Any]]) -> None:
    rule_file(groups, tmp_path / "rules.yaml")
    spec = tmp_path / "tests.yaml"
    spec.write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests},
                                   sort_keys=False))
    proc = subprocess.run([promtool, "test", "rules", spec.name], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_goodput_attainment_latency_and_throughput(promtool: str, tmp_path: Path) -> None:
    ep = endpoint("gpu-8b.yaml")
    a, b = engine_labels(ep, "llama-8b-a"), engine_labels(ep, "llama-8b-b")
    other = {**a, "sluice_dev_endpoint": "other"}  # another endpoint's series: out of scope
    inputs = [
        # Per minute: pod a completes 12 requests, 6 of them goodput; pod b 18, 12 goodput.
        series("sluice_request_slo_total", a, "0+12x20"), series("sluice_request_slo_total", b, "0+18x20"),
        series("sluice_request_goodput_total", a, "0+6x20"), series("sluice_request_goodput_total", b, "0+12x20"),
        series("sluice_request_slo_met_total", {**a, "objective": "ttft"}, "0+9x20"),
        series("sluice_request_slo_met_total", {**b, "objective": "ttft"}, "0+15x20"),
        series("sluice_request_slo_met_total", {**a, "objective": "tpot"}, "0+12x20"),
        series("sluice_request_slo_met_total", {**b, "objective": "tpot"}, "0+15x20"),
        series("sluice_request_goodput_total", other, "0+600x20"),
        # TTFT: half the requests within 0.1 s, all within 0.5 s.
        series("sluice_time_to_first_token_seconds_bucket", {**a, "le": "0.1"}, "0+30x20"),
        series("sluice_time_to_first_token_seconds_bucket", {**a, "le": "0.5"}, "0+60x20"),
        series("sluice_time_to_first_token_seconds_bucket", {**a, "le": "+Inf"}, "0+60x20"),
        series("sluice_prompt_tokens_total", a, "0+6000x20"), series("sluice_prompt_tokens_total", b, "0+3000x20"),
        series("sluice_generation_tokens_total", a, "0+1200x20"),
    ]
    at = "10m"
    promtool_test(promtool, tmp_path, monitoring.endpoint_groups(ep), [{
        "interval": "1m", "input_series": inputs,
        "promql_expr_test": [
            expect(ep, at, "goodput_requests:rate5m", 0.3),  # (6 + 12) / 60 s
            expect(ep, at, "slo_requests:rate5m", 0.5),
            *(expect(ep, at, f"slo_attainment:ratio_rate{w}", 0.6) for w in ("5m", "30m", "1h", "6h")),
            expect(ep, at, "slo_objective_attainment:ratio_rate5m", 0.8, objective="ttft"),
            expect(ep, at, "slo_objective_attainment:ratio_rate5m", 0.9, objective="tpot"),
            expect(ep, at, "time_to_first_token_seconds:quantile_rate5m", 0.1, quantile="0.5"),
            expect(ep, at, "time_to_first_token_seconds:quantile_rate5m", 0.42, quantile="0.9"),
            expect(ep, at, "prompt_tokens:rate5m", 150),
            expect(ep, at, "generation_tokens:rate5m", 20),
        ],
        "alert_rule_test": [firing(monitoring.endpoint_groups(ep), "SluiceNoReadyReplica", at, None)],
    }])


def _costed_replica(ep: Any, pod: str, role: str, busy: bool) -> list[dict[str, str]]:
    """One GPU at 3.6 USD/h (0.001 USD/s). Busy: prefill 0.25 s/s, decode 0.75 s/s, 125 prompt and 75
    generation tokens/s. Idle (a standby replica): loaded, paid for, serving nothing."""
    labels = engine_labels(ep, pod, role)
    per_minute = {"prefill": 15, "decode": 45, "prompt": 7500, "generation": 4500} if busy else {}
    return [
        series("sluice_num_gpus", labels, "1x20"),
        series("sluice_gpu_hour_usd", labels, "3.6x20"),
        *(series("sluice_engine_busy_seconds_total", {**labels, "phase": phase},
                 f"0+{per_minute.get(phase, 0)}x20") for phase in ("prefill", "decode")),
        *(series(f"sluice_{kind}_tokens_total", labels, f"0+{per_minute.get(kind, 0)}x20")
          for kind in ("prompt", "generation")),
    ]


@pytest.mark.parametrize("standby", [0, 1, 2])
def test_cost_per_million_tokens(promtool: str, tmp_path: Path, standby: int) -> None:
    """The prefill share of the cost over the prompt tokens, the decode share over the generation tokens;
    every standby replica's GPU-hours are paid for by the tokens the serving replicas produce."""
    ep = endpoint("scale-to-zero.yaml")
    inputs = _costed_replica(ep, "qwen-7b-a", "serving", busy=True)
    for i in range(standby):
        inputs += _costed_replica(ep, f"qwen-7b-warm-{i}", "standby", busy=False)
    paid = 1 + standby  # replicas, at 0.001 USD/s each
    at = "10m"
    promtool_test(promtool, tmp_path, monitoring.endpoint_groups(ep), [{
        "interval": "1m", "input_series": inputs,
        "promql_expr_test": [
            expect(ep, at, "gpu_cost_usd_per_second:sum", 0.001 * paid),
            expect(ep, at, "engine_busy_prefill:ratio_rate5m", 0.25),
            expect(ep, at, "cost_usd_per_1m_prompt_tokens:rate5m", 2.0 * paid),  # 0.001 * 0.25 / 125 * 1e6
            expect(ep, at, "cost_usd_per_1m_generation_tokens:rate5m", 10.0 * paid),  # 0.001 * 0.75 / 75 * 1e6
            expect(ep, at, "cost_usd_per_1m_tokens:rate5m", 5.0 * paid),  # 0.001 / 200 * 1e6
            expect(ep, at, "engines:count", 1, sluice_dev_role="serving"),
            expect(ep, at, "engines:count", standby or None, sluice_dev_role="standby"),
        ],
    }])


def test_no_ready_replica_while_requests_wait(promtool: str, tmp_path: Path) -> None:
    ep = endpoint("scale-to-zero.yaml")  # startupGraceSeconds 600: the alert waits 10m
    groups = monitoring.endpoint_groups(ep)
    who = {"namespace": ep.namespace, "sluice_dev_endpoint": ep.name}
    backends = [series("sluice_gateway_backends", gateway_labels(ep, role=role, state=state), "0x30")
                for role in ("serving", "standby") for state in ("ready", "cold")]
    held = series("sluice_gateway_pending_requests", gateway_labels(ep), "3x30")
    engine = engine_labels(ep, "qwen-7b-a")
    tests = [
        # Scaled to zero, no standby ready, the gateway holds 3 requests: fires once that lasts 10m.
        {"interval": "1m", "input_series": [held, *backends],
         "promql_expr_test": [expect(ep, "5m", "requests_queued:sum", 3)],
         "alert_rule_test": [firing(groups, "SluiceNoReadyReplica", "9m", None),
                             firing(groups, "SluiceNoReadyReplica", "12m", who, value="3")]},
        # A ready standby replica answers them: silent.
        {"interval": "1m", "input_series": [
            held, *backends[1:2], series("sluice_gateway_backends", gateway_labels(ep, role="standby",
                                                                                   state="ready"), "1x30")],
         "alert_rule_test": [firing(groups, "SluiceNoReadyReplica", "12m", None)]},
        # No gateway scraped; an engine serves (its /metrics answers) with a queue: silent, and the queue counts.
        {"interval": "1m", "input_series": [series("sluice_num_requests_waiting", engine, "2x30"),
                                            series("sluice_num_requests_running", engine, "8x30")],
         "promql_expr_test": [expect(ep, "5m", "requests_queued:sum", 2)],
         "alert_rule_test": [firing(groups, "SluiceNoReadyReplica", "12m", None)]},
        # Engines' queue plus the gateway's; nothing ready as the gateway sees it (the engine is loading).
        {"interval": "1m", "input_series": [held, *backends, series("sluice_num_requests_waiting", engine, "2x30"),
                                            series("sluice_num_requests_running", engine, "0x30")],
         "promql_expr_test": [expect(ep, "5m", "requests_queued:sum", 5)],
         "alert_rule_test": [firing(groups, "SluiceNoReadyReplica", "12m", who, value="5")]},
        # Nobody waits: silent.
        {"interval": "1m", "input_series": [series("sluice_gateway_pending_requests", gateway_labels(ep), "0x30"),
                                            *backends],
         "alert_rule_test": [firing(groups, "SluiceNoReadyReplica", "12m", None)]},
    ]
    promtool_test(promtool, tmp_path, groups, tests)


@pytest.mark.parametrize(("target", "fires"), [(None, True), (0.995, True), (0.5, False)])
def test_slo_burn_rate(promtool: str, tmp_path: Path, target: float | None, fires: bool) -> None:
    """Half the requests miss the SLO: against the default 99% (or 99.5%) that burns the budget 50x too fast
    and both alerts fire; against a 50% target the budget holds."""
    slo = {"ttftMs": 500, "tpotMs": 50} | ({"target": target} if target else {})
    ep = endpoint("gpu-8b.yaml", slo=slo)
    groups = monitoring.endpoint_groups(ep)
    pod = engine_labels(ep, "llama-8b-a")
    who = {"namespace": ep.namespace, "sluice_dev_endpoint": ep.name}
    healthy = {**pod, "sluice_dev_endpoint": "healthy"}  # another endpoint, 0.3% errors: never in scope
    tests = [{
        "interval": "1m",
        "input_series": [series("sluice_request_slo_total", pod, "0+60x100"),
                         series("sluice_request_goodput_total", pod, "0+30x100"),
                         series("sluice_request_slo_total", healthy, "0+600x100"),
                         series("sluice_request_goodput_total", healthy, "0+598x100")],
        "alert_rule_test": [firing(groups, name, "70m", who if fires else None, value="50%")
                            for name in ("SluiceSLOBurnRateFast", "SluiceSLOBurnRateSlow")],
    }]
    promtool_test(promtool, tmp_path, groups, tests)


def test_keda_fallback(promtool: str, tmp_path: Path) -> None:
    ep = endpoint("scale-to-zero.yaml")
    groups = monitoring.endpoint_groups(ep)
    keda = {"scaledObject": ep.name, "scaler": "prometheusScaler", "triggerIndex": "0", "metric": "s0-prometheus",
            "type": "scaledobject"}
    # Scraped by the Prometheus operator: KEDA's namespace label is renamed; the target's is KEDA's own.
    scraped = {**keda, "exported_namespace": ep.namespace, "namespace": "keda"}
    honored = {**keda, "namespace": ep.namespace}  # honorLabels, or a plain scrape
    labels = {"scaler": "prometheusScaler", "namespace": ep.namespace, "sluice_dev_endpoint": ep.name}
    errors = monitoring.KEDA_SCALER_ERRORS
    tests = [
        {"interval": "1m", "input_series": [series(errors, scraped, "0+4x20")],
         "alert_rule_test": [firing(groups, "SluiceKedaFallback", "2m", None),
                             firing(groups, "SluiceKedaFallback", "6m", labels)]},
        {"interval": "1m", "input_series": [series(errors, honored, "0+4x20")],
         "alert_rule_test": [firing(groups, "SluiceKedaFallback", "6m", labels)]},
        # No new errors, or another ScaledObject's: silent.
        {"interval": "1m", "input_series": [series(errors, scraped, "7x20"),
                                            series(errors, {**scraped, "scaledObject": "other"}, "0+4x20")],
         "alert_rule_test": [firing(groups, "SluiceKedaFallback", "6m", None)]},
    ]
    promtool_test(promtool, tmp_path, groups, tests)


def test_a_missing_queue_is_missing_not_zero(promtool: str, tmp_path: Path) -> None:
    """Acceptance (issue 14): KEDA's queue query is empty, not 0, when a series it needs is not scraped (so
    KEDA, with ignoreNullValues false, counts an error and falls back), and the absent-metric alert fires. It
    reads 0 only where that is the truth: the gateway sees no ready backend (scaled to zero, or loading)."""
    ep = endpoint("scale-to-zero.yaml")
    groups = monitoring.endpoint_groups(ep, gateway=True)
    (trigger, _) = [m for m in reconcile(ep) if m["kind"] == "ScaledObject"][0]["spec"]["triggers"]
    query = trigger["metadata"]["query"]
    assert query == autoscaling.queue_query(ep, gateway=True) and "vector(0)" not in query
    assert trigger["metadata"]["ignoreNullValues"] == "false"
    who = {"namespace": ep.namespace, "sluice_dev_endpoint": ep.name}
    engine = engine_labels(ep, "qwen-7b-a")
    held = series("sluice_gateway_pending_requests", gateway_labels(ep), "3x30")

    def backends(ready: int) -> list[dict[str, str]]:
        return [series("sluice_gateway_backends", gateway_labels(ep, role=role, state=state),
                       f"{ready if (role, state) == ('serving', 'ready') else 0}x30")
                for role in ("serving", "standby") for state in ("ready", "cold")]

    def reads(value: float | None, at: str = "5m") -> dict[str, Any]:
        return {"expr": query, "eval_time": at, "exp_samples": [] if value is None else [{"labels": "{}",
                                                                                          "value": value}]}
    unrelated = series("up", {"job": "node-exporter", "instance": "n1"}, "1x30")  # Prometheus runs, scrapes others
    tests = [
        # Nothing of Sluice is scraped (a ServiceMonitor no Prometheus selects): empty, and the alert fires.
        {"interval": "1m", "input_series": [unrelated], "promql_expr_test": [reads(None)],
         "alert_rule_test": [firing(groups, "SluiceQueueMetricAbsent", "4m", None),
                             firing(groups, "SluiceQueueMetricAbsent", "6m", who)]},
        # The gateway is scraped and a serving replica is ready, but its engine is not scraped: still empty.
        {"interval": "1m", "input_series": [held, *backends(1)], "promql_expr_test": [reads(None)],
         "alert_rule_test": [firing(groups, "SluiceQueueMetricAbsent", "6m", who)]},
        # The engines are scraped, the gateway is not: empty (its held requests are unknown, not 0).
        {"interval": "1m", "input_series": [series("sluice_num_requests_waiting", engine, "2x30")],
         "promql_expr_test": [reads(None)],
         "alert_rule_test": [firing(groups, "SluiceQueueMetricAbsent", "6m", who)]},
        # Scaled to zero: no engine has a queue and the gateway holds 3. That is 3, and nothing is absent.
        {"interval": "1m", "input_series": [held, *backends(0)], "promql_expr_test": [reads(3)],
         "alert_rule_test": [firing(groups, "SluiceQueueMetricAbsent", "6m", None)]},
        # Everything scraped: engines' 2 + gateway's 3.
        {"interval": "1m", "input_series": [held, *backends(1), series("sluice_num_requests_waiting", engine, "2x30")],
         "promql_expr_test": [reads(5)],
         "alert_rule_test": [firing(groups, "SluiceQueueMetricAbsent", "6m", None)]},
    ]
    promtool_test(promtool, tmp_path, groups, tests)


def test_a_missing_queue_without_a_gateway(promtool: str, tmp_path: Path) -> None:
    """No gateway: the engines' queue alone, and the alert waits out startupGraceSeconds (a loading engine
    reports nothing yet)."""
    ep = endpoint("scale-to-zero.yaml", scaling={"minReplicas": 1, "maxReplicas": 4})
    groups = monitoring.endpoint_groups(ep, gateway=False)
    cfg = OperatorConfig(gateway_scaler_address="", gateway_url="")
    (trigger,) = [m for m in reconcile(ep, cfg) if m["kind"] == "ScaledObject"][0]["spec"]["triggers"]
    query = trigger["metadata"]["query"]
    who = {"namespace": ep.namespace, "sluice_dev_endpoint": ep.name}
    engine = engine_labels(ep, "qwen-7b-a")
    tests = [
        {"interval": "1m", "input_series": [series("up", {"job": "node-exporter"}, "1x30")],
         "promql_expr_test": [{"expr": query, "eval_time": "5m", "exp_samples": []}],
         "alert_rule_test": [firing(groups, "SluiceQueueMetricAbsent", "9m", None),
                             firing(groups, "SluiceQueueMetricAbsent", "11m", who)]},
        {"interval": "1m", "input_series": [series("sluice_num_requests_waiting", engine, "2x30")],
         "promql_expr_test": [{"expr": query, "eval_time": "5m", "exp_samples": [{"labels": "{}", "value": 2}]}],
         "alert_rule_test": [firing(groups, "SluiceQueueMetricAbsent", "11m", None)]},
    ]
    promtool_test(promtool, tmp_path, groups, tests)


def test_chart_rules_cover_every_endpoint(promtool: str, tmp_path: Path) -> None:
    """The chart's generic file computes the same series for each endpoint, separately."""
    ep, other = endpoint("gpu-8b.yaml"), endpoint("scale-to-zero.yaml")
    inputs = _costed_replica(ep, "llama-8b-a", "serving", busy=True)
    inputs += _costed_replica(other, "qwen-7b-a", "serving", busy=True)
    inputs += _costed_replica(other, "qwen-7b-warm-0", "standby", busy=False)
    inputs.append(series("sluice_gateway_pending_requests", gateway_labels(other), "3x30"))
    inputs.append(series("sluice_gateway_backends", gateway_labels(other, role="serving", state="ready"), "0x30"))
    groups = yaml.safe_load(RULE_FILE.read_text())["groups"]
    who = {"namespace": other.namespace, "sluice_dev_endpoint": other.name}
    promtool_test(promtool, tmp_path, groups, [{
        "interval": "1m", "input_series": inputs,
        "promql_expr_test": [expect(ep, "10m", "cost_usd_per_1m_tokens:rate5m", 5.0),
                             expect(other, "10m", "cost_usd_per_1m_tokens:rate5m", 10.0)],
        # The engine serving qwen-7b is scraped, but the gateway sees no ready backend: it fires after 10m.
        "alert_rule_test": [firing(groups, "SluiceNoReadyReplica", "12m", who, value="3")],
    }])


# -- the chart -------------------------------------------------------------------------------------------------
def test_chart_renders_rules_and_dashboards(helm: tuple[str, dict[str, str]]) -> None:  # noqa: F811
    values = ["--set", "monitoring.rules.enabled=true", "--set", "monitoring.rules.labels.release=kps",
              "--set", "monitoring.dashboards.enabled=true", "--set", "monitoring.dashboards.namespace=grafana",
              "--set", "monitoring.dashboards.label=dashboards", "--set", "monitoring.dashboards.labelValue=sluice",
              "--set", "monitoring.dashboards.annotations.grafana_folder=Sluice"]
    assert "0 chart(s) failed" in run_helm(helm, "lint", "--strict", str(CHART), "--namespace", RELEASE_NS, *values)
    text = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", RELEASE_NS, *values)
    docs = [d for d in yaml.safe_load_all(text) if d]
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    assert schema_errors(crd_schema(reference_crd("monitoring.coreos.com_prometheusrules.yaml"), "v1"), rule) == []
    assert rule["spec"]["groups"] == monitoring.generic_groups()
    assert rule["metadata"]["labels"]["release"] == "kps"
    maps = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["labels"].get("dashboards") == "sluice"]
    assert {name: json.loads(text) for m in maps for name, text in m["data"].items()} == dashboards.dashboards()
    for m in maps:
        assert m["metadata"]["namespace"] == "grafana"
        assert m["metadata"]["annotations"] == {"grafana_folder": "Sluice"}
        kubernetes_validate.validate(m, "1.30", strict=True)
    (operator,) = [d for d in docs if d["kind"] == "Deployment"
                   and d["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"]
    env = {e["name"]: e.get("value") for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["SLUICE_ENDPOINT_RULES"] == "false"  # the chart's rules replace the per-endpoint ones
    assert OperatorConfig.from_env(env).endpoint_rules is False


@pytest.mark.parametrize(("values", "endpoint_rules"), [([], "true"),
                                                       (["monitoring.endpointRules.enabled=false"], "false")])
def test_chart_defaults_leave_rules_to_the_operator(helm: tuple[str, dict[str, str]],  # noqa: F811
                                                    values: list[str], endpoint_rules: str) -> None:
    sets = [a for v in values for a in ("--set", v)]
    docs = [d for d in yaml.safe_load_all(run_helm(helm, "template", RELEASE, str(CHART), *sets)) if d]
    assert not [d for d in docs if d["kind"] == "PrometheusRule"]
    assert not [d for d in docs if d["kind"] == "ConfigMap" and "grafana_dashboard" in d["metadata"]["labels"]]
    (operator,) = [d for d in docs if d["kind"] == "Deployment"
                   and d["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"]
    env = {e["name"]: e.get("value") for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["SLUICE_ENDPOINT_RULES"] == endpoint_rules


def test_dashboards_are_grafana_dashboards() -> None:
    for name, d in dashboards.dashboards().items():
        assert name == f"{d['uid']}.json"
        variables = {v["name"] for v in d["templating"]["list"]}
        assert {"datasource", "namespace"} <= variables
        ids = [p["id"] for p in d["panels"]]
        assert len(set(ids)) == len(ids)
        for panel in d["panels"]:
            pos = panel["gridPos"]
            assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]
            assert panel["type"] == "row" or panel["targets"], panel["title"]
            for t in panel.get("targets", []):
                assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
                used = set(re.findall(r"\$(\w+)", t["expr"])) - {"__rate_interval", "1"}
                assert used <= variables, f"{name} {panel['title']}: unknown variables {used - variables}"
    titles = {p["title"] for p in dashboards.dashboards()["sluice-endpoint.json"]["panels"]}
    assert {"Goodput", "SLO attainment", "Time to first token", "Tokens per second", "Requests", "Replicas",
            "KV cache usage", "Prefix cache hit rate", "USD per 1M tokens"} <= titles


# -- a live Prometheus scraping `sluice serve` ----------------------------------------------------------------
STANDBY_METRICS = b"""\
# HELP sluice_num_gpus GPUs the replica holds: every rank's device (TP x PP on CUDA), 0 on CPU.
# TYPE sluice_num_gpus gauge
sluice_num_gpus{model_name="smollm2"} 1.0
# HELP sluice_gpu_hour_usd Price of one GPU-hour in USD.
# TYPE sluice_gpu_hour_usd gauge
sluice_gpu_hour_usd{model_name="smollm2"} 3.6
"""


@pytest.fixture
def standby_replica() -> Iterator[str]:
    """A stand-in for an idle warm-pool replica on one GPU (3.6 USD/h): the CPU engine holds no GPU, so without
    it every cost would read 0. It exports what an idle engine's cost gauges say."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(STANDBY_METRICS)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def start_prometheus(prom_tools: dict[str, str], tmp_path: Path) -> Iterator[Callable[[dict[str, Any]], str]]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(config: dict[str, Any]) -> str:
        path = tmp_path / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        proc = subprocess.run([prom_tools["promtool"], "check", "config", str(path)], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        port = free_port()
        log = (tmp_path / "prometheus.log").open("wb")
        procs.append(subprocess.Popen(
            [prom_tools["prometheus"], f"--config.file={path}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT))
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: httpx.get(f"{url}/-/ready", timeout=1).status_code == 200, 30, "prometheus ready",
                 lambda: (tmp_path / "prometheus.log").read_text())
        return url

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_for(check: Callable[[], Any], timeout: float, what: str, context: Callable[[], str] = str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
            if result:
                return result
        except (httpx.HTTPError, AssertionError, KeyError, IndexError, ValueError):
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{context()}")
        time.sleep(0.25)


def query(url: str, expr: str, at: float) -> dict[str, float]:
    """An instant query through the HTTP API: the result's series (by their sorted labels) -> value."""
    resp = httpx.get(f"{url}/api/v1/query", params={"query": expr, "time": at}, timeout=10).json()
    assert resp["status"] == "success", resp
    return {json.dumps(sorted(r["metric"].items())): float(r["value"][1]) for r in resp["data"]["result"]}


def one(url: str, expr: str, at: float) -> float:
    (value,) = query(url, expr, at).values()
    return value


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_live_prometheus_records_goodput_and_cost(start_server: Any, start_prometheus: Any, standby_replica: str,
                                                  tmp_path: Path) -> None:
    from openai import OpenAI

    ep = endpoint("cpu-smollm2.yaml")
    server = start_server("--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--gpu-hour-usd", "2")
    rules = rule_file(monitoring.endpoint_groups(ep), tmp_path / "rules.yaml")
    target = {"namespace": ep.namespace, "sluice_dev_endpoint": ep.name}  # what the ServiceMonitor attaches
    url = start_prometheus({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [{"job_name": ep.name, "static_configs": [
            {"targets": [server.url.removeprefix("http://")],
             "labels": {**target, "sluice_dev_role": "serving", "pod": f"{ep.name}-0"}},
            {"targets": [standby_replica], "labels": {**target, "sluice_dev_role": "standby",
                                                      "pod": f"{ep.name}-warm-0"}}]}],
    })
    # Every engine series the rules read is on the live /metrics.
    live = {line.split("{")[0].split(" ")[0] for line in httpx.get(f"{server.url}/metrics").text.splitlines()
            if line and not line.startswith("#")}
    used = {sel.name for r in monitoring.endpoint_groups(ep)[0]["rules"] for sel in _selectors(r["expr"])}
    assert used & set(engine_metrics()) <= live, (used & set(engine_metrics())) - live
    wait_for(lambda: one(url, "count(up == 1)", time.time()) == 2, 30, "both targets scraped")

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    for i in range(4):
        client.chat.completions.create(model=server.model, max_tokens=8, temperature=0,
                                       messages=[{"role": "user", "content": f"Count to {i + 3}."}])
    completed = server.metrics()["sluice_request_slo_total"]
    assert completed >= 4

    def recorded(name: str, at: float) -> float:
        return one(url, f'{monitoring.recorded(name)}{{namespace="{ep.namespace}",sluice_dev_endpoint="{ep.name}"}}',
                   at)

    # Wait until a scrape after the traffic has gone through the rules: all 4 requests met the (generous) SLO.
    def settled() -> float:
        at = time.time()
        assert one(url, f'sluice_request_slo_total{{sluice_dev_endpoint="{ep.name}"}}', at) == completed
        assert recorded("goodput_requests:rate5m", at) > 0
        assert recorded("slo_attainment:ratio_rate5m", at) == 1.0
        return at

    at = wait_for(settled, 30, "goodput recorded", lambda: json.dumps(query(url, '{__name__=~"sluice_endpoint:.*"}',
                                                                            time.time()), indent=1))
    assert math.isclose(recorded("goodput_requests:rate5m", at), recorded("slo_requests:rate5m", at))
    ttft = query(url, monitoring.recorded("time_to_first_token_seconds:quantile_rate5m"), at)
    assert len(ttft) == 3 and all(0 < v < 60 for v in ttft.values()), ttft

    # Cost: the engine on CPU holds no GPU and counts as one unit at its 2 USD/h; the standby's GPU (3.6 USD/h
    # = 0.001 USD/s) adds to it; the serving replica's tokens pay for both, split by engine time.
    assert one(url, f'sluice_gpu_hour_usd{{pod="{ep.name}-0"}}', at) == 2.0
    usd_s = 0.001 + 2 / 3600
    assert recorded("gpu_cost_usd_per_second:sum", at) == pytest.approx(usd_s)
    prompt, generation = recorded("prompt_tokens:rate5m", at), recorded("generation_tokens:rate5m", at)
    share = recorded("engine_busy_prefill:ratio_rate5m", at)
    assert prompt > 0 and generation > 0 and 0 < share < 1
    assert recorded("cost_usd_per_1m_tokens:rate5m", at) == pytest.approx(usd_s / (prompt + generation) * 1e6)
    assert recorded("cost_usd_per_1m_prompt_tokens:rate5m", at) == pytest.approx(usd_s * share / prompt * 1e6)
    assert recorded("cost_usd_per_1m_generation_tokens:rate5m", at) == pytest.approx(
        usd_s * (1 - share) / generation * 1e6)
    engines = query(url, monitoring.recorded("engines:count"), at)
    assert sorted(engines.values()) == [1.0, 1.0] and len(engines) == 2  # one serving, one standby
