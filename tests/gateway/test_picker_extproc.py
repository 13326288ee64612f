"""Sluice's endpoint picker driven by a gateway built from Envoy's own protocol definitions: e2e/extproc_gateway
(go-control-plane's generated ext-proc types, GIE's full-duplex streamed bodies) asks `sluice gateway
--endpoint-picker` (a subprocess, as deployed) for every request and forwards it where the picker says. What
passes here passes between real processes speaking the real wire format: a field number wrong in
ext_proc.proto, or a message out of the order Envoy expects, fails here."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from extproc_gateway import run_extproc_gateway
from gateway_fakes import FakeBackendProcess, GatewayProcess, chat
from servers import SERVED_NAME, free_port

SERVED = "x-gateway-destination-endpoint-served"


def hostport(url: str) -> str:
    return url.removeprefix("http://")


@pytest.fixture(scope="module")
def fakes() -> Iterator[list[FakeBackendProcess]]:
    backends = [FakeBackendProcess(n, chunks=3, delay=0.05) for n in "ABC"]
    yield backends
    for b in backends:
        b.stop()


@pytest.fixture(scope="module")
def picker(fakes: list[FakeBackendProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The picker's ext-proc address (host:port)."""
    port = free_port()
    gw = GatewayProcess(["--endpoint-picker", "--picker-port", str(port), "--health-interval", "0.2",
                         *(a for b in fakes for a in ("--backend", f"m={b.url}"))],
                        tmp_path_factory.mktemp("picker") / "picker.log")
    yield f"127.0.0.1:{port}"
    gw.stop()


def test_every_request_goes_where_the_picker_says_and_a_prefix_sticks(fakes, picker) -> None:
    by_name = {hostport(b.url): b.name for b in fakes}
    with run_extproc_gateway(["--epp", picker, "--body-chunk", "100"]) as url:
        seen: dict[str, set[str]] = {}
        for i in range(12):
            prompt = f"system prompt number {i % 4}: " + "be brief. " * 30  # longer than one body chunk
            r = httpx.post(f"{url}/v1/chat/completions", json=chat("m", prompt), timeout=30)
            assert r.status_code == 200, r.text
            served = r.headers[SERVED]
            assert r.json()["backend"] == by_name[served]  # the backend that answered is the one picked
            seen.setdefault(prompt, set()).add(served)
        assert all(len(s) == 1 for s in seen.values()), seen  # the same prefix, the same backend
        assert len({next(iter(s)) for s in seen.values()}) > 1  # and the prefixes spread


def test_a_stream_arrives_chunk_by_chunk_through_the_picker(fakes, picker) -> None:
    with run_extproc_gateway(["--epp", picker]) as url, httpx.stream(
            "POST", f"{url}/v1/chat/completions", json=chat("m", "stream me", stream=True), timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert len(events) == 4 and events[-1] == "data: [DONE]"  # 3 chunks and the end, none lost or merged
    assert all(json.loads(e[6:])["backend"] for e in events[:-1])


def test_the_picker_refusals_reach_the_client_with_their_body(picker) -> None:
    with run_extproc_gateway(["--epp", picker]) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json=chat("not-served", "hi"), timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = httpx.post(f"{url}/v1/chat/completions", content=b"{oops", timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_the_subset_hint_is_honoured(fakes, picker) -> None:
    only = hostport(fakes[2].url)
    with run_extproc_gateway(["--epp", picker, "--subset", only]) as url:
        for i in range(6):
            r = httpx.post(f"{url}/v1/chat/completions", json=chat("m", f"prompt {i}"), timeout=30)
            assert r.status_code == 200 and r.headers[SERVED] == only
    with run_extproc_gateway(["--epp", picker, "--subset", "127.0.0.1:1"]) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json=chat("m", "x"), timeout=30)
        assert r.status_code == 503 and "subset" in r.json()["error"]["message"]


@pytest.mark.slow
def test_the_openai_client_through_a_gie_gateway_and_the_picker_to_a_real_engine(start_server, tmp_path: Path) -> None:
    import openai

    engine = start_server()
    port = free_port()
    gw = GatewayProcess(["--endpoint-picker", "--picker-port", str(port), "--backend", f"{SERVED_NAME}={engine.url}"],
                        tmp_path / "picker.log")
    try:
        with run_extproc_gateway(["--epp", f"127.0.0.1:{port}"]) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            assert [m.id for m in client.models.list().data] == [SERVED_NAME]  # a GET: picked on headers alone
            stream = client.chat.completions.create(model=SERVED_NAME, max_tokens=8, temperature=0, stream=True,
                                                    messages=[{"role": "user", "content": "Say hello."}])
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            direct = openai.OpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0, timeout=60)
            expected = direct.chat.completions.create(model=SERVED_NAME, max_tokens=8, temperature=0,
                                                      messages=[{"role": "user", "content": "Say hello."}])
            assert text and text == expected.choices[0].message.content  # greedy: the engine's own answer
            with pytest.raises(openai.BadRequestError) as bad:  # the engine's 400 passes through both
                client.chat.completions.create(model=SERVED_NAME, max_tokens=-1,
                                               messages=[{"role": "user", "content": "x"}])
            assert "max_tokens" in str(bad.value)
    finally:
        gw.stop()
