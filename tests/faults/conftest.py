"""Fixtures of the fault suite (issue 13). tests/conftest.py's start_server, model_dir and friends apply
here too; this adds the check every engine case ends with."""

import time
from collections.abc import Callable

import httpx
import pytest

PROBE_PROMPT = "The capital of France is"


def _probe(server) -> str:
    r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                   json={"model": server.model, "prompt": PROBE_PROMPT, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def probe() -> Callable[..., str]:
    """probe(server): a fresh greedy request's text (asserting it was a 200)."""
    return _probe


@pytest.fixture(scope="module")
def assert_settled() -> Callable[..., None]:
    """assert_settled(server, expected_text): running 0, waiting 0, KV usage 0 (no leaked blocks),
    /health 200, and a fresh greedy request answers expected_text (what it answered before the case)."""

    def check(server, expected_text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            m = server.metrics()
            idle = (m["sluice_num_requests_running"], m["sluice_num_requests_waiting"],
                    m["sluice_kv_cache_usage_perc"]) == (0, 0, 0)
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert idle, {k: m[k] for k in ("sluice_num_requests_running", "sluice_num_requests_waiting",
                                        "sluice_kv_cache_usage_perc")}
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 200, health.text
        assert _probe(server) == expected_text

    return check
