"""Prefill/decode disaggregation over HTTP (issue 28), real `sluice serve` processes on 127.0.0.1 and the `openai`
client: a prefill engine pushes a request's prompt KV blocks to a decode engine (`kv_transfer_params.push_to`, the
decode engine's `--kv-role decode` receiver) and answers (one token) once the push has ended; the decode engine,
asked next, serves the
full request from those blocks (its usage counts them as cached tokens) with the tokens and logprobs of one
engine computing it all (the colocated reference). fp32 (`--quantization none`): see test_kv_offload.py for why."""

from __future__ import annotations

import pytest
from openai import BadRequestError, OpenAI
from servers import free_port

pytestmark = pytest.mark.slow

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
PROMPTS = [" ".join(WORDS[(i + j) % len(WORDS)] + str(j % 5) for j in range(110)) + "\nContinue:" for i in range(3)]


@pytest.fixture(scope="module")
def pools(start_server):
    kv_port = free_port()
    common = ("--quantization", "none", "--kv-cache-memory", "64MiB", "--max-model-len", "1024")
    decode = start_server(*common, "--kv-role", "decode", "--kv-host", "127.0.0.1", "--kv-port", str(kv_port),
                          "--kv-offload-bytes", "256MiB")
    prefill = start_server(*common, "--kv-role", "prefill")
    alone = start_server(*common)
    return prefill, decode, alone, kv_port


def _client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def test_a_request_prefilled_on_one_engine_is_decoded_on_another_as_if_computed_there(pools):
    prefill, decode, alone, kv_port = pools
    for k, prompt in enumerate(PROMPTS):
        first = _client(prefill).completions.create(
            model=prefill.model, prompt=prompt, max_tokens=1, temperature=0,
            extra_body={"kv_transfer_params": {"push_to": f"127.0.0.1:{kv_port}"}})
        blocks = first.usage.prompt_tokens // 16
        # The answer of a pushing request comes once its push has ended: the blocks are at the decode engine now.
        assert prefill.metrics()["sluice_kv_pushes_total"] == k + 1
        kw = dict(prompt=prompt, max_tokens=8, temperature=0, logprobs=1)
        got = _client(decode).completions.create(model=decode.model, **kw)
        want = _client(alone).completions.create(model=alone.model, **kw)
        assert got.usage.prompt_tokens_details.cached_tokens == min(blocks, (got.usage.prompt_tokens - 1) // 16) * 16
        assert want.usage.prompt_tokens_details.cached_tokens == 0
        assert got.choices[0].text == want.choices[0].text
        assert got.choices[0].text.startswith(first.choices[0].text)
        for a, b in zip(got.choices[0].logprobs.token_logprobs, want.choices[0].logprobs.token_logprobs,
                        strict=True):
            assert a == pytest.approx(b, abs=1e-3)
    assert prefill.metrics()["sluice_kv_pushes_total"] == len(PROMPTS)
    assert decode.metrics()["sluice_kv_offload_blocks_moved_total"] >= sum(len(p.split()) for p in PROMPTS) // 8


def test_a_push_to_a_dead_receiver_fails_alone_and_a_bad_target_is_a_400(pools):
    prefill, _, _, _ = pools
    dead = free_port()
    out = _client(prefill).completions.create(model=prefill.model, prompt=PROMPTS[0] + " again", max_tokens=2,
                                              temperature=0,
                                              extra_body={"kv_transfer_params": {"push_to": f"127.0.0.1:{dead}"}})
    assert out.choices[0].finish_reason == "length"  # the request itself is served
    assert prefill.metrics()["sluice_kv_pushes_total"] == len(PROMPTS) + 1  # ended (failed) before the answer
    with pytest.raises(BadRequestError) as e:
        _client(prefill).completions.create(model=prefill.model, prompt="hi", max_tokens=1,
                                            extra_body={"kv_transfer_params": {"push_to": "no-port"}})
    assert "kv_transfer_params" in str(e.value)
