"""PNG plots (`--plot-dir`): latency CDFs of every run, and for a sweep, output throughput and p99 TTFT
against the swept request rate or concurrency. matplotlib is imported only here (the `dev` extra)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

from .runner import RunResult

CDF_METRICS = (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E latency", "e2el"))


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise RuntimeError("--plot-dir needs matplotlib: pip install matplotlib (or the 'dev' extra: "
                           "pip install -e '.[dev]')") from e
    matplotlib.use("Agg")  # files only; no display needed
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its font-cache notices are not ours to print
    import matplotlib.pyplot as plt

    return plt


def _samples_ms(run: RunResult, metric: str) -> list[float]:
    ok = [r for r in run.records if r.success]
    if metric == "ttft":
        xs = [r.ttft_s for r in ok if r.ttft_s is not None]
    elif metric == "tpot":
        xs = [t for r in ok if (t := r.tpot_s) is not None]
    elif metric == "itl":
        xs = [x for r in ok for x in r.itl_s]
    else:
        xs = [r.e2el_s for r in ok if r.e2el_s is not None]
    return sorted(x * 1e3 for x in xs)


def latency_cdfs(runs: list[RunResult], path: Path, title: str) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (name, metric) in zip(axes.flat, CDF_METRICS, strict=True):
        lo, hi = math.inf, 0.0
        for run in runs:
            xs = _samples_ms(run, metric)
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=f"{run.target} [{run.point.label()}]")
                lo, hi = min(lo, xs[0]), max(hi, xs[-1])
        if 0 < lo and hi / lo > 20:  # servers an order of magnitude apart: keep both readable
            ax.set_xscale("log")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if metric != "itl" else "fraction of gaps")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
        ax.set_title(f"{name} CDF")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def sweep(runs: list[RunResult], sweep_by: str, path: Path, title: str) -> Path:
    """sweep_by: 'request_rate' or 'max_concurrency'. An infinite rate is drawn one step past the largest
    finite one and labelled 'inf'."""
    plt = _pyplot()
    xs_all = sorted({getattr(r.point, sweep_by) for r in runs})
    finite = [x for x in xs_all if not math.isinf(x)]
    inf_at = (max(finite) * 1.5 if finite else 1.0)

    def pos(x: float) -> float:
        return inf_at if math.isinf(x) else x

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for target in dict.fromkeys(r.target for r in runs):
        mine = sorted((r for r in runs if r.target == target), key=lambda r: getattr(r.point, sweep_by))
        x = [pos(getattr(r.point, sweep_by)) for r in mine]
        ax1.plot(x, [r.summary["output_throughput"] for r in mine], marker="o", label=target)
        ax2.plot(x, [r.summary["ttft_ms"]["p99"] or float("nan") for r in mine], marker="o", label=target)
    xlabel = "request rate (req/s)" if sweep_by == "request_rate" else "max concurrency"
    for ax, ylabel in ((ax1, "output tokens/s"), (ax2, "p99 TTFT (ms)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ticks = [pos(x) for x in xs_all]
        ax.set_xticks(ticks, ["inf" if math.isinf(x) else f"{x:g}" for x in xs_all])
    ax1.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
