"""Engine metrics (issue 4, acceptance 1): every metric in docs/metrics.md, read from a real `sluice serve`
through the `openai` client, with values checked against what the requests did."""

import math
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from sluice_engine.entrypoints.llm import LLM
from sluice_engine.entrypoints.openai.server import build_app
from sluice_engine.metrics import PrometheusExporter
from sluice_engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

GAUGES = ["sluice_num_requests_running", "sluice_num_requests_waiting", "sluice_kv_cache_usage_perc",
          "sluice_kv_cache_num_blocks", "sluice_slo_ttft_seconds", "sluice_slo_tpot_seconds",
          "sluice_gpu_hour_usd", "sluice_num_gpus", "sluice_cuda_graphs_captured", "sluice_cuda_graphs_info"]
COUNTERS = ["sluice_prompt_tokens", "sluice_generation_tokens", "sluice_prefix_cache_queries",
            "sluice_prefix_cache_hits", "sluice_num_preemptions", "sluice_request_success", "sluice_request_slo",
            "sluice_request_goodput", "sluice_request_slo_met", "sluice_engine_busy_seconds",
            "sluice_spec_decode_num_drafts", "sluice_spec_decode_num_draft_tokens",
            "sluice_spec_decode_num_accepted_tokens", "sluice_spec_decode_num_accepted_tokens_per_pos"]
HISTOGRAMS = ["sluice_time_to_first_token_seconds", "sluice_inter_token_latency_seconds",
              "sluice_request_time_per_output_token_seconds", "sluice_e2e_request_latency_seconds",
              "sluice_request_queue_time_seconds", "sluice_request_prefill_time_seconds",
              "sluice_request_decode_time_seconds", "sluice_iteration_tokens"]
PER_REQUEST = ["sluice_e2e_request_latency_seconds", "sluice_request_queue_time_seconds",
               "sluice_request_prefill_time_seconds", "sluice_request_decode_time_seconds"]
BYTES_PER_TOKEN = 46080  # SmolLM2-135M K+V in float32: 2 x 30 layers x 3 KV heads x 64 x 4 bytes


class Scrape:
    """One /metrics read: sample value by (sample name, extra labels), plus the families' types."""

    def __init__(self, text: str, model: str, endpoint: str | None):
        self.types: dict[str, str] = {}
        self.values: dict[tuple[str, tuple], float] = {}
        self.buckets: dict[str, list[tuple[float, float]]] = {}
        for fam in text_string_to_metric_families(text):
            self.types[fam.name] = fam.type
            for s in fam.samples:
                labels = dict(s.labels)
                assert labels.pop("model_name") == model, s
                assert labels.pop("endpoint", None) == endpoint, s
                if s.name.endswith("_bucket"):
                    self.buckets.setdefault(s.name[: -len("_bucket")], []).append((float(labels["le"]), s.value))
                    continue
                self.values[(s.name, tuple(sorted(labels.items())))] = s.value

    def __call__(self, name: str, **labels) -> float:
        return self.values[(name, tuple(sorted(labels.items())))]


def scrape(server, endpoint: str | None) -> Scrape:
    return Scrape(httpx.get(f"{server.url}/metrics", timeout=30).text, server.model, endpoint)


def delta(after: Scrape, before: Scrape, name: str, **labels) -> float:
    return after(name, **labels) - before(name, **labels)


def wait_for(server, endpoint, cond, timeout: float = 60) -> Scrape:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(server, endpoint)
        if cond(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def idle(m: Scrape) -> bool:
    return m("sluice_num_requests_running") == 0 and m("sluice_num_requests_waiting") == 0


def unique_prompt(words: int) -> str:
    """A prompt no earlier request shares a block with (so no prefix-cache hits)."""
    return f"[{uuid.uuid4().hex}] " + " ".join(f"w{i}" for i in range(words))


# -- server A: trivially met SLO, an endpoint label from the flag, a GPU price -----------------------
EP_A = "ep-a"


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--max-model-len", "512", "--slo-ttft-ms", "600000", "--slo-tpot-ms", "600000",
                        "--gpu-hour-usd", "2.5", "--endpoint-label", EP_A)


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=600, max_retries=0)


def test_every_metric_is_exported_with_its_type_and_labels(server):
    m = scrape(server, EP_A)  # Scrape checks model_name and endpoint on every sample
    for name in GAUGES:
        assert m.types[name] == "gauge", name
    for name in COUNTERS:
        assert m.types[name] == "counter", name
    for name in HISTOGRAMS:
        assert m.types[name] == "histogram", name
    assert {k[1] for k in m.values if k[0] == "sluice_request_success_total"} == {
        (("finished_reason", r),) for r in ("stop", "length", "abort", "error")}
    assert m("sluice_slo_ttft_seconds") == 600 and m("sluice_slo_tpot_seconds") == 600
    assert m("sluice_gpu_hour_usd") == 2.5
    import torch

    assert m("sluice_num_gpus") == (1 if torch.cuda.is_available() else 0)
    graphs_info = {k[1]: v for k, v in m.values.items() if k[0] == "sluice_cuda_graphs_info"}
    if torch.cuda.is_available():
        assert graphs_info == {(("reason", ""), ("state", "on")): 1} and m("sluice_cuda_graphs_captured") > 0
    else:
        assert graphs_info == {(("reason", "graphs need CUDA (device is cpu)"), ("state", "off")): 1}
        assert m("sluice_cuda_graphs_captured") == 0
    assert m("sluice_kv_cache_num_blocks") > 0
    # GIE's names (test_gie_metrics.py); lora_requests_info only with --enable-lora, as vLLM's.
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:cache_config_info"):
        assert m.types[name] == "gauge", name
    assert "vllm:lora_requests_info" not in m.types
    # Speculative decoding is off: its counters exist at zero.
    for name in ("sluice_spec_decode_num_drafts_total", "sluice_spec_decode_num_draft_tokens_total",
                 "sluice_spec_decode_num_accepted_tokens_total"):
        assert m(name) == 0
    # Buckets: vLLM's, cumulative, the +Inf bucket equal to the count.
    ttft = m.buckets["sluice_time_to_first_token_seconds"]
    assert [b for b, _ in ttft][:3] == [0.001, 0.005, 0.01] and ttft[-1][0] == math.inf
    for name in HISTOGRAMS:
        b = m.buckets[name]
        assert all(x[1] <= y[1] for x, y in zip(b, b[1:], strict=False)), name
        assert b[-1][1] == m(f"{name}_count"), name


def test_completed_requests_counts_timings_and_goodput(server, client):
    n, max_tokens = 4, 6
    prompts = [unique_prompt(10 + 5 * i) for i in range(n)]
    before = scrape(server, EP_A)

    def run(prompt):
        return client.completions.create(model=server.model, prompt=prompt, max_tokens=max_tokens,
                                         temperature=0, extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(run, prompts))
    after = scrape(server, EP_A)
    prompt_tokens = sum(r.usage.prompt_tokens for r in results)
    assert all(r.usage.completion_tokens == max_tokens for r in results)

    assert delta(after, before, "sluice_request_success_total", finished_reason="length") == n
    assert delta(after, before, "sluice_prompt_tokens_total") == prompt_tokens
    assert delta(after, before, "sluice_generation_tokens_total") == n * max_tokens
    assert delta(after, before, "sluice_time_to_first_token_seconds_count") == n
    for name in [*PER_REQUEST, "sluice_request_time_per_output_token_seconds"]:
        assert delta(after, before, f"{name}_count") == n, name
    # One inter-token gap per token after the first (no speculative decoding: one token per step).
    assert delta(after, before, "sluice_inter_token_latency_seconds_count") == n * (max_tokens - 1)
    # Every prompt token and every output token but the last is computed once (no prefix hits, no preemption).
    assert delta(after, before, "sluice_prefix_cache_hits_total") == 0
    assert delta(after, before, "sluice_iteration_tokens_sum") == prompt_tokens + n * (max_tokens - 1)
    assert delta(after, before, "sluice_iteration_tokens_count") >= max_tokens

    # The intervals add up: TTFT = queue + prefill, e2e = TTFT + decode, TPOT = decode / (tokens - 1).
    s = {name: delta(after, before, f"{name}_sum") for name in [*HISTOGRAMS]}
    assert s["sluice_time_to_first_token_seconds"] == pytest.approx(
        s["sluice_request_queue_time_seconds"] + s["sluice_request_prefill_time_seconds"], rel=1e-6)
    assert s["sluice_e2e_request_latency_seconds"] == pytest.approx(
        s["sluice_time_to_first_token_seconds"] + s["sluice_request_decode_time_seconds"], rel=1e-6)
    assert s["sluice_request_time_per_output_token_seconds"] == pytest.approx(
        s["sluice_request_decode_time_seconds"] / (max_tokens - 1), rel=1e-6)
    assert s["sluice_inter_token_latency_seconds"] == pytest.approx(s["sluice_request_decode_time_seconds"],
                                                                    rel=1e-6)
    assert s["sluice_request_prefill_time_seconds"] > 0 and s["sluice_request_decode_time_seconds"] > 0

    # A 10-minute SLO: every completed request is goodput.
    assert delta(after, before, "sluice_request_slo_total") == n
    assert delta(after, before, "sluice_request_goodput_total") == n
    assert delta(after, before, "sluice_request_slo_met_total", objective="ttft") == n
    assert delta(after, before, "sluice_request_slo_met_total", objective="tpot") == n
    # Both kinds of work took engine time.
    assert delta(after, before, "sluice_engine_busy_seconds_total", phase="prefill") > 0
    assert delta(after, before, "sluice_engine_busy_seconds_total", phase="decode") > 0


def test_stop_and_single_token_requests(server, client):
    before = scrape(server, EP_A)
    stopped = client.completions.create(model=server.model, prompt="1. apples\n2. pears\n3.", max_tokens=40,
                                        temperature=0, stop=["\n"])
    single = client.completions.create(model=server.model, prompt=unique_prompt(5), max_tokens=1,
                                       extra_body={"ignore_eos": True})
    after = scrape(server, EP_A)
    assert stopped.choices[0].finish_reason == "stop" and single.choices[0].finish_reason == "length"
    assert delta(after, before, "sluice_request_success_total", finished_reason="stop") == 1
    assert delta(after, before, "sluice_request_success_total", finished_reason="length") == 1
    assert delta(after, before, "sluice_e2e_request_latency_seconds_count") == 2
    # A single-token request has no TPOT (vLLM's definition excludes the first token) ...
    assert delta(after, before, "sluice_request_time_per_output_token_seconds_count") == (
        stopped.usage.completion_tokens > 1)
    # ... and meets the TPOT objective trivially.
    assert delta(after, before, "sluice_request_goodput_total") == 2


def test_prefix_cache_hits_after_a_repeated_prompt(server, client):
    prompt = unique_prompt(70)
    before = scrape(server, EP_A)
    first = client.completions.create(model=server.model, prompt=prompt, max_tokens=2, temperature=0)
    mid = scrape(server, EP_A)
    second = client.completions.create(model=server.model, prompt=prompt, max_tokens=2, temperature=0)
    after = scrape(server, EP_A)
    n = first.usage.prompt_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert n > 150 and cached >= (n - 1) // 16 * 16 - 16
    assert delta(mid, before, "sluice_prefix_cache_queries_total") == n
    assert delta(mid, before, "sluice_prefix_cache_hits_total") == 0
    assert delta(after, mid, "sluice_prefix_cache_queries_total") == n
    assert delta(after, mid, "sluice_prefix_cache_hits_total") == cached
    # Cached tokens are not computed again.
    assert delta(after, mid, "sluice_iteration_tokens_sum") == n - cached + 1


def test_client_disconnect_counts_an_abort_and_gauges_return_to_zero(server, client):
    before = wait_for(server, EP_A, idle)
    stream = client.completions.create(model=server.model, prompt=unique_prompt(8), max_tokens=300,
                                       stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    busy = scrape(server, EP_A)
    stream.close()  # the client goes away mid-stream

    def aborted(m):
        return delta(m, before, "sluice_request_success_total", finished_reason="abort")

    after = wait_for(server, EP_A, lambda m: aborted(m) >= 1 and idle(m))
    assert busy("sluice_num_requests_running") == 1 and busy("sluice_kv_cache_usage_perc") > 0
    assert aborted(after) == 1
    assert idle(after) and after("sluice_kv_cache_usage_perc") == 0
    # It had its first token, but an aborted request is not timed end to end nor checked against the SLO.
    assert delta(after, before, "sluice_time_to_first_token_seconds_count") == 1
    assert delta(after, before, "sluice_e2e_request_latency_seconds_count") == 0
    assert delta(after, before, "sluice_request_slo_total") == 0


# -- server B: a tiny KV cache (preemption), an impossible SLO, the endpoint label from the environment --
EP_B = "ep-env"


@pytest.fixture(scope="module")
def tight_server(start_server):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLUICE_ENDPOINT", EP_B)
        return start_server("--max-num-batched-tokens", "64", "--kv-cache-memory", str(40 * 16 * BYTES_PER_TOKEN),
                            "--max-model-len", "512", "--no-prefix-caching",
                            "--slo-ttft-ms", "0.001", "--slo-tpot-ms", "0.001")


def test_preemption_under_a_tiny_kv_budget_and_an_impossible_slo(tight_server):
    server = tight_server
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=600, max_retries=0)
    n, max_tokens = 8, 40  # 8 x (57..78 prompt + 40) tokens want ~60 blocks of 16; the pool has 40
    before = scrape(server, EP_B)
    assert before("sluice_kv_cache_num_blocks") == 40

    def run(i):
        return client.completions.create(model=server.model, prompt=unique_prompt(12 + i), max_tokens=max_tokens,
                                         temperature=0, extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(run, range(n)))
    after = wait_for(server, EP_B, idle)
    assert delta(after, before, "sluice_num_preemptions_total") > 0
    # Recomputation after preemption counts no token twice, and every request has one first token.
    assert delta(after, before, "sluice_prompt_tokens_total") == sum(r.usage.prompt_tokens for r in results)
    assert delta(after, before, "sluice_generation_tokens_total") == n * max_tokens
    assert delta(after, before, "sluice_time_to_first_token_seconds_count") == n
    for name in [*PER_REQUEST, "sluice_request_time_per_output_token_seconds"]:
        assert delta(after, before, f"{name}_count") == n, name
    # Nobody meets a 1-microsecond objective.
    assert delta(after, before, "sluice_request_slo_total") == n
    assert delta(after, before, "sluice_request_goodput_total") == 0
    assert delta(after, before, "sluice_request_slo_met_total", objective="ttft") == 0
    assert delta(after, before, "sluice_request_slo_met_total", objective="tpot") == 0
    assert after("sluice_slo_ttft_seconds") == pytest.approx(1e-6)
    assert after("sluice_gpu_hour_usd") == 0  # not set
    assert idle(after) and after("sluice_kv_cache_usage_perc") == 0


# -- in process: one registry per engine, no endpoint label by default, errors ----------------------------
def test_engines_in_one_process_keep_their_own_metrics_and_count_errors():
    kw = dict(kv_cache_memory=16 << 20, max_model_len=256, device="cpu")
    a, b = LLM(**kw), LLM(**kw)
    a.generate(["one two three", "four five"], SamplingParams(max_tokens=3, ignore_eos=True))
    ma = Scrape(PrometheusExporter(a.engine).render()[0].decode(), a.engine.served_model_name, None)
    mb = Scrape(PrometheusExporter(b.engine).render()[0].decode(), b.engine.served_model_name, None)
    assert ma("sluice_time_to_first_token_seconds_count") == 2 and ma("sluice_generation_tokens_total") == 6
    assert mb("sluice_time_to_first_token_seconds_count") == 0 and mb("sluice_generation_tokens_total") == 0

    # The engine loop dies mid-request: the request fails with 500 and counts as finished by error.
    def boom(*_):
        raise RuntimeError("boom")

    b.engine.executor.submit = boom  # the forward raises
    b.engine.cfg.warmup = "off"  # mid-request, not at start-up (test_warmup.py covers a failing warm-up)
    with TestClient(build_app(b.engine)) as http:
        r = http.post("/v1/completions", json={"model": b.engine.served_model_name, "prompt": "hi",
                                               "max_tokens": 2})
        assert r.status_code == 500
        m = Scrape(http.get("/metrics").text, b.engine.served_model_name, None)
    assert m("sluice_request_success_total", finished_reason="error") == 1


def test_cuda_graph_state_shows_why_graphs_are_off_or_failed(monkeypatch, caplog):
    """On CPU graphs are off, and say why; a capture that raises (a stand-in for torch.cuda's graphs, as on a GPU
    where capture fails) leaves the engine serving eagerly, exported as failed with the exception's text."""
    from sluice_engine.worker import model_runner

    kw = dict(kv_cache_memory=16 << 20, max_model_len=256, device="cpu")

    def graph_metrics(llm: LLM) -> tuple[float, dict]:
        m = Scrape(PrometheusExporter(llm.engine).render()[0].decode(), llm.engine.served_model_name, None)
        assert m.types["sluice_cuda_graphs_captured"] == m.types["sluice_cuda_graphs_info"] == "gauge"
        return m("sluice_cuda_graphs_captured"), {
            dict(k[1])["state"]: (dict(k[1])["reason"], v) for k, v in m.values.items()
            if k[0] == "sluice_cuda_graphs_info"}

    assert graph_metrics(LLM(**kw)) == (0, {"off": ("graphs need CUDA (device is cpu)", 1)})

    class FailingCapture:
        def warm_up(self, fn):
            raise RuntimeError("CUDA error: operation not permitted\nwhen stream is capturing")

    monkeypatch.setattr(model_runner, "graphs_off_reason", lambda *a: None)  # as on a GPU
    monkeypatch.setattr(model_runner.ModelRunner, "graph_plan", lambda self: {1: [1], 2: [1]})
    monkeypatch.setattr(model_runner.ModelRunner, "_graph_api", lambda self: FailingCapture())
    with caplog.at_level("WARNING", logger="sluice.engine"):
        failed = LLM(**kw)
    assert any(r.levelname == "WARNING" and "operation not permitted" in r.getMessage() for r in caplog.records)
    out = failed.generate(["one two three"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3  # serving, eagerly
    reason = "RuntimeError: CUDA error: operation not permitted when stream is capturing"  # on one line
    assert graph_metrics(failed) == (0, {"failed": (reason, 1)})
