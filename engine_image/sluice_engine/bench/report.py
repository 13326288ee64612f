"""What a bench prints and writes: a vLLM-style block per run, a markdown table of all runs, the ratios
between servers at each load point, and the JSON document (`--json`)."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from .runner import RunResult

WIDTH = 60


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _row(label: str, value: Any) -> str:
    return f"{label:<40}{value}"


def run_block(run: RunResult) -> str:
    s = run.summary
    title = f" {run.target} [{run.point.label()}] "
    lines = [title.center(WIDTH, "=")]
    lines.append(_row("Successful requests:", s["completed"]))
    lines.append(_row("Failed requests:", s["failed"]))
    lines.append(_row("Benchmark duration (s):", _f(s["duration_s"])))
    lines.append(_row("Total input tokens:", s["total_input_tokens"]))
    lines.append(_row("Total generated tokens:", s["total_output_tokens"]))
    lines.append(_row("Request throughput (req/s):", _f(s["request_throughput"], 3)))
    if "request_goodput" in s:
        lines.append(_row("Request goodput (req/s):", _f(s["request_goodput"], 3)))
        lines.append(_row("SLO attainment (%):", _f(100 * (s["slo_attainment"] or 0), 1)))
    lines.append(_row("Output token throughput (tok/s):", _f(s["output_throughput"])))
    lines.append(_row("Total token throughput (tok/s):", _f(s["total_token_throughput"])))
    lines.append(_row("Peak concurrent requests:", run.peak_concurrency))
    if s.get("cached_prompt_tokens") is not None:
        share = s["cached_prompt_tokens"] / max(1, s["total_input_tokens"])
        lines.append(_row("Prompt tokens from prefix cache:", f"{s['cached_prompt_tokens']} ({100 * share:.0f}%)"))
    if "echo_exact_match" in s:
        lines.append(_row("Echo outputs matching the text (%):", _f(100 * s["echo_exact_match"], 1)))
    if run.other_cpu_pct is not None:
        lines.append(_row("Other processes' CPU (% of machine):", f"{run.other_cpu_pct:.0f}"))
    if run.server_rss_mib is not None:
        lines.append(_row("Server RSS / peak RSS (MiB):", f"{run.server_rss_mib:.0f} / {run.server_peak_rss_mib:.0f}"))
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        short = key.split("_")[0].upper()
        lines.append(f" {title} ".center(WIDTH, "-"))
        d = s[key]
        for stat in ("mean", "median", "p90", "p99"):
            name = stat.capitalize() if stat in ("mean", "median") else stat.upper()
            lines.append(_row(f"{name} {short} (ms):", _f(d[stat])))
    if s["errors"]:
        lines.append(" Errors ".center(WIDTH, "-"))
        lines += [f"{n:>5} x {msg}" for msg, n in s["errors"].items()]
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def _ms(d: dict, stat: str) -> str:
    return _f(d[stat], 0) if d[stat] is None or d[stat] >= 10 else _f(d[stat], 1)


def runs_table(runs: list[RunResult], slo: bool) -> str:
    head = ["server", "load", "ok/failed", "out tok/s", "total tok/s", "TTFT p50 ms", "TTFT p99 ms",
            "TPOT p50 ms", "TPOT p99 ms", "ITL p50 ms", "E2E p50 ms"]
    if slo:
        head += ["goodput req/s", "SLO met"]
    memory = any(r.server_rss_mib is not None for r in runs)
    if memory:
        head += ["server RSS MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for r in runs:
        s = r.summary
        cells = [r.target, r.point.label(), f"{s['completed']}/{s['failed']}", _f(s["output_throughput"], 1),
                 _f(s["total_token_throughput"], 1), _ms(s["ttft_ms"], "median"), _ms(s["ttft_ms"], "p99"),
                 _ms(s["tpot_ms"], "median"), _ms(s["tpot_ms"], "p99"), _ms(s["itl_ms"], "median"),
                 _ms(s["e2el_ms"], "median")]
        if slo:
            cells += [_f(s.get("request_goodput"), 3), f"{100 * (s.get('slo_attainment') or 0):.0f}%"]
        if memory:
            cells.append(_f(r.server_rss_mib, 0))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


RATIO_METRICS = (("output tok/s", "output_throughput", None), ("TTFT p50", "ttft_ms", "median"),
                 ("TTFT p99", "ttft_ms", "p99"), ("TPOT p50", "tpot_ms", "median"), ("TPOT p99", "tpot_ms", "p99"),
                 ("E2E p50", "e2el_ms", "median"))


def _value(s: dict, key: str, stat: str | None) -> float | None:
    return s.get(key) if stat is None else s[key][stat]


def ratios(runs: list[RunResult], slo: bool) -> list[dict]:
    """At each load point: the first server's value / each other server's, per metric."""
    out = []
    points: dict[str, list[RunResult]] = {}
    for r in runs:
        points.setdefault(r.point.label(), []).append(r)
    metrics = RATIO_METRICS + ((("goodput", "request_goodput", None),) if slo else ())
    for label, group in points.items():
        base = group[0]
        for other in group[1:]:
            row: dict[str, Any] = {"load": label, "numerator": base.target, "denominator": other.target}
            for name, key, stat in metrics:
                a, b = _value(base.summary, key, stat), _value(other.summary, key, stat)
                row[name] = a / b if a is not None and b else None
            out.append(row)
    return out


def ratios_table(rows: list[dict]) -> str:
    if not rows:
        return ""
    names = [k for k in rows[0] if k not in ("load", "numerator", "denominator")]
    lines = ["| ratio | load | " + " | ".join(names) + " |", "|---|---|" + "---:|" * len(names)]
    for r in rows:
        cells = [f"{r['numerator']} ÷ {r['denominator']}", r["load"]]
        cells += ["-" if r[n] is None else f"{r[n]:.2f}x" for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _num(x: float) -> float | str:
    return "inf" if isinstance(x, float) and math.isinf(x) else x


def run_json(run: RunResult, with_requests: bool = True) -> dict:
    point = {k: _num(v) for k, v in asdict(run.point).items()}
    d: dict[str, Any] = {"server": run.target, "url": run.url, "model": run.model, "load": point,
                         "peak_concurrency": run.peak_concurrency, "other_cpu_pct": run.other_cpu_pct,
                         "server_rss_mib": run.server_rss_mib, "server_peak_rss_mib": run.server_peak_rss_mib,
                         "summary": run.summary}
    if with_requests:
        d["requests"] = [
            {"index": r.index, "success": r.success, "error": r.error, "send_s": r.send_s,
             "prompt_tokens": r.prompt_tokens, "max_tokens": r.max_tokens, "output_tokens": r.output_tokens,
             "cached_tokens": r.cached_tokens, "ttft_s": r.ttft_s, "tpot_s": r.tpot_s, "e2el_s": r.e2el_s,
             "itl_s": r.itl_s}
            for r in sorted(run.records, key=lambda r: r.index)
        ]
    return d
