"""Issue 13, fault-suite case 6: SIGTERM with 16 streams in flight. With a drain long enough, all 16
complete with `[DONE]`; with a shorter one, those still open end with an error event and `[DONE]`.
Either way /ready is 503 and new requests get 503 from the signal on, and the exit code is 0."""

import json
import signal
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.slow

STREAMS = 16


def open_streams(server, max_tokens: int) -> tuple[list[list[str]], list[threading.Thread], threading.Barrier]:
    events: list[list[str]] = [[] for _ in range(STREAMS)]
    started = threading.Barrier(STREAMS + 1)

    def run(i: int) -> None:
        body = {"model": server.model, "prompt": f"Story number {i}:", "max_tokens": max_tokens, "stream": True,
                "temperature": 0, "ignore_eos": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
            first = True
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events[i].append(line[6:])
                    if first:
                        first = False
                        started.wait()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    started.wait(timeout=120)  # every stream has its first token
    return events, threads, started


def signal_and_probe(server) -> None:
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    assert httpx.get(f"{server.url}/ready", timeout=5).status_code == 503
    r = httpx.post(f"{server.url}/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 2},
                   timeout=5)
    assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "shutting_down"


def test_sigterm_drains_in_flight_streams(start_server):
    server = start_server("--shutdown-timeout", "120")
    events, threads, _ = open_streams(server, max_tokens=48)
    signal_and_probe(server)
    for t in threads:
        t.join(120)
    for ev in events:
        assert ev[-1] == "[DONE]"
        assert not any('"error"' in e for e in ev)
        texts = [json.loads(e)["choices"][0] for e in ev[:-1] if json.loads(e)["choices"]]
        assert texts[-1]["finish_reason"] == "length"
    assert server.proc.wait(timeout=30) == 0


def test_sigterm_past_the_drain_ends_streams_with_an_error_and_done(start_server):
    server = start_server("--shutdown-timeout", "1")
    events, threads, _ = open_streams(server, max_tokens=2000)
    signal_and_probe(server)
    for t in threads:
        t.join(60)
    for ev in events:
        assert ev[-1] == "[DONE]"
        error = json.loads(ev[-2])
        assert error["error"]["code"] == "shutting_down" and "drain timeout" in error["error"]["message"]
    assert server.proc.wait(timeout=30) == 0
