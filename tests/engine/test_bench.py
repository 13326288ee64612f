"""`sluice bench` (issue 4): workload generators, arrival processes, metric definitions against hand-made
timings, the streaming client against a scripted SSE server, and end-to-end runs against a real
`sluice serve` (alone, --compare with a sweep, and the HF static-batching peer)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import httpx
import pytest

from sluice_engine.bench.arrivals import arrival_times
from sluice_engine.bench.client import RequestOptions, _chunk_output, parse_target, send
from sluice_engine.bench.metrics import RequestRecord, percentile, summarize
from sluice_engine.bench.workloads import ECHO_INSTRUCTION, BenchRequest, WorkloadSpec, build_workload
from sluice_engine.entrypoints.cli import main
from sluice_engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


# -- workloads -----------------------------------------------------------------------------------
def test_workloads_are_seeded(tok):
    spec = WorkloadSpec("conversational", num_requests=16, seed=3)
    a, b = build_workload(spec, tok), build_workload(spec, tok)
    assert [(r.prompt, r.max_tokens) for r in a] == [(r.prompt, r.max_tokens) for r in b]
    fresh = build_workload(spec, tok, variant=1)  # a sweep's next point: new text, the same lengths
    assert [r.max_tokens for r in fresh] == [r.max_tokens for r in a]
    assert [r.prompt_len for r in fresh] == [r.prompt_len for r in a]
    assert all(x.prompt != y.prompt for x, y in zip(a, fresh, strict=True))
    other = build_workload(WorkloadSpec("conversational", num_requests=16, seed=4), tok)
    assert [r.max_tokens for r in other] != [r.max_tokens for r in a]


def test_conversational_lengths_are_lognormal_and_clipped(tok):
    spec = WorkloadSpec("conversational", num_requests=400, input_len=60, output_len=40, output_sigma=0.8)
    reqs = build_workload(spec, tok)
    p = [r.prompt_len for r in reqs]
    o = [r.max_tokens for r in reqs]
    assert all(len(ids(tok, r.prompt)) == r.prompt_len for r in reqs[:50])
    assert 0.85 * 60 <= statistics.median(p) <= 1.15 * 60
    assert 0.85 * 40 <= statistics.median(o) <= 1.15 * 40
    assert min(o) >= 10 and max(o) <= 160 and min(p) >= 15 and max(p) <= 240  # clip: median/4 .. median*4
    assert statistics.fmean(o) > statistics.median(o)  # right-skewed: a long tail
    # log-lengths spread with the sigma asked for
    assert 0.65 <= statistics.pstdev(math.log(x) for x in o) <= 0.9


def test_fixed_lengths_are_exact(tok):
    reqs = build_workload(WorkloadSpec("fixed", num_requests=40, input_len=37, output_len=9), tok)
    assert {len(ids(tok, r.prompt)) for r in reqs} == {37}
    assert {r.prompt_len for r in reqs} == {37} and {r.max_tokens for r in reqs} == {9}
    assert len({r.prompt for r in reqs}) == 40


def test_shared_prefix_structure(tok):
    spec = WorkloadSpec("shared-prefix", num_requests=12, num_prefixes=3, prefix_len=200, suffix_len=16,
                        output_len=5)
    reqs = build_workload(spec, tok)
    groups: dict[int, list[list[int]]] = defaultdict(list)
    for r in reqs:
        groups[r.group].append(ids(tok, r.prompt))
        assert r.max_tokens == 5
    assert sorted(groups) == [0, 1, 2] and all(len(g) == 4 for g in groups.values())
    heads = set()
    for prompts in groups.values():
        assert len({tuple(p[:200]) for p in prompts}) == 1  # the whole prefix, token for token
        assert len({tuple(p[200:]) for p in prompts}) == len(prompts)  # unique suffixes
        assert all(200 + 14 <= len(p) <= 200 + 20 for p in prompts)
        heads.add(tuple(prompts[0][:200]))
    assert len(heads) == 3
    assert [r.group for r in reqs] != [i % 3 for i in range(12)]  # shuffled, not round-robin order


def test_echo_asks_for_its_own_text(tok):
    reqs = build_workload(WorkloadSpec("echo", num_requests=8, input_len=50), tok)
    for r in reqs:
        assert r.prompt.startswith(ECHO_INSTRUCTION) and r.prompt.endswith(r.expected_output)
        assert r.max_tokens == len(ids(tok, r.expected_output))


def test_jsonl_workload(tok, tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"prompt": "Hello there", "max_tokens": 7}\n\n'
                 '{"messages": [{"role": "user", "content": "Hi"}]}\n')
    reqs = build_workload(WorkloadSpec("jsonl", num_requests=5, output_len=3, dataset=str(f)), tok)
    assert [r.max_tokens for r in reqs] == [7, 3, 7, 3, 7]  # cycled; lines without max_tokens get --output-len
    assert reqs[1].messages == [{"role": "user", "content": "Hi"}] and reqs[0].messages is None
    f.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="prompts.jsonl:1"):
        build_workload(WorkloadSpec("jsonl", num_requests=1, dataset=str(f)), tok)


# -- arrivals ------------------------------------------------------------------------------------
def _gaps(rate: float, burstiness: float, n: int = 20000) -> list[float]:
    t = arrival_times(n, rate, burstiness, seed=1)
    return [b - a for a, b in zip(t, t[1:], strict=False)]


def test_poisson_arrivals_have_the_rate():
    gaps = _gaps(5.0, 1.0)
    assert arrival_times(3, 5.0)[0] == 0.0
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.03)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.05)  # exponential
    assert arrival_times(50, 5.0, seed=2) == arrival_times(50, 5.0, seed=2)
    assert arrival_times(4, math.inf) == [0.0] * 4


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_keeps_the_rate_and_sets_the_spread(burstiness):
    gaps = _gaps(2.0, burstiness)
    assert statistics.fmean(gaps) == pytest.approx(0.5, rel=0.05)
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)  # gamma(k): CV = 1/sqrt(k)


# -- metrics -------------------------------------------------------------------------------------
def _rec(i: int, ttft: float, gaps: list[float], tokens: int | None = None, ok: bool = True) -> RequestRecord:
    r = RequestRecord(i, max_tokens=8, prompt_tokens=10, success=ok, ttft_s=ttft, itl_s=gaps,
                      e2el_s=ttft + sum(gaps), output_tokens=tokens if tokens is not None else len(gaps) + 1)
    if not ok:
        r.error = "HTTP 503: busy"
    return r


def test_percentiles_interpolate_like_numpy():
    xs = [float(x) for x in range(1, 101)]
    assert percentile(xs, 50) == pytest.approx(50.5)
    assert percentile(xs, 90) == pytest.approx(90.1)
    assert percentile(xs, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) is None


def test_summary_from_hand_made_timings():
    records = [
        _rec(0, 0.100, [0.020, 0.020, 0.020]),  # 4 tokens: TPOT 20 ms
        _rec(1, 0.300, [0.050, 0.030]),  # 3 tokens: TPOT 40 ms
        _rec(2, 0.200, [0.010] * 3, tokens=7),  # 7 tokens in 4 chunks (speculative): TPOT = 30/6 = 5 ms
        _rec(3, 0.050, [], tokens=1),  # one token: no TPOT, no ITL
        _rec(4, 9.0, [1.0], ok=False),  # failed: counted as failed, in no latency
    ]
    s = summarize(records, duration_s=2.0, slo_ttft_ms=250, slo_tpot_ms=30)
    assert (s["completed"], s["failed"]) == (4, 1)
    assert s["total_output_tokens"] == 4 + 3 + 7 + 1 and s["total_input_tokens"] == 40
    assert s["output_throughput"] == pytest.approx(15 / 2.0)
    assert s["total_token_throughput"] == pytest.approx(55 / 2.0)
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["ttft_ms"]["mean"] == pytest.approx((100 + 300 + 200 + 50) / 4)
    assert s["ttft_ms"]["median"] == pytest.approx(150)
    assert s["ttft_ms"]["p99"] == pytest.approx(200 + 0.97 * 100)
    assert s["tpot_ms"]["mean"] == pytest.approx((20 + 40 + 5) / 3)
    assert s["tpot_ms"]["median"] == pytest.approx(20)
    assert s["itl_ms"]["mean"] == pytest.approx(1e3 * (0.06 + 0.08 + 0.03) / 8)  # gaps pooled
    assert s["itl_ms"]["median"] == pytest.approx(20)
    assert s["e2el_ms"]["median"] == pytest.approx((160 + 230) / 2)
    # SLO TTFT <= 250 ms and TPOT <= 30 ms: #0 yes, #1 no (TTFT 300), #2 yes, #3 yes (no TPOT), #4 failed
    assert s["good_requests"] == 3 and s["request_goodput"] == pytest.approx(1.5)
    assert s["slo_attainment"] == pytest.approx(3 / 5)
    assert s["short_outputs"] == 4 and s["errors"] == {"HTTP 503: busy": 1}
    assert "request_goodput" not in summarize(records, 2.0)


def test_chunk_rules_and_targets():
    assert _chunk_output({"text": "Hi", "finish_reason": None}, chat=False) == "Hi"
    assert _chunk_output({"text": "", "finish_reason": None}, chat=False) == ""  # a token, text pending
    assert _chunk_output({"text": "", "finish_reason": "length"}, chat=False) is None
    assert _chunk_output({"delta": {"role": "assistant", "content": ""}}, chat=True) is None  # preamble
    assert _chunk_output({"delta": {"role": "assistant", "content": "A"}}, chat=True) == "A"
    assert _chunk_output({"delta": {}, "finish_reason": "stop"}, chat=True) is None
    t = parse_target("hf=http://127.0.0.1:8001/v1/")
    assert (t.name, t.url) == ("hf", "http://127.0.0.1:8001")
    assert parse_target("http://h:1").name == "h:1"
    with pytest.raises(ValueError):
        parse_target("nope")


# -- the client against a scripted SSE server ----------------------------------------------------
def _script_server(script):
    """An aiohttp app whose /v1/completions streams `script(body)`: a list of (delay_s, payload|str)."""
    from aiohttp import web

    async def completions(request):
        body = await request.json()
        steps = script(body)
        if isinstance(steps, int):
            return web.json_response({"error": {"message": "busy"}}, status=steps)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for delay, payload in steps:
            await asyncio.sleep(delay)
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await resp.write(f"data: {data}\n\n".encode())
        return resp

    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions)])
    return app


def _chunk(text, finish=None):
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


async def _send_to(app, req: BenchRequest, opts: RequestOptions):
    import aiohttp
    from aiohttp import web

    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session:
            return await send(session, f"http://127.0.0.1:{port}", "m", req, opts, time.perf_counter())
    finally:
        await runner.cleanup()


def test_client_measures_a_stream():
    seen = {}

    def script(body):
        seen.update(body)
        return [(0.15, _chunk("A")), (0.05, _chunk("")), (0.05, _chunk("B", "length")),
                (0, {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 3,
                                              "prompt_tokens_details": {"cached_tokens": 4}}}), (0, "[DONE]")]

    rec = asyncio.run(_send_to(_script_server(script), BenchRequest(0, "p", 2, 3),
                               RequestOptions(ignore_eos=True, extra_body={"speculative": False})))
    assert seen["stream"] and seen["stream_options"] == {"include_usage": True} and seen["ignore_eos"]
    assert seen["speculative"] is False and seen["max_tokens"] == 3 and seen["prompt"] == "p"
    assert rec.success and rec.output_text == "AB" and rec.output_tokens == 3
    assert (rec.prompt_tokens, rec.cached_tokens, rec.output_tokens_from) == (11, 4, "usage")
    assert 0.14 <= rec.ttft_s < 0.4 and len(rec.itl_s) == 2 and all(0.04 <= g < 0.3 for g in rec.itl_s)
    assert rec.e2el_s >= rec.ttft_s + sum(rec.itl_s) - 1e-3
    assert rec.tpot_s == pytest.approx((rec.e2el_s - rec.ttft_s) / 2)


def test_client_without_usage_counts_chunks_and_reports_errors():
    no_usage = asyncio.run(_send_to(_script_server(lambda b: [(0, _chunk("x")), (0, _chunk("y", "stop")),
                                                               (0, "[DONE]")]),
                                    BenchRequest(0, "p", 1, 4), RequestOptions()))
    assert no_usage.success and no_usage.output_tokens == 2 and no_usage.output_tokens_from == "chunks"
    http = asyncio.run(_send_to(_script_server(lambda b: 503), BenchRequest(0, "p", 1, 4), RequestOptions()))
    assert not http.success and http.error.startswith("HTTP 503")
    midway = asyncio.run(_send_to(_script_server(lambda b: [(0, _chunk("x")), (0, {"error": {"message": "boom"}})]),
                                  BenchRequest(0, "p", 1, 4), RequestOptions()))
    assert not midway.success and "boom" in midway.error
    empty = asyncio.run(_send_to(_script_server(lambda b: [(0, "[DONE]")]), BenchRequest(0, "p", 1, 4),
                                 RequestOptions()))
    assert not empty.success and empty.error == "no output tokens in the stream"


def test_flag_errors_are_one_line(capsys):
    assert main(["bench", "--sweep", "1,2", "--max-concurrency", "1,2"]) == 2
    assert "sweep one thing at a time" in capsys.readouterr().err
    assert main(["bench", "--compare", "a=http://x:1", "--base-url", "http://y:1"]) == 2


# -- end to end ----------------------------------------------------------------------------------
def _bench(tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "bench.json"
    assert main(["bench", "--no-progress", "--json", str(out), *flags]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_bench_against_sluice_serve(start_server, tmp_path, capsys):
    server = start_server()
    doc = _bench(tmp_path, "--base-url", server.url, "--workload", "fixed", "--input-len", "24",
                 "--output-len", "4", "--num-requests", "4", "--max-concurrency", "2", "--num-warmups", "1",
                 "--slo-ttft-ms", "600000", "--slo-tpot-ms", "600000")
    printed = capsys.readouterr().out
    assert "Output token throughput (tok/s):" in printed and "Mean TTFT (ms):" in printed
    (run,) = doc["runs"]
    s = run["summary"]
    assert run["model"] == server.model and run["load"] == {"request_rate": "inf", "burstiness": 1.0,
                                                            "max_concurrency": 2}
    assert (s["completed"], s["failed"]) == (4, 0)
    assert s["total_output_tokens"] == 16 and s["short_outputs"] == 0  # ignore_eos: exactly max_tokens
    assert s["total_input_tokens"] == sum(r["prompt_tokens"] for r in run["requests"]) >= 4 * 24
    assert s["good_requests"] == 4 and s["request_goodput"] == pytest.approx(s["request_throughput"])
    assert 1 <= run["peak_concurrency"] <= 2
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert all(s[key][stat] > 0 for stat in ("mean", "median", "p90", "p99")), key
    for r in run["requests"]:
        assert r["success"] and r["output_tokens"] == 4 and len(r["itl_s"]) == 3
        assert 0 < r["ttft_s"] < r["e2el_s"] and r["cached_tokens"] is not None
    assert doc["workload"]["workload"] == "fixed" and doc["request"]["ignore_eos"] is True


@pytest.mark.slow
def test_compare_and_sweep_with_plots(start_server, tmp_path, capsys):
    server = start_server()
    doc = _bench(tmp_path, "--compare", f"a={server.url}", f"b={server.url}", "--endpoint-type", "chat",
                 "--input-len", "16", "--output-len", "3", "--output-max", "3", "--num-requests", "2",
                 "--max-concurrency", "1,2", "--num-warmups", "0", "--plot-dir", str(tmp_path / "plots"))
    printed = capsys.readouterr().out
    assert [(r["server"], r["load"]["max_concurrency"]) for r in doc["runs"]] == [("a", 1), ("b", 1), ("a", 2),
                                                                                 ("b", 2)]
    assert all(r["summary"]["completed"] == 2 for r in doc["runs"])
    assert [(x["numerator"], x["denominator"], x["load"]) for x in doc["ratios"]] == [
        ("a", "b", "concurrency 1"), ("a", "b", "concurrency 2")]
    assert all(x["output tok/s"] > 0 for x in doc["ratios"])
    assert "| a ÷ b | concurrency 1 |" in printed
    # The server on loopback is found by its port: its memory is in each run and the table.
    assert all(0 < r["server_rss_mib"] <= r["server_peak_rss_mib"] for r in doc["runs"])
    assert "server RSS MiB |" in printed
    for png in ("latency_cdf.png", "sweep_max_concurrency.png"):
        assert (tmp_path / "plots" / png).read_bytes()[:4] == b"\x89PNG"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_hf_static_peer(model_dir, tmp_path):
    port = _free_port()
    log = tmp_path / "hf.log"
    with open(log, "w") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "sluice_engine.bench.hf_server", "--model", str(model_dir),
                                 "--port", str(port), "--max-batch-size", "4", "--batch-wait-ms", "1000",
                                 "--threads", "1"], stdout=logf, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        doc = _bench(tmp_path, "--base-url", url, "--workload", "fixed", "--input-len", "12", "--output-len", "3",
                     "--num-requests", "3", "--num-warmups", "1", "--endpoint-type", "chat")
        (run,) = doc["runs"]
        assert run["summary"]["completed"] == 3 and run["summary"]["total_output_tokens"] == 9
        assert all(len(r["itl_s"]) == 2 for r in run["requests"])  # streamed per token
        assert httpx.get(f"{url}/health").json()["batches"] == 2  # the warm-up, then all three in one batch
        # This prompt's greedy answer is "No" then EOS: a row ends there unless it asked for ignore_eos.
        ask = {"messages": [{"role": "user", "content": "Reply with one word only: is the sky blue? yes or no"}],
               "max_tokens": 6, "temperature": 0}
        stops = httpx.post(f"{url}/v1/chat/completions", json=ask, timeout=120).json()
        assert (stops["usage"]["completion_tokens"], stops["choices"][0]["finish_reason"]) == (2, "stop")
        goes_on = httpx.post(f"{url}/v1/chat/completions", json=ask | {"ignore_eos": True}, timeout=120).json()
        assert (goes_on["usage"]["completion_tokens"], goes_on["choices"][0]["finish_reason"]) == (6, "length")
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_server_memory_of_processes():
    from sluice_engine.bench.machine import server_memory_mib

    rss, peak = server_memory_mib([os.getpid()])
    assert 10 < rss <= peak  # this test process: tens of MiB at least (torch is loaded)
    both = server_memory_mib([os.getpid(), os.getppid()])
    assert both[0] > rss
    assert server_memory_mib([]) is None
    assert server_memory_mib([2**22 + 12345]) is None  # no such process


def test_a_servers_processes_include_what_it_started():
    # sluice serve's engine core (and its ranks) run below the process that listens: their CPU is the server's,
    # not contention, and their memory is the server's.
    import subprocess
    import sys

    from sluice_engine.bench.machine import with_descendants

    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while len(with_descendants([child.pid])) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        family = with_descendants([os.getpid()])
        assert child.pid in family and os.getpid() in family
        assert len(with_descendants([child.pid])) == 2  # the child and the grandchild it started
    finally:
        for pid in with_descendants([child.pid])[::-1]:
            os.kill(pid, 9)
        child.wait()


def test_notes_flag_what_skews_a_run():
    from types import SimpleNamespace

    from sluice_engine.bench.cli import _notes

    s = summarize([_rec(0, 0.1, [0.02], tokens=2)], 1.0)
    s["cached_prompt_tokens"] = 9  # of 10 prompt tokens
    run = SimpleNamespace(target="x", summary=s, other_cpu_pct=40.0)
    notes = " | ".join(_notes(run, RequestOptions(ignore_eos=True), "conversational"))
    assert "prefix cache" in notes and "ignore_eos" in notes and "40%" in notes
    assert not any("prefix cache" in n for n in _notes(run, RequestOptions(), "shared-prefix"))
