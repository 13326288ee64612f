"""The chart's Grafana dashboards against the rules of Grafana's dashboard linter (github.com/grafana/dashboard-linter).

The linter itself cannot be built here: the Go module proxy refuses github.com/grafana/dashboard-linter (403, no
version listed), and what it links, github.com/grafana/grafana/apps/dashboard and github.com/grafana/loki/v3, is
AGPL and not served either. So its documented rules (docs/rules/*.md of the linter) are checked here, each by its
name; `target-promql-rule` and `template-label-promql-rule` (every expression parses as PromQL, every metric
exists) are tests/operator/test_monitoring.py's `test_every_expression_parses_and_every_metric_exists`.

Excluded, as the linter lets a dashboard exclude a rule (its .lint file), for one reason: `template-job-rule`,
`template-instance-rule`, `target-job-rule` and `target-instance-rule` ask for `job` and `instance` variables and
matchers on every query. Sluice's series are keyed by the ServiceMonitor's target labels `namespace` and
`sluice_dev_endpoint` (the dashboards' variables, matched by every engine query); an engine's `instance` is a pod
IP that changes with every scale from zero, and its `job` is the Service's name, the endpoint again.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from sluice_operator import dashboards

DASHBOARDS = dashboards.dashboards()
# Panel types the linter's panel rules look at (panel-datasource-rule: the first four; the others add stat, gauge).
DATASOURCE_PANELS = ("singlestat", "graph", "table", "timeseries")
DESCRIBED_PANELS = ("stat", "singlestat", "graph", "table", "timeseries", "gauge")
# Grafana's unit ids (packages/grafana-data/src/valueFormats/categories.ts) of the kinds these dashboards show.
GRAFANA_UNITS = {"none", "short", "percent", "percentunit", "s", "ms", "µs", "ns", "m", "h", "d", "reqps", "ops",
                 "cps", "rps", "wps", "iops", "cpm", "opm", "rpm", "currencyUSD", "bytes", "decbytes", "bits"}
RATE_FUNCTIONS = re.compile(r"\b(rate|irate|increase)\s*\(")
DATASOURCE_UIDS = ("${datasource}", "$datasource")


def _panels(d: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in d["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # a collapsed row holds its panels
    return out


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_template_datasource_rule(name: str) -> None:
    sources = [v for v in DASHBOARDS[name]["templating"]["list"] if v["type"] == "datasource"]
    assert len(sources) == 1, sources
    (var,) = sources
    assert (var["name"], var["label"], var["query"]) == ("datasource", "Data Source", "prometheus"), var


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_template_on_time_change_reload_rule(name: str) -> None:
    for var in DASHBOARDS[name]["templating"]["list"]:
        if var["type"] == "query":
            assert var["refresh"] == 2, var  # 2: on time range change
            assert var["datasource"]["uid"] in DATASOURCE_UIDS, var


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_template_uneditable_rule(name: str) -> None:
    assert DASHBOARDS[name]["editable"] is False  # declared as code: the chart's ConfigMap is the source of truth


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_panel_datasource_rule(name: str) -> None:
    for p in _panels(DASHBOARDS[name]):
        if p["type"] in DATASOURCE_PANELS:
            assert (p.get("datasource") or {}).get("uid") in DATASOURCE_UIDS, (p["title"], p.get("datasource"))
            for t in p.get("targets", []):
                assert (t.get("datasource") or p["datasource"]).get("uid") in DATASOURCE_UIDS, (p["title"], t)


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_panel_title_description_rule(name: str) -> None:
    for p in _panels(DASHBOARDS[name]):
        if p["type"] in DESCRIBED_PANELS:
            assert p.get("title", "").strip() and p.get("description", "").strip(), p.get("title")


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_panel_units_rule(name: str) -> None:
    for p in _panels(DASHBOARDS[name]):
        if p["type"] in DESCRIBED_PANELS:
            defaults = p.get("fieldConfig", {}).get("defaults", {})
            if defaults.get("mappings"):
                continue  # the linter skips panels with value mappings
            assert defaults.get("unit") in GRAFANA_UNITS, (p["title"], defaults.get("unit"))


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_target_rate_interval_rule(name: str) -> None:
    for p in _panels(DASHBOARDS[name]):
        for t in p.get("targets", []):
            expr = t["expr"]
            for call in RATE_FUNCTIONS.finditer(expr):
                # The range of this call: the first `[...]` after it, before the call's own closing parenthesis.
                window = re.search(r"\[([^\]]+)\]", expr[call.end():])
                assert window and window[1] == "$__rate_interval", (p["title"], expr)


def test_every_panel_is_checked_by_some_rule() -> None:
    kinds = {p["type"] for d in DASHBOARDS.values() for p in _panels(d)} - {"row"}
    assert kinds <= set(DESCRIBED_PANELS), kinds
