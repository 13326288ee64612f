"""`sluice usage`: a tenant's requests, tokens and cost over a window, per endpoint, from Prometheus.

    sluice usage --prometheus http://prometheus:9090 --tenant team-a --since 24h

Tokens and requests are the gateway's per-tenant counters (increase over the window, every gateway replica
summed); the cost is the recorded per-tenant cost rate (monitoring.tenant_cost_per_second: the tenant's tokens
at the endpoint's price per token) integrated over the window at --step. So the answer is what the dashboard's
"Tenants" row shows, added up. Needs the gateway's metrics scraped and the operator's recording rules loaded.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from sluice_contract import (
    GATEWAY_TENANT_LIMITED_METRIC,
    GATEWAY_TENANT_REQUESTS_METRIC,
    GATEWAY_TENANT_TOKENS_METRIC,
)

from .monitoring import EP, recorded

DURATION = re.compile(r"^[0-9]+(ms|s|m|h|d|w|y)$")
TENANT = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")  # the gateway's tenant names (and "none")
COST_RULE = recorded("tenant_cost_usd_per_second:rate5m")


@dataclass(slots=True)
class EndpointUsage:
    requests: float = 0.0
    prompt_tokens: float = 0.0
    completion_tokens: float = 0.0
    rate_limited: dict[str, float] = field(default_factory=dict)
    cost_usd: float | None = None  # None: no recorded cost (no price set, or the rules not loaded)


def add_usage_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prometheus", required=True, help="Prometheus' URL (http://host:9090)")
    p.add_argument("--tenant", required=True, help="a tenant of the gateway's API keys file ('none': requests "
                   "without a tenant's key)")
    p.add_argument("--since", default="24h", help="the window, a Prometheus duration (default 24h)")
    p.add_argument("--endpoint", default=None, help="only this endpoint (<namespace>/<name>)")
    p.add_argument("--step", default="1m", help="the cost integral's resolution, a Prometheus duration (default "
                   "1m; at least the rule evaluation interval)")
    p.add_argument("--output", choices=("table", "json"), default="table")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per Prometheus query")


def seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    unit = "ms" if duration.endswith("ms") else duration[-1]
    return float(duration[:-len(unit)]) * units[unit]


def query(base: str, expr: str, timeout: float) -> list[dict[str, Any]]:
    url = f"{base.rstrip('/')}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - the operator's own flag
            body = json.load(r)
    except urllib.error.HTTPError as e:
        detail = e.read(2000).decode(errors="replace")
        raise ValueError(f"Prometheus answered {e.code} to {expr!r}: {detail}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ValueError(f"cannot reach Prometheus at {base}: {e}") from None
    if body.get("status") != "success":
        raise ValueError(f"Prometheus: {body.get('error', body)}")
    return body["data"]["result"]


def _value(sample: dict[str, Any]) -> float:
    v = float(sample["value"][1])
    return v if math.isfinite(v) else 0.0


def report(base: str, tenant: str, since: str, endpoint: str | None = None, step: str = "1m",
           timeout: float = 30.0) -> dict[str, EndpointUsage]:
    if not TENANT.match(tenant):
        raise ValueError(f"--tenant {tenant!r} is not a tenant name (lower-case letters, digits, '.', '_', '-')")
    for flag, d in (("--since", since), ("--step", step)):
        if not DURATION.match(d):
            raise ValueError(f"{flag} takes a Prometheus duration such as 24h or 30m, got {d!r}")
    if endpoint is not None and not re.match(r"^[a-z0-9-]+/[a-z0-9.-]+$", endpoint):
        raise ValueError(f"--endpoint takes <namespace>/<name>, got {endpoint!r}")
    match = f'tenant="{tenant}"' + (f',endpoint="{endpoint}"' if endpoint else "")
    out: dict[str, EndpointUsage] = {}

    def entry(key: str) -> EndpointUsage:
        return out.setdefault(key, EndpointUsage())

    for s in query(base, f"sum by (endpoint, type) (increase({GATEWAY_TENANT_TOKENS_METRIC}{{{match}}}[{since}]))",
                   timeout):
        e = entry(s["metric"].get("endpoint", ""))
        if s["metric"].get("type") == "prompt":
            e.prompt_tokens += _value(s)
        else:
            e.completion_tokens += _value(s)
    for s in query(base, f"sum by (endpoint) (increase({GATEWAY_TENANT_REQUESTS_METRIC}{{{match}}}[{since}]))",
                   timeout):
        entry(s["metric"].get("endpoint", "")).requests += _value(s)
    for s in query(base, f"sum by (endpoint, limit) (increase({GATEWAY_TENANT_LIMITED_METRIC}{{{match}}}[{since}]))",
                   timeout):
        entry(s["metric"].get("endpoint", "")).rate_limited[s["metric"].get("limit", "")] = _value(s)
    cost_match = f'tenant="{tenant}"'
    if endpoint:
        ns, name = endpoint.split("/", 1)
        cost_match += f',namespace="{ns}",{EP}="{name}"'
    # The rate's integral: each step's value times the step. NaN or Inf (a window without tokens) count as 0.
    cost = (f"sum by (namespace, {EP}) (sum_over_time(({COST_RULE}{{{cost_match}}} < +Inf)[{since}:{step}])) "
            f"* {seconds(step):g}")
    for s in query(base, cost, timeout):
        key = f"{s['metric'].get('namespace', '')}/{s['metric'].get(EP, '')}"
        entry(key).cost_usd = _value(s)
    return dict(sorted(out.items()))


def _fmt(x: float | None, money: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x:.4f}" if money else f"{x:,.0f}"


def run_usage(args: argparse.Namespace) -> int:
    rows = report(args.prometheus, args.tenant, args.since, args.endpoint, args.step, args.timeout)
    if args.output == "json":
        json.dump({"tenant": args.tenant, "since": args.since, "endpoints": {
            k: {"requests": v.requests, "promptTokens": v.prompt_tokens, "completionTokens": v.completion_tokens,
                "rateLimited": v.rate_limited, "costUSD": v.cost_usd} for k, v in rows.items()}}, sys.stdout,
            indent=1)
        print()
        return 0
    print(f"tenant {args.tenant}, last {args.since}")
    header = ("ENDPOINT", "REQUESTS", "PROMPT TOKENS", "COMPLETION TOKENS", "RATE-LIMITED", "COST USD")
    table = [header] + [(k, _fmt(v.requests), _fmt(v.prompt_tokens), _fmt(v.completion_tokens),
                         _fmt(sum(v.rate_limited.values())), _fmt(v.cost_usd, True)) for k, v in rows.items()]
    if rows:
        costs = [v.cost_usd for v in rows.values() if v.cost_usd is not None]
        table.append(("TOTAL", _fmt(sum(v.requests for v in rows.values())),
                      _fmt(sum(v.prompt_tokens for v in rows.values())),
                      _fmt(sum(v.completion_tokens for v in rows.values())),
                      _fmt(sum(sum(v.rate_limited.values()) for v in rows.values())),
                      _fmt(sum(costs) if costs else None, True)))
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for r in table:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    if not rows:
        print(f"(no usage recorded for tenant {args.tenant!r}: is the gateway scraped, and the tenant in its keys file?)")
    return 0
