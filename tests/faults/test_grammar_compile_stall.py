"""Issue 39, "Grammar compilation in the engine loop": a request whose grammar compiles slowly (a hostile
JSON schema, ~0.5-1 s on a CPU, under the compile timeout) costs the other tenants' streams nothing in the
engine loop. With `sluice serve` as it runs in production (the engine core in its own process), plain
streaming clients run throughout while hostile clients send such grammars (each schema distinct, so no cache
saves a compile) in every other phase: the time between the plain streams' tokens while a hostile request is
in flight has a p99 within 2x of the p99 while none is, every plain stream completes, and each hostile request
either completes or fails alone (a 400 naming its field).

The gaps are every inter-token gap of every plain stream (what `vllm bench serve` calls ITL), each counted as
"beside" if a hostile request was in flight during it. Phases alternate so a neighbour's load on a shared CI
box falls on both sides alike; a stall of the loop is one long gap per stream, and the hostile clients reach
the core often enough for those to be over 1% of the gaps."""

import json
import statistics
import threading
import time
import uuid

import httpx
import pytest

pytestmark = pytest.mark.slow

CLIENTS = 3
BOMBERS = 2
MAX_TOKENS = 32
# 8 s phases gave ~1,900 gaps on a busy 2-core box, 6 s ~1,400. At 5 s a loaded run (hostile requests of 10-15 s,
# spilling into the next phase) kept only 142 gaps with none in flight, near the 100 asserted.
PHASE_S = 6.0
PHASES = 6  # off, on, off, on, off, on


def hostile_schema(width: int = 20) -> dict:
    """Eight required strings each matching [a-z]{1,width}: xgrammar expands every bounded repetition into
    width states and precomputes the tokens each allows. Alone, on a busy 2-core AMD EPYC: ~0.4-1.2 s per
    compile at width 20 (40: 0.8-1.4 s, 60: 1.6-2.1 s, 100: 3.5 s), under the 10 s compile timeout even at
    nice 19 beside a running decode. A fresh tag makes every schema new."""
    tag = uuid.uuid4().hex[:8]
    props = {f"f{i}_{tag}": {"type": "string", "pattern": f"[a-z]{{1,{width}}}"} for i in range(8)}
    return {"type": "object", "properties": props, "required": list(props)}


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--max-model-len", "512", "--max-num-seqs", "8")


def stream_once(server, http: httpx.Client) -> list[float]:
    """One streaming completion; the arrival time of each chunk that carries a token."""
    times: list[float] = []
    body = {"model": server.model, "prompt": "Count from one to a hundred:", "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with http.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("choices"):
                times.append(time.monotonic())
    assert len(times) == MAX_TOKENS, len(times)
    return times


def run_phases(server) -> tuple[list[tuple[float, float]], list[tuple[float, float]], list[tuple[int, float]]]:
    """CLIENTS plain streaming clients, one request after another, through PHASES phases of PHASE_S; BOMBERS
    clients send slow grammars, one after another, in the odd phases. Every inter-token gap of the plain
    streams and every hostile request, as (start, end), and each hostile request's status."""
    gaps: list[tuple[float, float]] = []
    hostile: list[tuple[float, float]] = []
    statuses: list[tuple[int, float]] = []
    errors: list[BaseException] = []
    t0 = time.monotonic()
    deadline = t0 + PHASES * PHASE_S
    lock = threading.Lock()

    def plain() -> None:
        try:
            with httpx.Client() as http:
                while time.monotonic() < deadline:
                    times = stream_once(server, http)
                    with lock:
                        gaps.extend(zip(times, times[1:], strict=False))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    def bomber() -> None:
        try:
            with httpx.Client() as http:
                for phase in range(1, PHASES, 2):
                    time.sleep(max(0.0, t0 + phase * PHASE_S - time.monotonic()))
                    while time.monotonic() < t0 + (phase + 1) * PHASE_S - 1:
                        start = time.monotonic()
                        r = http.post(f"{server.url}/v1/completions", timeout=120, json={
                            "model": server.model, "prompt": "Fill in the form:", "max_tokens": 8,
                            "temperature": 0, "guided_json": hostile_schema()})
                        assert r.status_code in (200, 400), r.text
                        if r.status_code == 400:  # it fails alone: its own error, naming its field
                            assert r.json()["error"]["param"] == "guided_json", r.text
                        with lock:
                            hostile.append((start, time.monotonic()))
                            statuses.append((r.status_code, time.monotonic() - start))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=plain) for _ in range(CLIENTS)]
    threads += [threading.Thread(target=bomber) for _ in range(BOMBERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=PHASES * PHASE_S + 180)
    assert not errors, errors
    return gaps, hostile, statuses


def p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[98]


# NOTE: on a quiet machine this failed until xgrammar's compiler was made single-threaded (structured/grammar.py):
# its own pool of 8 worker threads ran at normal priority beside the engine's threads (p99 351 vs 77 ms in a
# fresh-clone CI run on a 2-core AMD EPYC; 124 vs 110 ms with max_threads=1).
def test_slow_grammars_do_not_stall_other_streams(server, probe, assert_settled):
    expected = probe(server)
    # Warm: the first steps of a fresh server are not the steady state, and the first grammar imports xgrammar
    # and indexes the vocabulary in both processes (once per server, not what this case is about).
    r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "model": server.model, "prompt": "hi", "max_tokens": 2, "guided_regex": "[a-z]+"})
    assert r.status_code == 200, r.text
    for _ in range(2):
        probe(server)
    gaps, hostile, statuses = run_phases(server)
    beside = [b - a for a, b in gaps if any(a < end and b > start for start, end in hostile)]
    alone = [b - a for a, b in gaps if not any(a < end and b > start for start, end in hostile)]
    assert len(beside) >= 100 and len(alone) >= 100, (len(beside), len(alone))
    report = (f"inter-token gap p99 {p99(beside) * 1e3:.0f} ms beside slow grammars vs {p99(alone) * 1e3:.0f} ms "
              f"without (max {max(beside) * 1e3:.0f} vs {max(alone) * 1e3:.0f} ms, median "
              f"{statistics.median(beside) * 1e3:.0f} vs {statistics.median(alone) * 1e3:.0f} ms; {len(beside)} vs "
              f"{len(alone)} gaps); hostile requests (status, s): {[(s, round(t, 1)) for s, t in statuses]}")
    print(report)
    assert p99(beside) <= 2 * p99(alone), report
    assert_settled(server, expected)
