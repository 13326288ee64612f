"""Fault case: the engine-core process dies (OOM killer, a segfault in a kernel) while streams are open.

Every open stream must end with an error event naming the engine (never a silent cut or a hang), /health
must turn 503, and `sluice serve` must exit non-zero so the pod is restarted."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from servers import engine_core_pid

pytestmark = pytest.mark.slow


def test_a_dead_core_fails_open_streams_and_stops_the_server(start_server) -> None:
    server = start_server()
    events: list[list[str]] = [[] for _ in range(3)]

    def stream(i: int) -> None:
        body = {"model": server.model, "prompt": f"Story {i}:", "max_tokens": 2000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events[i].append(line[6:])
        except httpx.HTTPError as e:  # a cut connection is what this test must not see
            events[i].append(f"cut: {e!r}")

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not all(len(e) >= 2 for e in events) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(len(e) >= 2 for e in events), "the streams never started"
    os.kill(engine_core_pid(server), signal.SIGKILL)
    health = None
    end = time.monotonic() + 5
    while time.monotonic() < end:  # /health says so until the server stops (about a second later)
        try:
            health = httpx.get(f"{server.url}/health", timeout=2)
        except httpx.HTTPError:
            break
        if health.status_code == 503:
            break
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=30)
    assert health is not None and health.status_code == 503 and health.json()["status"] == "dead"
    for e in events:
        err = json.loads(e[-1])
        assert "error" in err and "engine core process exited" in err["error"]["message"], err
    assert server.proc.wait(timeout=30) != 0
