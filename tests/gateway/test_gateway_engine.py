"""The gateway in front of real `sluice serve` engines (SmolLM2), both as subprocesses, on loopback.

- Scale from zero: the endpoint has no backend; a request is held, then 100 more; the test starts an
  engine (as KEDA would scale the Deployment) and lists it (as its EndpointSlice would); all 101 are
  answered, none dropped.
- A backend killed mid-run: requests it had not sent anything for go to the other backend, streams it was
  serving end with an error event, nothing hangs.
- A LoRA adapter (PEFT, random weights) by its name through the openai client: held from zero beside a request
  for the base model, answered by `sluice serve --enable-lora` on the adapter.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
from gateway_fakes import GatewayProcess
from servers import SERVED_NAME, ServerProcess

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]


def write_backends(path: Path, urls: list[str], adapters: list[str] | None = None) -> None:
    tmp = path.with_suffix(".tmp")
    endpoint = {"model": SERVED_NAME, "name": "default/smollm2", "serving": urls, "adapters": adapters or []}
    tmp.write_text(json.dumps({"endpoints": [endpoint]}))
    tmp.replace(path)  # atomically, as a ConfigMap mount swaps it


def start_engine(model_dir: Path, tmp_path: Path, name: str, *flags: str) -> ServerProcess:
    """Started, not waited for: the gateway is what waits. A small KV cache starts faster (and is plenty)."""
    return ServerProcess(["--model", str(model_dir), "--served-model-name", SERVED_NAME, "--kv-cache-memory",
                          "256MiB", *flags], tmp_path / f"{name}.log")


def chat(i: int, **kw) -> dict:
    return {"model": SERVED_NAME, "messages": [{"role": "user", "content": f"Say hello to person number {i}."}],
            "max_tokens": 4, "temperature": 0, **kw}


async def send(c: httpx.AsyncClient, body: dict) -> tuple[int, str]:
    """(status, text): the JSON answer's message, or a stream's concatenated deltas plus its last line."""
    if not body.get("stream"):
        r = await c.post("/v1/chat/completions", json=body)
        return r.status_code, r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text
    text, last = "", ""
    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            if line.startswith("data:"):
                last = line
    return r.status_code, text + "|" + last


async def pending(gw: GatewayProcess) -> float:
    m = await asyncio.to_thread(gw.metrics)
    return m.get('sluice_gateway_pending_requests{endpoint="default/smollm2"}', 0.0)


async def wait_pending(gw: GatewayProcess, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while await pending(gw) != n:
        assert time.monotonic() < deadline, f"never {n} held (now {await pending(gw)})"
        await asyncio.sleep(0.1)


async def test_scale_from_zero_holds_and_answers_every_request(model_dir, tmp_path):
    backends = tmp_path / "backends.json"
    write_backends(backends, [])  # scaled to zero: the endpoint exists, no pod does
    gw = await asyncio.to_thread(GatewayProcess, ["--backends-file", str(backends), "--max-held", "200",
                                                  "--hold-timeout", "300"], tmp_path / "gateway.log")
    engine: ServerProcess | None = None
    try:
        # httpx keeps at most 100 connections by default: the 101st would wait in the client, not the gateway.
        async with httpx.AsyncClient(base_url=gw.url, timeout=300, limits=httpx.Limits(max_connections=None)) as c:
            # One request at zero replicas: held.
            first = asyncio.create_task(send(c, chat(0)))
            await wait_pending(gw, 1)
            await asyncio.sleep(0.5)
            assert not first.done()
            # 100 more during the cold start, a quarter of them streaming: all held.
            bodies = [chat(i, stream=i % 4 == 0) for i in range(1, 101)]
            burst = [asyncio.create_task(send(c, b)) for b in bodies]
            await wait_pending(gw, 101)
            # KEDA scales 0 -> 1: the pod shows up, not ready until its model is loaded.
            t0 = time.monotonic()
            engine = start_engine(model_dir, tmp_path, "engine")
            write_backends(backends, [engine.url])
            status, text = await asyncio.wait_for(first, 240)
            assert status == 200 and text
            results = await asyncio.wait_for(asyncio.gather(*burst), 240)
            print(f"cold start to 101 answers: {time.monotonic() - t0:.1f}s")
        assert [s for s, _ in results] == [200] * 100, [r for r in results if r[0] != 200][:3]
        for body, (_, text) in zip(bodies, results, strict=True):
            assert text.strip("|")
            if body["stream"]:
                assert text.endswith("|data: [DONE]")
        m = gw.metrics()
        assert m['sluice_gateway_requests_total{endpoint="default/smollm2",outcome="ok"}'] == 101
        assert m['sluice_gateway_pending_requests{endpoint="default/smollm2"}'] == 0
        assert m['sluice_gateway_hold_seconds_count{endpoint="default/smollm2"}'] == 101
        assert not any(k.startswith("sluice_gateway_requests_total") and "ok" not in k and v for k, v in m.items())
    finally:
        if engine:
            engine.stop()
        gw.stop()


async def test_backend_killed_mid_run(model_dir, tmp_path):
    a, b = start_engine(model_dir, tmp_path, "a"), start_engine(model_dir, tmp_path, "b")
    await asyncio.gather(asyncio.to_thread(a.wait_ready), asyncio.to_thread(b.wait_ready))
    gw = await asyncio.to_thread(GatewayProcess, ["--backend", f"{SERVED_NAME}={a.url}", "--backend",
                                                  f"{SERVED_NAME}={b.url}", "--routing", "least-loaded",
                                                  "--debug-headers"], tmp_path / "gateway.log")
    long = {"max_tokens": 32, "ignore_eos": True}
    try:
        async with httpx.AsyncClient(base_url=gw.url, timeout=120) as c:
            # Streams: wait for each one's first token, so it is committed to its backend.
            started: list[asyncio.Event] = [asyncio.Event() for _ in range(4)]
            backend_of: dict[int, str] = {}

            async def stream(i: int) -> list[str]:
                lines = []
                async with c.stream("POST", "/v1/chat/completions", json=chat(i, stream=True, **long)) as r:
                    backend_of[i] = r.headers["x-sluice-backend"]
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            lines.append(line)
                            started[i].set()
                return lines

            streams = [asyncio.create_task(stream(i)) for i in range(4)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            whole = [asyncio.create_task(send(c, chat(10 + i, **long))) for i in range(4)]  # nothing sent yet
            await asyncio.sleep(0.5)  # they reach the engines
            a.proc.kill()  # SIGKILL: no goodbye
            after = [asyncio.create_task(send(c, chat(20 + i))) for i in range(3)]
            stream_lines = await asyncio.wait_for(asyncio.gather(*streams), 120)  # nothing hangs
            whole_results = await asyncio.wait_for(asyncio.gather(*whole), 120)
            after_results = await asyncio.wait_for(asyncio.gather(*after), 120)

        on_a = [i for i in range(4) if backend_of[i] == a.url]
        assert on_a and len(on_a) < 4  # least-loaded split them
        for i, lines in enumerate(stream_lines):
            if i in on_a:  # cut off: a clean OpenAI-shaped error event ends the stream
                err = json.loads(lines[-1][6:])["error"]
                assert err["code"] == "backend_failed" and "incomplete" in err["message"]
            else:
                assert lines[-1] == "data: [DONE]"
        # Requests with nothing sent yet went to the surviving backend.
        assert [s for s, _ in whole_results + after_results] == [200] * 7
        m = gw.metrics()
        key = 'endpoint="smollm2"'
        assert m[f'sluice_gateway_requests_total{{{key},outcome="backend_failed"}}'] == len(on_a)
        assert m[f'sluice_gateway_requests_total{{{key},outcome="ok"}}'] == 4 - len(on_a) + 7
        assert m.get(f"sluice_gateway_retries_total{{{key}}}", 0) >= 1
        assert m[f'sluice_gateway_inflight_requests{{{key}}}'] == 0
        assert m[f'sluice_gateway_backends{{{key},role="serving",state="ready"}}'] == 1
    finally:
        gw.stop()
        a.stop()
        b.stop()


@pytest.fixture(scope="module")
def adapter_dir(hf_model, tmp_path_factory) -> Path:
    """A PEFT LoRA adapter on the bundled model: random, rank 8 on every projection, large enough to matter."""
    import copy

    import torch

    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = peft.get_peft_model(copy.deepcopy(hf_model), cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(10.0)
    d = tmp_path_factory.mktemp("sql-adapter")
    model.save_pretrained(d)
    return d


async def test_adapter_by_name_held_from_zero_through_the_openai_client(model_dir, adapter_dir, tmp_path):
    from openai import NotFoundError, OpenAI

    backends = tmp_path / "backends.json"
    write_backends(backends, [], adapters=["sql"])  # scaled to zero
    gw = await asyncio.to_thread(GatewayProcess, ["--backends-file", str(backends)], tmp_path / "gateway.log")
    engine: ServerProcess | None = None
    try:
        client = OpenAI(base_url=f"{gw.url}/v1", api_key="none", timeout=300, max_retries=0)
        listed = {m.id: getattr(m, "parent", None) for m in client.models.list().data}
        assert listed == {SERVED_NAME: None, "sql": SERVED_NAME}

        def ask(model: str):
            return client.chat.completions.create(model=model, max_tokens=8, temperature=0, messages=[
                {"role": "user", "content": "Write one SQL query that counts the rows of a table."}])

        on_adapter = asyncio.create_task(asyncio.to_thread(ask, "sql"))
        on_base = asyncio.create_task(asyncio.to_thread(ask, SERVED_NAME))
        await wait_pending(gw, 2)  # both held, in the one endpoint's demand
        with pytest.raises(NotFoundError):  # a name nobody lists is the gateway's 404, not held
            await asyncio.to_thread(ask, "legal")
        engine = start_engine(model_dir, tmp_path, "engine", "--enable-lora", "--lora-modules",
                              f"sql={adapter_dir}", "--max-lora-rank", "8")
        write_backends(backends, [engine.url], adapters=["sql"])
        adapter_answer, base_answer = await asyncio.wait_for(asyncio.gather(on_adapter, on_base), 240)
        assert adapter_answer.model == "sql" and base_answer.model == SERVED_NAME
        assert adapter_answer.choices[0].message.content != base_answer.choices[0].message.content
        # The engine's own answer for the adapter, asked directly: the gateway's was that one.
        direct = OpenAI(base_url=f"{engine.url}/v1", api_key="none", timeout=300, max_retries=0)
        again = direct.chat.completions.create(model="sql", max_tokens=8, temperature=0, messages=[
            {"role": "user", "content": "Write one SQL query that counts the rows of a table."}])
        assert again.choices[0].message.content == adapter_answer.choices[0].message.content
        m = gw.metrics()
        assert m['sluice_gateway_requests_total{endpoint="default/smollm2",outcome="ok"}'] == 2
        assert m['sluice_gateway_hold_seconds_count{endpoint="default/smollm2"}'] == 2
        assert m['sluice_gateway_pending_requests{endpoint="default/smollm2"}'] == 0
    finally:
        if engine:
            engine.stop()
        gw.stop()
