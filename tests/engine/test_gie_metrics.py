"""The metrics Gateway API Inference Extension endpoint pickers read from a model server, under vLLM's names
(docs/metrics.md, "GIE / vLLM-compatible names"): scraped from a real `sluice serve`, parsed with prometheus_client's
text parser, and checked against the sluice_ gauges they mirror while a request runs and another waits."""

import threading
import time

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

MIRRORED = {"vllm:num_requests_waiting": "sluice_num_requests_waiting",
            "vllm:num_requests_running": "sluice_num_requests_running",
            "vllm:kv_cache_usage_perc": "sluice_kv_cache_usage_perc"}


def families(server) -> dict:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def one(fams: dict, name: str):
    (sample,) = fams[name].samples
    return sample


@pytest.fixture(scope="module")
def server(start_server):
    # One running request at a time, so a second one waits; LoRA on (no adapter needed) for lora_requests_info.
    return start_server("--max-num-seqs", "1", "--max-model-len", "256", "--enable-lora", "--max-loras", "3")


def test_names_types_and_labels(server):
    fams = families(server)
    for name in [*MIRRORED, "vllm:cache_config_info", "vllm:lora_requests_info"]:
        assert fams[name].type == "gauge", name
    for name in MIRRORED:
        assert one(fams, name).labels == {"model_name": server.model}, name
    cache = one(fams, "vllm:cache_config_info")
    assert cache.value == 1
    assert cache.labels == {"model_name": server.model, "block_size": "16",
                            "num_gpu_blocks": str(int(one(fams, "sluice_kv_cache_num_blocks").value))}
    lora = one(fams, "vllm:lora_requests_info")
    assert lora.labels == {"model_name": server.model, "max_lora": "3", "running_lora_adapters": "",
                           "waiting_lora_adapters": ""}
    # The value is the Unix time of the last update (the latest stats snapshot's).
    assert time.time() - 3600 < lora.value <= time.time()


def test_values_track_the_sluice_gauges_under_load(server):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=600, max_retries=0)
    idle = families(server)
    stamp = one(idle, "vllm:lora_requests_info").value

    def run(i: int) -> None:
        client.completions.create(model=server.model, prompt=f"Count to ten, take {i}:", max_tokens=40,
                                  temperature=0, extra_body={"ignore_eos": True})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while True:  # one running, one waiting (--max-num-seqs 1): both gauges nonzero in one scrape
        fams = families(server)
        if one(fams, "sluice_num_requests_waiting").value >= 1 and one(fams, "sluice_num_requests_running").value:
            break
        assert time.monotonic() < deadline, "no request seen waiting"
        time.sleep(0.05)
    for ours_of_vllm, ours in MIRRORED.items():
        assert one(fams, ours_of_vllm).value == one(fams, ours).value, ours
    assert one(fams, "vllm:num_requests_waiting").value >= 1
    assert one(fams, "vllm:num_requests_running").value == 1
    assert 0 < one(fams, "vllm:kv_cache_usage_perc").value <= 1
    assert one(fams, "vllm:lora_requests_info").value > stamp  # steps ran since: a newer update
    for t in threads:
        t.join()
    deadline = time.monotonic() + 30
    while one(fams := families(server), "sluice_num_requests_running").value and time.monotonic() < deadline:
        time.sleep(0.05)
    for ours_of_vllm, ours in MIRRORED.items():
        assert one(fams, ours_of_vllm).value == one(fams, ours).value == 0, ours
