"""Multi-LoRA in the engine (issue 26, acceptance 1's engine half): two adapters written with PEFT on the bundled
model (rank 8 on all seven projections, rank 16 on q/v), served with the base model in the same batches; greedy
tokens identical to HF transformers + PEFT, and logprobs within 1e-3. Prefix caching never crosses adapters, and
more adapters than slots are swapped in and out."""

from __future__ import annotations

import copy

import pytest
import torch

from sluice_engine.entrypoints.llm import LLM
from sluice_engine.lora.adapter import PROJECTIONS
from sluice_engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
peft = pytest.importorskip("peft")

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,", "Once upon a time"]
TOKENS = 12


@pytest.fixture(scope="module")
def adapters(hf_model, tmp_path_factory):
    """name -> (directory, the PEFT model on HF's weights)."""
    out = {}
    for name, kw, seed in (("all8", dict(r=8, lora_alpha=16, target_modules=list(PROJECTIONS)), 1),
                           ("qv16", dict(r=16, lora_alpha=16, target_modules=["q_proj", "v_proj"], use_rslora=True),
                            2)):
        torch.manual_seed(seed)
        cfg = peft.LoraConfig(init_lora_weights=False, **kw)
        model = peft.get_peft_model(copy.deepcopy(hf_model), cfg).eval()
        with torch.no_grad():  # PEFT's random init is small next to the base: make the adapters matter
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.mul_(10.0)
        d = tmp_path_factory.mktemp(name)
        model.save_pretrained(d)
        out[name] = (d, model)
    return out


def hf_greedy(model, tokenizer, prompt: str) -> tuple[list[int], list[float]]:
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        seq = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=TOKENS, do_sample=False)[0].tolist()
        logits = model(input_ids=torch.tensor([seq])).logits[0].float()
    gen = seq[len(ids):]
    lps = torch.log_softmax(logits, -1)
    return gen, [lps[len(ids) - 1 + i, t].item() for i, t in enumerate(gen)]


@pytest.fixture(scope="module")
def llm(model_dir, adapters):
    mods = [f"{n}={d}" for n, (d, _) in adapters.items()]
    llm = LLM(str(model_dir), max_model_len=256, enable_lora=True, lora_modules=mods, max_loras=2,
              max_lora_rank=16, kv_cache_memory=64 << 20)
    yield llm
    llm.engine.shutdown()


def test_base_and_two_adapters_in_one_batch_match_hf_with_peft(llm, adapters, hf_model):
    tok = llm.tokenizer
    jobs = [(p, name) for p in PROMPTS for name in (None, "all8", "qv16")]
    outs = llm.generate([p for p, _ in jobs], SamplingParams(max_tokens=TOKENS, temperature=0, logprobs=0,
                                                             ignore_eos=True), lora=[n for _, n in jobs])
    for (prompt, name), out in zip(jobs, outs, strict=True):
        model = hf_model if name is None else adapters[name][1]
        want, want_lps = hf_greedy(model, tok, prompt)
        assert out.token_ids == want, (prompt, name)
        got_lps = [lp for lp, _ in out.logprobs]
        assert max(abs(a - b) for a, b in zip(got_lps, want_lps, strict=True)) < 1e-3, (prompt, name)
    # The adapters changed the answers (else the test would prove little).
    by = {n: [o.token_ids for (_, m), o in zip(jobs, outs, strict=True) if m == n] for n in (None, "all8", "qv16")}
    assert by[None] != by["all8"] and by[None] != by["qv16"]


def test_prefix_cache_never_crosses_adapters(llm):
    prompt = "Write one sentence about the sea and the wind and the old lighthouse keeper who lived there alone"
    params = SamplingParams(max_tokens=4, temperature=0)
    first = llm.generate([prompt], params, lora="all8")[0]
    again = llm.generate([prompt], params, lora="all8")[0]
    base = llm.generate([prompt], params)[0]
    other = llm.generate([prompt], params, lora="qv16")[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0  # its own prefix is a hit
    assert base.num_cached_tokens == 0 and other.num_cached_tokens == 0  # never another adapter's or the base's


def test_more_adapters_than_slots_swap_and_stay_exact(model_dir, adapters):
    mods = [f"{n}={d}" for n, (d, _) in adapters.items()]
    one_slot = LLM(str(model_dir), max_model_len=256, enable_lora=True, lora_modules=mods, max_loras=1,
                   max_lora_rank=16, kv_cache_memory=64 << 20)
    try:
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        names = ["all8", "qv16", None, "qv16", "all8"]
        got = one_slot.generate(PROMPTS[:1] * len(names), params, lora=names)
        alone = [one_slot.generate(PROMPTS[:1], params, lora=n)[0].token_ids for n in names]
        assert [o.token_ids for o in got] == alone
        assert one_slot.engine.lora_slots.loads >= 3  # one slot for two adapters: swapped in and out
    finally:
        one_slot.engine.shutdown()


def test_unknown_adapter_is_refused_by_name(llm):
    from sluice_engine.sampling_params import InvalidParam

    with pytest.raises(InvalidParam, match="no LoRA adapter 'nope'; adapters: all8, qv16"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), lora="nope")
    assert not llm.engine.has_unfinished()


def test_the_server_serves_adapters_as_models(start_server, adapters, hf_model, llm):
    """Through `sluice serve` (engine core in its own process) and the openai client: the request's `model` picks
    the adapter; base and adapters at once give HF + PEFT's greedy tokens; /v1/models lists each adapter with the
    base as parent; an unknown model is a 404 model_not_found."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from openai import NotFoundError, OpenAI

    mods = [f"{n}={d}" for n, (d, _) in adapters.items()]
    server = start_server("--enable-lora", "--lora-modules", *mods, "--max-loras", "2", "--max-model-len", "256")
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=300)
    listed = {m["id"]: m.get("parent") for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert listed == {server.model: None, "all8": server.model, "qv16": server.model}

    def complete(job):
        prompt, name = job
        r = client.completions.create(model=name or server.model, prompt=prompt, max_tokens=TOKENS, temperature=0,
                                      logprobs=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        assert r.model == (name or server.model)
        return [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]

    jobs = [(p, n) for p in PROMPTS[:2] for n in (None, "all8", "qv16")]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(complete, jobs))
    for (prompt, name), ids in zip(jobs, got, strict=True):
        model = hf_model if name is None else adapters[name][1]
        assert ids == hf_greedy(model, llm.tokenizer, prompt)[0], (prompt, name)
    with pytest.raises(NotFoundError, match="model_not_found|does not exist"):
        client.completions.create(model="nope", prompt="Hi", max_tokens=2)
    stream = client.chat.completions.create(model="qv16", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                            stream=True)
    assert {chunk.model for chunk in stream} == {"qv16"}
