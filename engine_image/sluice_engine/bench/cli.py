"""`sluice bench`: its flags (argparse only, imported by the `sluice` dispatcher to parse them) and the command
itself (imports aiohttp, tqdm and the tokenizer only when it runs)."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

from .arrivals import describe, parse_rate
from .client import ENDPOINT_TYPES
from .workloads import WORKLOADS

DEFAULT_URL = "http://127.0.0.1:8000"


def _int_list(text: str) -> list[int]:
    try:
        xs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want N or N,N,...; got {text!r}") from None
    if not xs or min(xs) < 1:
        raise argparse.ArgumentTypeError(f"concurrency must be >= 1; got {text!r}")
    return xs


def _rate_list(text: str) -> list[float]:
    try:
        return [parse_rate(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_bench_args(p: argparse.ArgumentParser) -> None:
    tgt = p.add_argument_group("servers")
    tgt.add_argument("--base-url", "--url", dest="base_url", default=None,
                     help=f"OpenAI-compatible server to load (default {DEFAULT_URL})")
    tgt.add_argument("--compare", nargs="+", metavar="[NAME=]URL", default=None,
                     help="run the same workload against each of these servers, one after another, and print "
                          "the first one's metrics divided by each other's")
    tgt.add_argument("--model", default=None, help="model name to send (default: each server's first in /v1/models)")
    tgt.add_argument("--endpoint-type", default="completions", choices=ENDPOINT_TYPES,
                     help="POST /v1/completions (prompt text) or /v1/chat/completions (one user message)")
    tgt.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                     help="sent as a bearer token (default: $OPENAI_API_KEY)")
    tgt.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request")

    wl = p.add_argument_group("workload (seeded; lengths in tokens of --tokenizer)")
    wl.add_argument("--workload", default="conversational", choices=WORKLOADS)
    wl.add_argument("--num-requests", type=int, default=64, help="measured requests per run (warm-up excluded)")
    wl.add_argument("--seed", type=int, default=0)
    wl.add_argument("--input-len", type=int, default=100,
                    help="prompt length: median (conversational, echo's text) or exact (fixed)")
    wl.add_argument("--output-len", type=int, default=64,
                    help="max_tokens: median (conversational) or exact (fixed, shared-prefix; jsonl's default)")
    wl.add_argument("--input-sigma", type=float, default=0.5, help="sigma of the lognormal prompt length")
    wl.add_argument("--output-sigma", type=float, default=0.8, help="sigma of the lognormal output length")
    wl.add_argument("--input-min", type=int, default=None, help="clip of the prompt length (default median/4)")
    wl.add_argument("--input-max", type=int, default=None, help="(default median*4)")
    wl.add_argument("--output-min", type=int, default=None, help="clip of the output length (default median/4)")
    wl.add_argument("--output-max", type=int, default=None, help="(default median*4)")
    wl.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: tokens of each shared prefix")
    wl.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes (P)")
    wl.add_argument("--suffix-len", type=int, default=32, help="shared-prefix: tokens of each unique suffix")
    wl.add_argument("--dataset", default=None, metavar="FILE.jsonl",
                    help='jsonl: one {"prompt": ...} or {"messages": [...]} per line, optional "max_tokens"')
    wl.add_argument("--tokenizer", default=None, metavar="DIR",
                    help="model directory with tokenizer.json (default: the bundled SmolLM2-135M-Instruct)")

    rq = p.add_argument_group("requests")
    rq.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                    help="ask for exactly max_tokens (vLLM extra; default: on for conversational, fixed and "
                         "shared-prefix, off for echo and jsonl)")
    rq.add_argument("--temperature", type=float, default=0.0)
    rq.add_argument("--extra-body", default=None, metavar="JSON",
                    help='merged into every request body, e.g. \'{"speculative": false}\'')

    ld = p.add_argument_group("load")
    ld.add_argument("--request-rate", type=parse_rate, default=math.inf,
                    help="requests per second, gamma-distributed gaps (default inf: all at once)")
    ld.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of the gaps: 1 = Poisson, < 1 burstier, > 1 more even")
    ld.add_argument("--max-concurrency", type=_int_list, default=None, metavar="C[,C...]",
                    help="most requests in flight (closed loop at rate inf); a list sweeps over them")
    ld.add_argument("--sweep", type=_rate_list, default=None, metavar="RATE,RATE,...",
                    help="one run per request rate (inf allowed), fresh prompt text each")
    ld.add_argument("--num-warmups", type=int, default=2,
                    help="short requests sent before each run, not measured")

    out = p.add_argument_group("report")
    out.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT objective")
    out.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT objective")
    out.add_argument("--json", default=None, metavar="OUT", help="write the whole report (every request) here")
    out.add_argument("--plot-dir", default=None, metavar="DIR",
                     help="write PNG plots here: latency CDFs; throughput and p99 TTFT vs the swept load "
                          "(needs matplotlib)")
    out.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from .client import RequestOptions, Target, parse_target

    if args.compare and args.base_url:
        raise ValueError("give either --base-url or --compare")
    targets: list[Target] = [parse_target(t) for t in (args.compare or [args.base_url or DEFAULT_URL])]
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        for i, t in enumerate(targets):  # the same URL twice: keep them apart in the tables
            t.name = f"{i + 1}:{t.name}"
    for t in targets:
        t.model = args.model
    points = _load_points(args)
    spec = _spec(args)
    extra = json.loads(args.extra_body) if args.extra_body else {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    ignore_eos = args.ignore_eos
    if ignore_eos is None:
        from .workloads import default_ignore_eos

        ignore_eos = default_ignore_eos(spec.name)
    opts = RequestOptions(args.endpoint_type, args.temperature, ignore_eos, extra, args.api_key,
                          args.request_timeout)
    if args.num_warmups < 0:
        raise ValueError("--num-warmups must be >= 0")
    return bench(targets, spec, points, opts, args)


def _load_points(args: argparse.Namespace):
    from .runner import LoadPoint

    conc = args.max_concurrency or [None]
    if args.sweep and len(conc) > 1:
        raise ValueError("sweep one thing at a time: --sweep (rates) or a --max-concurrency list")
    if args.sweep and not math.isinf(args.request_rate):
        raise ValueError("--sweep replaces --request-rate; give one of them")
    if args.burstiness <= 0:
        raise ValueError("--burstiness must be > 0")
    rates = args.sweep or [args.request_rate]
    return [LoadPoint(r, args.burstiness, c) for r in rates for c in conc]


def _spec(args: argparse.Namespace):
    from .workloads import WorkloadSpec

    try:
        return WorkloadSpec(args.workload, args.num_requests, args.seed, args.input_len, args.output_len,
                            args.input_sigma, args.output_sigma, args.input_min, args.input_max, args.output_min,
                            args.output_max, args.prefix_len, args.num_prefixes, args.suffix_len, args.dataset)
    except AssertionError as e:
        raise ValueError(str(e)) from None


def _tokenizer(path: str | None):
    from ..model_fetch import resolve_model
    from ..tokenizer import Tokenizer

    model_dir = Path(path) if path else resolve_model(None)
    if not (model_dir / "tokenizer.json").is_file():
        raise ValueError(f"--tokenizer: no tokenizer.json in {str(model_dir)!r}")
    return Tokenizer.from_dir(model_dir), model_dir


def _lengths(reqs) -> str:
    p = [r.prompt_len for r in reqs]
    o = [r.max_tokens for r in reqs]
    return (f"prompt tokens mean {sum(p) / len(p):.0f} [{min(p)}-{max(p)}], max_tokens mean {sum(o) / len(o):.0f} "
            f"[{min(o)}-{max(o)}], total max_tokens {sum(o)}")


def bench(targets, spec, points, opts, args) -> int:
    import asyncio

    from . import report
    from .machine import cpu_name, load_average
    from .metrics import summarize
    from .runner import resolve_model, run_point
    from .workloads import build_workload, warmup_requests

    tok, tok_dir = _tokenizer(args.tokenizer)
    invoked = len(sys.argv) > 1 and sys.argv[1] == "bench"
    cmd = "sluice bench " + (shlex.join(sys.argv[2:]) if invoked else "(called in-process)")
    for t in targets:
        if t.model is None:
            t.model = asyncio.run(resolve_model(t, opts))
    workloads = [build_workload(spec, tok, variant=i) for i in range(len(points))]
    warmups = warmup_requests(spec, tok, args.num_warmups)
    load = describe(points[0].request_rate, points[0].burstiness, points[0].max_concurrency)
    print(f"sluice bench: {spec.name} workload, {spec.num_requests} requests per run, seed {spec.seed}; "
          f"{_lengths(workloads[0])}")
    print(f"  endpoint /v1/{'chat/' if opts.endpoint_type == 'chat' else ''}completions, temperature "
          f"{opts.temperature:g}, ignore_eos {'on' if opts.ignore_eos else 'off'}; tokenizer {tok_dir}")
    print(f"  load: {load}" + (f" ... {len(points)} points" if len(points) > 1 else "")
          + f"; {args.num_warmups} warm-up requests per run")
    print(f"  servers: {', '.join(f'{t.name} = {t.url} ({t.model})' for t in targets)}")
    la = load_average()
    print(f"  machine: {cpu_name()}, {os.cpu_count()} CPUs" + (f", load average {la[0]:.2f}" if la else ""),
          flush=True)

    slo = args.slo_ttft_ms is not None or args.slo_tpot_ms is not None
    runs = []
    t0 = time.perf_counter()
    # Interleaved: at each load point every server in turn, so a ratio compares runs minutes apart.
    for point, reqs in zip(points, workloads, strict=True):
        for t in targets:
            r = run_point(t, t.model, reqs, warmups, point, opts, spec.seed, args.progress)
            r.summary = summarize(r.records, r.duration_s, args.slo_ttft_ms, args.slo_tpot_ms)
            if spec.name == "echo":
                want = {q.index: q.expected_output for q in reqs}
                ok = [x for x in r.records if x.success]
                r.summary["echo_exact_match"] = (sum(x.output_text.strip() == want[x.index].strip() for x in ok)
                                                 / len(ok)) if ok else None
            runs.append(r)
            print(report.run_block(r), flush=True)
            for note in _notes(r, opts, spec.name):
                print(f"note: {note}", flush=True)
    elapsed = time.perf_counter() - t0

    print(f"\n## {spec.name} workload, {spec.num_requests} requests per run\n\ncommand: `{cmd}` "
          f"({elapsed:.0f}s)\n")
    print(report.runs_table(runs, slo))
    ratio_rows = report.ratios(runs, slo)
    if ratio_rows:
        print("\nRatios (first server's value / each other's; > 1 is more throughput or more latency):\n")
        print(report.ratios_table(ratio_rows))

    if args.json:
        doc = {
            "command": cmd, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "elapsed_s": elapsed,
            "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(), "load_average_at_end": load_average()},
            "workload": spec.describe() | {"tokenizer": str(tok_dir)},
            "request": {"endpoint_type": opts.endpoint_type, "temperature": opts.temperature,
                        "ignore_eos": opts.ignore_eos, "extra_body": opts.extra_body},
            "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
            "num_warmups": args.num_warmups,
            "runs": [report.run_json(r) for r in runs],
            "ratios": ratio_rows,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str))
        print(f"\nwrote {args.json}")
    if args.plot_dir:
        from . import plots

        d = Path(args.plot_dir)
        d.mkdir(parents=True, exist_ok=True)
        title = f"sluice bench: {spec.name}, {spec.num_requests} requests/run"
        written = [plots.latency_cdfs(runs, d / "latency_cdf.png", title)]
        swept = _swept(points)
        if swept:
            written.append(plots.sweep(runs, swept, d / f"sweep_{swept}.png", title))
        print("wrote " + ", ".join(map(str, written)))
    return 1 if any(r.summary["completed"] == 0 for r in runs) else 0


def _swept(points) -> str | None:
    if len({p.request_rate for p in points}) > 1:
        return "request_rate"
    if len({p.max_concurrency for p in points}) > 1:
        return "max_concurrency"
    return None


def _notes(run, opts, workload: str) -> list[str]:
    s = run.summary
    notes = []
    cached = s.get("cached_prompt_tokens") or 0
    if workload != "shared-prefix" and cached > 0.5 * s["total_input_tokens"]:
        notes.append(f"{run.target}: {100 * cached / s['total_input_tokens']:.0f}% of prompt tokens came from its "
                     "prefix cache: it has served these prompts before (the same --seed and load point earlier?). "
                     "Restart it or change --seed for cold-cache figures")
    if opts.ignore_eos and s["short_outputs"]:
        notes.append(f"{run.target}: {s['short_outputs']} requests got fewer tokens than max_tokens: the server "
                     "does not honour ignore_eos, so its throughput is for less work")
    if s["output_tokens_counted_from_chunks"]:
        notes.append(f"{run.target}: sent no usage; output tokens counted from stream chunks")
    if run.other_cpu_pct is not None and run.other_cpu_pct > 5:
        notes.append(f"other processes used {run.other_cpu_pct:.0f}% of the machine's CPU during this run: "
                     "its figures are skewed by contention")
    return notes
