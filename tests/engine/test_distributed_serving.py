"""Issue 12, acceptance 1 and 4: `sluice serve` over several ranks -- tensor parallel 3, pipeline
parallel 2, and pipeline parallel 2 as two "nodes" (two `sluice serve` processes, node ranks 0 and 1
on 127.0.0.1) -- matches HF transformers through the real `openai` client (greedy tokens identical,
logprobs within 1e-3), streaming and concurrent, with prefix-cache hits, chunked prefill and
preemption under a small per-rank KV budget. And a rank killed mid-generation stops the whole group:
the stream ends with an error event, /health turns 503, the server exits non-zero."""

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI
from servers import engine_core_pid, free_port, stop_process
from test_server_parity import PROMPTS, check_all_at_once, reference  # noqa: F401 - reference is a fixture

pytestmark = pytest.mark.slow

# KV bytes per token of the bundled model (fp32, 30 layers, 3 KV heads of 64) on one rank of each
# layout: TP 3 holds one KV head, PP 2 holds 15 layers. 40 blocks of 16 tokens per rank force preemption.
FULL_KV_PER_TOKEN = 2 * 30 * 3 * 64 * 4
LAYOUTS = {
    "tp3": (["--tensor-parallel-size", "3"], FULL_KV_PER_TOKEN // 3),
    "pp2": (["--pipeline-parallel-size", "2"], FULL_KV_PER_TOKEN // 2),
    "2nodes-pp2": (["--pipeline-parallel-size", "2", "--nnodes", "2"], FULL_KV_PER_TOKEN // 2),
}


class WorkerNode:
    """`sluice serve --node-rank 1`: the second "node" (its ranks and /health, no API)."""

    def __init__(self, model_dir, flags: list[str], log_path):
        self.port = free_port()
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sluice_engine.entrypoints.cli", "serve", "--model", str(model_dir), "--port", str(self.port),
             "--node-rank", "1", *flags], stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def health(self) -> int:
        return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout_server(request, start_server, model_dir, tmp_path_factory):
    flags, kv_per_token = LAYOUTS[request.param]
    if "--nnodes" in flags:  # across "nodes" the port is given; one node picks a free one itself
        flags = [*flags, "--master-port", str(free_port())]
    node1 = None
    if "--nnodes" in flags:
        # Two "nodes" on one 2-core machine: one thread per rank (each node would otherwise take every
        # core for its one rank, and OpenMP workers spinning against each other cost ~10x).
        mp = pytest.MonkeyPatch()
        request.addfinalizer(mp.undo)
        mp.setenv("OMP_NUM_THREADS", "1")
        node1 = WorkerNode(model_dir, flags, tmp_path_factory.mktemp("node1") / "node1.log")
        flags = [*flags, "--node-rank", "0"]
    server = start_server(*flags, "--max-num-batched-tokens", "64", "--max-model-len", "512",
                          "--kv-cache-memory", str(40 * 16 * kv_per_token))
    yield request.param, server, node1
    server.stop()
    if node1 is not None:
        try:
            code = node1.proc.wait(timeout=60)  # rank 0 ends the group: node 1's ranks stop, it exits
        finally:
            node1.stop()
        assert code == 0, node1.log_path.read_text()  # cleanly


def test_layout_serves_like_hf(layout_server, reference):  # noqa: F811 - the fixture
    name, server, node1 = layout_server
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=600)
    if node1 is not None:
        assert node1.health() == 200
        r = httpx.get(f"http://127.0.0.1:{node1.port}/v1/models", timeout=2)
        assert r.status_code == 404  # a worker node serves no API
    # Concurrent: all prompts at once, a 64-token budget (chunked prefill), 40 blocks per rank (preemption).
    check_all_at_once(client, server.model, reference)
    m = server.metrics()
    assert m["sluice_num_preemptions_total"] > 0, "the KV budget was meant to force preemption"
    # Prefix caching: the long prompt twice in a row; the second finds its blocks in the cache.
    prompt, ref = PROMPTS[10], reference[10]

    def long_prompt() -> None:
        gen = client.completions.create(model=server.model, prompt=prompt, max_tokens=len(ref["gen"]), temperature=0,
                                        logprobs=1, extra_body={"return_tokens_as_token_ids": True})
        lp = gen.choices[0].logprobs
        assert [int(t.split(":")[1]) for t in lp.tokens] == ref["gen"]
        forced = ref["forced"][len(ref["ids"]) - 1 :]
        assert max(abs(a - b) for a, b in zip(lp.token_logprobs, forced, strict=True)) < 1e-3

    # Streaming: the same tokens as the non-streamed greedy request. Both beside the long prompt's first request
    # (every step of a rank costs its collectives, whatever the batch: three requests at once take the steps of one).
    kw = dict(model=server.model, prompt=PROMPTS[2], max_tokens=24, temperature=0)
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(long_prompt)
        whole = pool.submit(lambda: client.completions.create(**kw).choices[0].text)
        streamed = pool.submit(lambda: "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)
                                               if c.choices))
        first.result()
        assert streamed.result() == whole.result() and whole.result()
    hits = server.metrics()["sluice_prefix_cache_hits_total"]
    long_prompt()
    assert server.metrics()["sluice_prefix_cache_hits_total"] >= hits + 16 * (len(ref["ids"]) // 16)
    assert server.metrics()["sluice_num_gpus"] == 0  # CPU ranks hold no GPU


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def test_killed_rank_stops_the_group(start_server):
    """SIGKILL a worker rank mid-stream: an error event ends the stream, /health is 503 and the server
    exits non-zero, within 30 s."""
    server = start_server("--tensor-parallel-size", "3", "--master-port", str(free_port()))
    workers = _children(engine_core_pid(server))  # rank 0 runs in the engine core, which launched the others
    assert len(workers) == 2, workers
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=60)
    stream = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=400,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    events = iter(stream)
    next(events)  # generating
    os.kill(workers[-1], signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(Exception) as err:  # noqa: PT011 - the openai client raises APIError on an error event
        for _ in events:
            pass
    assert "generation failed" in str(err.value) or "engine" in str(err.value)
    saw_503 = False
    while server.proc.poll() is None and time.monotonic() - killed < 30:
        try:
            saw_503 |= httpx.get(f"{server.url}/health", timeout=1).status_code == 503
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    assert server.proc.wait(timeout=max(1, 30 - (time.monotonic() - killed))) != 0
    assert saw_503, server.log_path.read_text()[-3000:]
    assert all(not os.path.exists(f"/proc/{w}") or open(f"/proc/{w}/stat").read().split()[2] == "Z" for w in workers)
