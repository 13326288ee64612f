"""Tenants through `sluice gateway` (a subprocess) in front of a real `sluice serve` (SmolLM2), on loopback:
a tenant over its tokens-per-minute limit gets 429 with Retry-After naming the limit while another tenant is
answered; the tokens the gateway counts per tenant equal the engine's own usage totals; a stream that did
not ask for usage gets none (the gateway asked for it and took it out); with two gateway replicas that
follow each other on the peer port, a tenant's limit holds over both together."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest
from gateway_fakes import GatewayProcess
from servers import SERVED_NAME

pytestmark = pytest.mark.slow

KEYS = """
tenants:
  team-a:
    keys: [sk-team-a]
    limits: {tokensPerMinute: %(a_limit)d}
  team-b:
    keys: [sk-team-b]
"""
EP = "default/smollm2"


def write_files(tmp_path: Path, engine_url: str, a_limit: int) -> tuple[Path, Path]:
    keys, backends = tmp_path / "keys.yaml", tmp_path / "backends.json"
    keys.write_text(KEYS % {"a_limit": a_limit})
    backends.write_text(json.dumps({"endpoints": [{"model": SERVED_NAME, "name": EP, "serving": [engine_url]}]}))
    return keys, backends


def completion(c: httpx.Client, key: str, i: int, max_tokens: int = 8) -> httpx.Response:
    return c.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                  json={"model": SERVED_NAME, "prompt": f"Count to {i}:", "max_tokens": max_tokens,
                        "temperature": 0, "ignore_eos": True})


def tenant_tokens(m: dict[str, float], tenant: str) -> float:
    return sum(v for k, v in m.items()
               if k.startswith("sluice_gateway_tenant_tokens_total{") and f'tenant="{tenant}"' in k)


def engine_tokens(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items()
               if k.startswith(("sluice_prompt_tokens_total", "sluice_generation_tokens_total")))


def test_a_tenant_over_its_tokens_gets_429_and_counts_match_the_engine(start_server, tmp_path):
    engine = start_server()
    before = engine_tokens(engine.metrics())
    keys, backends = write_files(tmp_path, engine.url, a_limit=150)
    gw = GatewayProcess(["--backends-file", str(backends), "--api-keys-file", str(keys)], tmp_path / "gw.log")
    try:
        with httpx.Client(base_url=gw.url, timeout=60) as c:
            answered, refused = 0, None
            for i in range(20):
                r = completion(c, "sk-team-a", i)
                if r.status_code == 429:
                    refused = r
                    break
                assert r.status_code == 200, r.text
                answered += 1
            assert refused is not None and answered >= 3, f"team-a answered {answered} before a 429"
            err = refused.json()["error"]
            assert err["code"] == "rate_limit_exceeded"
            assert "tenant 'team-a' tokensPerMinute limit 150" in err["message"]
            assert 1 <= int(refused.headers["Retry-After"]) <= 60
            assert refused.headers["X-RateLimit-Limit-Tokens"] == "150"
        # team-b, by the openai client: answered while team-a is limited; streams with and without usage.
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="sk-team-b", max_retries=0)
        for i in range(3):
            out = client.completions.create(model=SERVED_NAME, prompt=f"Hello {i}", max_tokens=8, temperature=0)
            assert out.usage.completion_tokens == 8 or out.choices[0].finish_reason == "stop"
        chunks = list(client.chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, stream=True))
        assert chunks and all(ch.choices for ch in chunks), "a chunk without choices reached a client that asked none"
        assert all(ch.usage is None for ch in chunks)
        asked = list(client.chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, stream=True,
            stream_options={"include_usage": True}))
        assert not asked[-1].choices and asked[-1].usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{gw.url}/v1", api_key="sk-nobody", max_retries=0).completions.create(
                model=SERVED_NAME, prompt="x", max_tokens=1)

        m = gw.metrics()
        counted = tenant_tokens(m, "team-a") + tenant_tokens(m, "team-b")
        served = engine_tokens(engine.metrics()) - before
        print(f"gateway counted {counted:.0f} tokens, the engine served {served:.0f}")
        assert served > 0 and abs(counted - served) <= 0.01 * served
        assert tenant_tokens(m, "team-a") <= 150 + 40  # the last admitted request may settle above its estimate
        assert m[f'sluice_gateway_tenant_rate_limited_total{{endpoint="{EP}",limit="tokens",tenant="team-a"}}'] == 1
        assert m[f'sluice_gateway_tenant_requests_total{{endpoint="{EP}",tenant="team-b"}}'] == 5
        assert m[f'sluice_gateway_requests_total{{endpoint="{EP}",outcome="rate_limited"}}'] == 1
    finally:
        gw.stop()


def test_two_gateway_replicas_hold_one_limit_together(start_server, tmp_path):
    engine = start_server()
    keys, backends = write_files(tmp_path, engine.url, a_limit=200)
    from servers import free_port

    ports = [free_port(), free_port()]
    args = ["--backends-file", str(backends), "--api-keys-file", str(keys), "--peer-interval", "0.2"]
    one = GatewayProcess([*args, "--peer", f"http://127.0.0.1:{ports[1]}"], tmp_path / "gw1.log", ports[0])
    two = GatewayProcess([*args, "--peer", f"http://127.0.0.1:{ports[0]}"], tmp_path / "gw2.log", ports[1])
    try:
        clients = [httpx.Client(base_url=g.url, timeout=60) for g in (one, two)]
        statuses = []
        for i in range(24):  # alternating replicas; each sees the other's window within a peer interval
            r = completion(clients[i % 2], "sk-team-a", i)
            statuses.append(r.status_code)
            time.sleep(0.3)
        for c in clients:
            c.close()
        admitted = tenant_tokens(one.metrics(), "team-a") + tenant_tokens(two.metrics(), "team-a")
        print(f"statuses {statuses}; team-a admitted {admitted:.0f} tokens over two replicas (limit 200)")
        assert statuses.count(200) >= 4 and statuses.count(429) >= 10
        # Each replica alone would admit up to the limit: together they stay within it (plus the last
        # request's settling above its estimate).
        assert admitted <= 200 + 40
    finally:
        one.stop()
        two.stop()
