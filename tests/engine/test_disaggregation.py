"""Prefill/decode disaggregation over HTTP (issue 28), real `sluice serve` processes on 127.0.0.1 and the `openai`
client: a prefill engine pushes a request's prompt KV blocks to a decode engine (`kv_transfer_params.push_to`, the
decode engine's `--kv-role decode` receiver) and answers (one token) once the push has ended; the decode engine,
asked next, serves the
full request from those blocks (its usage counts them as cached tokens) with the tokens and logprobs of one
engine computing it all (the colocated reference). Every engine of the endpoint holds its KV key (issue 39): pushes
are sealed with it, and push_to is honoured only with a hop token made with it. fp32 (`--quantization none`): see test_kv_offload.py for why."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import BadRequestError, OpenAI
from parity_prompts import PROMPTS as PARITY_PROMPTS
from servers import free_port

from sluice_engine.kv_transfer.keys import KVKey

pytestmark = pytest.mark.slow

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
PROMPTS = [" ".join(WORDS[(i + j) % len(WORDS)] + str(j % 5) for j in range(110)) + "\nContinue:" for i in range(3)]


COMMON = ("--quantization", "none", "--kv-cache-memory", "64MiB", "--max-model-len", "1024")
SECRET = "5e" * 32


@pytest.fixture(scope="module")
def key_args(tmp_path_factory) -> tuple[str, ...]:
    path = tmp_path_factory.mktemp("kv") / "kv-secret"
    path.write_text(SECRET + "\n")
    return ("--kv-secret-file", str(path))


def kv_params(push_to: str) -> dict:
    """What a decode engine's hop sends: push_to and its token, made with the endpoint's key."""
    return {"kv_transfer_params": {"push_to": push_to, "hop_token": KVKey(SECRET.encode()).hop_token(push_to)}}


def start_together(start_server, *flag_sets: tuple[str, ...]) -> list:
    """Servers that need nothing of each other, started side by side (each start is mostly one process's imports
    and model load: on a 2-core box two of them overlap)."""
    with ThreadPoolExecutor(len(flag_sets)) as pool:
        return list(pool.map(lambda flags: start_server(*flags), flag_sets))


@pytest.fixture(scope="module")
def pools(start_server, key_args):
    kv_port = free_port()
    decode, prefill, alone = start_together(
        start_server,
        (*COMMON, *key_args, "--kv-role", "decode", "--kv-host", "127.0.0.1", "--kv-port", str(kv_port),
         "--kv-offload-bytes", "256MiB"),
        # Chunked prefill on the prefill side (a 64-token budget): the blocks it pushes were computed in chunks.
        (*COMMON, *key_args, "--kv-role", "prefill", "--max-num-batched-tokens", "64"),
        COMMON)
    return prefill, decode, alone, kv_port


@pytest.fixture(scope="module")
def routed(start_server, pools, key_args):
    """A decode engine that sends every prompt to the prefill engine first (--prefill-url): what the operator
    renders, and what clients (or the gateway) talk to."""
    prefill = pools[0]
    return start_server(*COMMON, *key_args, "--kv-role", "decode", "--kv-host", "127.0.0.1", "--kv-port", str(free_port()),
                        "--kv-offload-bytes", "256MiB", "--prefill-url", prefill.url,
                        "--prefill-min-prompt-tokens", "0")


def hops(server) -> dict[str, float]:
    """sluice_kv_prefill_hops_total by outcome."""
    import httpx

    out = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("sluice_kv_prefill_hops_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = float(line.rsplit(" ", 1)[1])
    return out


def _client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def side_by_side(*calls):
    """The calls' results, made at once: requests to different servers (the path under test and the colocated
    reference) overlap instead of waiting for each other."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def test_a_request_prefilled_on_one_engine_is_decoded_on_another_as_if_computed_there(pools):
    prefill, decode, alone, kv_port = pools
    for k, prompt in enumerate(PROMPTS):
        first = _client(prefill).completions.create(
            model=prefill.model, prompt=prompt, max_tokens=1, temperature=0,
            extra_body=kv_params(f"127.0.0.1:{kv_port}"))
        blocks = first.usage.prompt_tokens // 16
        # The answer of a pushing request comes once its push has ended: the blocks are at the decode engine now.
        assert prefill.metrics()["sluice_kv_pushes_total"] == k + 1
        kw = dict(prompt=prompt, max_tokens=8, temperature=0, logprobs=1)
        got, want = side_by_side(lambda kw=kw: _client(decode).completions.create(model=decode.model, **kw),
                                 lambda kw=kw: _client(alone).completions.create(model=alone.model, **kw))
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
                                              extra_body=kv_params(f"127.0.0.1:{dead}"))
    assert out.choices[0].finish_reason == "length"  # the request itself is served
    assert prefill.metrics()["sluice_kv_pushes_total"] == len(PROMPTS) + 1  # ended (failed) before the answer
    with pytest.raises(BadRequestError) as e:
        _client(prefill).completions.create(model=prefill.model, prompt="hi", max_tokens=1,
                                            extra_body={"kv_transfer_params": {"push_to": "no-port"}})
    assert "kv_transfer_params" in str(e.value)
    # A client's push_to (no hop token, or one for another target): refused by name, nothing pushed.
    for params in ({"push_to": f"127.0.0.1:{dead}"},
                   {**kv_params(f"127.0.0.1:{dead}")["kv_transfer_params"], "push_to": "127.0.0.1:1"}):
        with pytest.raises(BadRequestError) as e:
            _client(prefill).completions.create(model=prefill.model, prompt=PROMPTS[0], max_tokens=1,
                                                extra_body={"kv_transfer_params": params})
        assert "kv_transfer_params.push_to" in str(e.value) and "hop_token" in str(e.value)
    assert prefill.metrics()["sluice_kv_pushes_total"] == len(PROMPTS) + 1


# -- through the decode engine's prefill hop (--prefill-url), as clients of a disaggregated endpoint see it ------
def _same(got, want) -> None:
    assert [c.text for c in got.choices] == [c.text for c in want.choices]
    for g, w in zip(got.choices, want.choices, strict=True):
        if w.logprobs is not None:
            for a, b in zip(g.logprobs.token_logprobs, w.logprobs.token_logprobs, strict=True):
                assert a == pytest.approx(b, abs=1e-3)


def test_completions_through_the_prefill_hop_equal_one_engine_and_hf(pools, routed, hf_model, model_dir):
    import torch
    from transformers import AutoTokenizer

    prefill, _, alone, _ = pools
    before = hops(routed).get("ok", 0)
    pushes = prefill.metrics()["sluice_kv_pushes_total"]
    kw = dict(max_tokens=8, temperature=0, logprobs=1)
    for prompt in PROMPTS:
        got, want = side_by_side(
            lambda prompt=prompt: _client(routed).completions.create(model=routed.model, prompt=prompt + " once", **kw),
            lambda prompt=prompt: _client(alone).completions.create(model=alone.model, prompt=prompt + " once", **kw))
        _same(got, want)
        # The prompt's full blocks came from the prefill engine (the last token is always computed here).
        assert got.usage.prompt_tokens_details.cached_tokens == (got.usage.prompt_tokens - 1) // 16 * 16
    assert hops(routed)["ok"] == before + len(PROMPTS)
    assert prefill.metrics()["sluice_kv_pushes_total"] == pushes + len(PROMPTS)
    # HF transformers, greedy on the same weights: the chain's other end.
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(PROMPTS[0] + " once")["input_ids"]
    with torch.no_grad():
        gen = hf_model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    got = _client(routed).completions.create(model=routed.model, prompt=PROMPTS[0] + " once", max_tokens=8,
                                             temperature=0)
    assert got.choices[0].text == tok.decode(gen[0, len(ids):])


def test_the_parity_set_through_the_prefill_hop_equals_one_engine(pools, routed):
    """test_server_parity.py holds one engine to HF on these; through the hop they must equal that engine. Prompts
    of 17 tokens or more hop (one full block and the last token); shorter ones are counted skipped."""
    _, _, alone, _ = pools
    before = hops(routed)
    kw = dict(max_tokens=16, temperature=0, logprobs=1)
    for prompt in PARITY_PROMPTS:
        _same(*side_by_side(lambda prompt=prompt: _client(routed).completions.create(model=routed.model, prompt=prompt, **kw),
                            lambda prompt=prompt: _client(alone).completions.create(model=alone.model, prompt=prompt, **kw)))
    after = hops(routed)
    assert after["ok"] - before.get("ok", 0) >= 4 and after["skipped"] - before.get("skipped", 0) >= 4
    assert after["ok"] + after["skipped"] - before.get("ok", 0) - before.get("skipped", 0) == len(PARITY_PROMPTS)


def test_chat_and_n_greater_than_one_through_the_prefill_hop_equal_one_engine(pools, routed):
    _, _, alone, _ = pools
    before = hops(routed).get("ok", 0)
    messages = [{"role": "system", "content": "You answer in one line. Context: " + PROMPTS[1]},
                {"role": "user", "content": "Which word comes after theta?"}]
    kw = dict(messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=1)
    got = _client(routed).chat.completions.create(model=routed.model, **kw)
    want = _client(alone).chat.completions.create(model=alone.model, **kw)
    assert got.choices[0].message.content == want.choices[0].message.content
    for a, b in zip(got.choices[0].logprobs.content, want.choices[0].logprobs.content, strict=True):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-3)
    assert got.usage.prompt_tokens_details.cached_tokens >= 16 * (got.usage.prompt_tokens // 16 - 1)
    # n > 1: one hop for the prompt; every choice decodes from the pushed blocks.
    kw = dict(prompt=PROMPTS[2] + " twice", max_tokens=6, temperature=0, n=2)
    got = _client(routed).completions.create(model=routed.model, **kw)
    want = _client(alone).completions.create(model=alone.model, **kw)
    _same(got, want)
    assert got.choices[0].text == got.choices[1].text
    assert hops(routed)["ok"] == before + 2


def test_prefix_hits_on_either_side_keep_the_outputs(pools, routed):
    prefill, _, alone, _ = pools
    prompt = PROMPTS[0] + " once"  # sent through the hop by the first test of this group
    hits = prefill.metrics()["sluice_prefix_cache_hits_total"]
    kw = dict(prompt=prompt, max_tokens=8, temperature=0, logprobs=1)
    got = _client(routed).completions.create(model=routed.model, **kw)
    _same(got, _client(alone).completions.create(model=alone.model, **kw))
    assert prefill.metrics()["sluice_prefix_cache_hits_total"] > hits  # the prefill engine had it cached
    assert got.usage.prompt_tokens_details.cached_tokens == (got.usage.prompt_tokens - 1) // 16 * 16


def test_short_prompts_skip_the_hop_and_a_dead_prefill_engine_means_computing_here(pools, routed):
    """Last in this module: it stops the prefill engine."""
    prefill, _, alone, _ = pools
    short = _client(routed).completions.create(model=routed.model, prompt="Hi", max_tokens=3, temperature=0)
    assert short.choices[0].finish_reason == "length" and hops(routed).get("skipped", 0) >= 1
    prefill.stop()
    failed = hops(routed).get("failed", 0)
    kw = dict(prompt="Fresh: " + PROMPTS[1], max_tokens=8, temperature=0, logprobs=1)
    got = _client(routed).completions.create(model=routed.model, **kw)
    _same(got, _client(alone).completions.create(model=alone.model, **kw))
    assert got.usage.prompt_tokens_details.cached_tokens == 0  # computed here, in full
    assert hops(routed)["failed"] == failed + 1


def test_an_endpoint_with_an_api_key_keeps_disaggregating(start_server, key_args):
    """Both pools run one spec, so one --api-key: the hop sends it (issue 39; before, every hop was a 401 and the
    decode engine silently computed every prompt itself)."""
    api = ("--api-key", "tenant-key")
    prefill = start_server(*COMMON, *key_args, *api, "--kv-role", "prefill")
    decode = start_server(*COMMON, *key_args, *api, "--kv-role", "decode", "--kv-host", "127.0.0.1", "--kv-port",
                          str(free_port()), "--kv-offload-bytes", "256MiB", "--prefill-url", prefill.url,
                          "--prefill-min-prompt-tokens", "0")
    client = OpenAI(base_url=f"{decode.url}/v1", api_key="tenant-key", max_retries=0, timeout=120)
    got = client.completions.create(model=decode.model, prompt=PROMPTS[1] + " keyed", max_tokens=4, temperature=0)
    assert got.usage.prompt_tokens_details.cached_tokens == (got.usage.prompt_tokens - 1) // 16 * 16
    assert hops(decode) == {"ok": 1.0, "failed": 0.0, "skipped": 0.0}
