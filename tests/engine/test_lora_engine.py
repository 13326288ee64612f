"""Multi-LoRA in the engine (issue 26, acceptance 1's engine half): two adapters written with PEFT on the bundled
model (rank 8 on all seven projections, rank 16 on q/v), served with the base model in the same batches; greedy
tokens identical to HF transformers + PEFT, and logprobs within 1e-3. Prefix caching never crosses adapters, and
more adapters than slots are swapped in and out."""

from __future__ import annotations

import copy
import weakref

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


# HF's answers by model (the base or a PEFT model) and prompt: several tests hold the engine to the same ones (one
# batch, the server, each sharded layout), computed once. Weak keys: an answer lives no longer than its model.
_HF_GREEDY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def hf_greedy(model, tokenizer, prompt: str) -> tuple[list[int], list[float]]:
    """HF's greedy continuation of `prompt` and its logprobs (every caller passes the bundled model's tokenizer)."""
    answers = _HF_GREEDY.setdefault(model, {})
    if prompt not in answers:
        answers[prompt] = _hf_greedy(model, tokenizer, prompt)
    return answers[prompt]


def _hf_greedy(model, tokenizer, prompt: str) -> tuple[list[int], list[float]]:
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        seq = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=TOKENS, do_sample=False)[0].tolist()
        logits = model(input_ids=torch.tensor([seq])).logits[0].float()
    gen = seq[len(ids):]
    lps = torch.log_softmax(logits, -1)
    return gen, [lps[len(ids) - 1 + i, t].item() for i, t in enumerate(gen)]


@pytest.fixture(scope="module")
def llm(model_dir, adapters, tmp_path_factory):
    mods = [f"{n}={d}" for n, (d, _) in adapters.items()]
    # With an endpoint KV key (issue 39): block names, the adapters' included, are keyed by it; exactness and the
    # prefix cache's per-adapter separation hold all the same.
    key = tmp_path_factory.mktemp("kv") / "kv-secret"
    key.write_text("9f" * 32)
    llm = LLM(str(model_dir), max_model_len=256, enable_lora=True, lora_modules=mods, max_loras=2,
              max_lora_rank=16, kv_cache_memory=64 << 20, kv_secret_file=str(key))
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
    # One device slot and one adapter kept on the host (--max-cpu-loras 1): each swap reads the other's files.
    one_slot = LLM(str(model_dir), max_model_len=256, enable_lora=True, lora_modules=mods, max_loras=1,
                   max_lora_rank=16, kv_cache_memory=64 << 20, max_cpu_loras=1)
    try:
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        names = ["all8", "qv16", None, "qv16", "all8"]
        got = one_slot.generate(PROMPTS[:1] * len(names), params, lora=names)
        alone = [one_slot.generate(PROMPTS[:1], params, lora=n)[0].token_ids for n in names]
        assert [o.token_ids for o in got] == alone
        assert one_slot.engine.lora_slots.loads >= 3  # one slot for two adapters: swapped in and out
        lora = one_slot.engine.runner.lora
        assert len(lora.host) == 1 and lora.host_loads >= 3  # two registrations, then a re-read per swap back
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


# -- adapters loaded and unloaded while the engine runs (acceptance 2) ---------------------------------------
def _run(engine, adds: list[tuple[str, list[int], str | None]], params: SamplingParams) -> dict[str, list[int]]:
    for rid, ids, lora in adds:
        engine.add_request(rid, ids, params, lora_name=lora)
    got: dict[str, list[int]] = {rid: [] for rid, _, _ in adds}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    return got


def test_an_adapter_loaded_at_run_time_serves_as_one_given_at_start(llm, adapters):
    params = SamplingParams(max_tokens=TOKENS, temperature=0, logprobs=0, ignore_eos=True)
    llm.engine.load_lora("late", str(adapters["all8"][0]))
    try:
        assert "late" in llm.engine.model_info.lora_names
        late = llm.generate(PROMPTS, params, lora="late")
        start = llm.generate(PROMPTS, params, lora="all8")
        assert [o.token_ids for o in late] == [o.token_ids for o in start]
        assert [[lp for lp, _ in o.logprobs] for o in late] == [[lp for lp, _ in o.logprobs] for o in start]
    finally:
        assert llm.engine.unload_lora("late") == 0  # nothing runs on it: gone at once
    assert "late" not in llm.engine.model_info.lora_names and "late" not in llm.engine.lora_slots.resident
    from sluice_engine.sampling_params import InvalidParam

    with pytest.raises(InvalidParam, match="no LoRA adapter 'late'"):
        llm.generate(PROMPTS[:1], params, lora="late")


def test_unloading_an_adapter_in_use_lets_its_requests_finish(llm, adapters):
    """Documented behaviour: an unload takes effect for new requests at once (404 at the API); requests already
    on the adapter run to their end on it, and it leaves its slot and the host after the last of them."""
    from sluice_engine.core.lora_slots import LoRABusy
    from sluice_engine.sampling_params import InvalidParam

    engine, path = llm.engine, str(adapters["all8"][0])
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ids = llm.tokenizer.encode(PROMPTS[3])
    want = _run(engine, [("ref", ids, "all8")], params)["ref"]
    old = engine.load_lora("busy", path)
    engine.add_request("busy-1", ids, params, lora_name="busy")
    got = [t for out in engine.step() for t in out.new_token_ids]  # admitted: its adapter is in a slot
    assert engine.unload_lora("busy") == 1  # one request still on it
    assert "busy" not in engine.model_info.lora_names
    with pytest.raises(InvalidParam, match="no LoRA adapter 'busy'"):
        engine.add_request("busy-2", ids, params, lora_name="busy")
    with pytest.raises(LoRABusy, match="requests still run on it"):
        engine.load_lora("busy", path)
    while engine.has_unfinished():
        got += [t for out in engine.step() for t in out.new_token_ids]
    assert got == want  # it finished on the adapter it started on
    assert not engine.adapters._unloading and "busy" not in engine.lora_slots.resident and old not in engine.runner.lora.host
    # Loaded again (the same files): another adapter to the prefix cache, whose blocks the old one's never serve.
    engine.load_lora("busy", path)
    try:
        again = llm.generate([PROMPTS[3]], params, lora="busy")[0]
        assert again.token_ids == want and again.num_cached_tokens == 0
    finally:
        engine.unload_lora("busy")


def test_bad_loads_and_unloads_are_refused_by_name(llm, adapters, tmp_path):
    import json
    import shutil

    from sluice_engine.core.lora_slots import LoRAError, LoRANotFound
    from sluice_engine.lora.adapter import AdapterError

    engine = llm.engine
    with pytest.raises(LoRAError, match="'all8' is already loaded"):
        engine.load_lora("all8", str(adapters["qv16"][0]))
    with pytest.raises(LoRAError, match="base model's served name"):
        engine.load_lora(engine.served_model_name, str(adapters["qv16"][0]))
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        engine.load_lora("nothing", str(tmp_path))
    big = tmp_path / "big"
    shutil.copytree(adapters["qv16"][0], big)
    cfg = json.loads((big / "adapter_config.json").read_text())
    (big / "adapter_config.json").write_text(json.dumps({**cfg, "r": 32}))
    with pytest.raises(AdapterError, match="rank 32 exceeds --max-lora-rank 16"):
        engine.load_lora("big", str(big))
    with pytest.raises(LoRANotFound, match="no LoRA adapter 'nope' is loaded"):
        engine.unload_lora("nope")
    assert sorted(engine.loras) == ["all8", "qv16"]  # nothing changed


def test_the_modules_file_loads_and_unloads_adapters(llm, adapters, tmp_path):
    """--lora-modules-file (what the operator writes from spec.adapters): an adapter listed is loaded once its
    files are all there, one that does not fit is refused once (not retried every poll), one no longer listed
    is unloaded; adapters from --lora-modules are never the file's."""
    import json
    import os
    import shutil

    from sluice_engine.lora.modules_file import LoRAModulesSync

    engine, f = llm.engine, tmp_path / "adapters.json"
    sync = LoRAModulesSync(str(f))
    assert not sync.sync(engine)  # no file yet: nothing to do

    def write(entries):
        f.write_text(json.dumps({"adapters": [{"name": n, "path": str(p)} for n, p in entries]}))
        os.utime(f, ns=(f.stat().st_mtime_ns + 10**9,) * 2)  # a new mtime, whatever the clock's grain

    pending, bad = tmp_path / "pending", tmp_path / "bad"
    shutil.copytree(adapters["qv16"][0], bad)
    (bad / "adapter_config.json").write_text(json.dumps({**json.loads(
        (bad / "adapter_config.json").read_text()), "r": 64}))
    write([("filed", pending), ("bad", bad), ("all8", adapters["qv16"][0])])
    assert not sync.sync(engine)  # "filed" is not there yet; "bad" and "all8" are refused
    assert set(sync.failed) == {"bad", "all8"} and "rank 64" in sync.failed["bad"][1]
    shutil.copytree(adapters["qv16"][0], pending)
    assert sync.sync(engine) and "filed" in engine.model_info.lora_names
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert (llm.generate(PROMPTS[:1], params, lora="filed")[0].token_ids
            == llm.generate(PROMPTS[:1], params, lora="qv16")[0].token_ids)
    assert not sync.sync(engine)  # nothing changed: nothing tried again
    write([("all8", adapters["qv16"][0])])
    assert sync.sync(engine)
    assert "filed" not in engine.loras and sorted(engine.loras) == ["all8", "qv16"]  # all8 is not the file's


def test_the_server_loads_and_unloads_adapters_at_run_time(start_server, adapters, hf_model, llm, tmp_path):
    """`sluice serve --allow-runtime-lora-updates --lora-root --api-key --admin-api-key` (engine core in its own
    process): POST /v1/load_lora_adapter serves an adapter from under the root as one given at start would be (HF +
    PEFT's greedy tokens), behind the admin key (the inference key is not enough); bad calls are a 400 naming the
    field or a 404; after /v1/unload_lora_adapter the model is gone; the --lora-modules-file is re-read while the
    server runs."""
    import json
    import time

    import httpx
    from openai import AuthenticationError, NotFoundError, OpenAI

    modules = tmp_path / "adapters.json"
    # The adapters (and tmp_path) are directories under pytest's base temp directory: that is the root.
    root = adapters["all8"][0].parent
    assert adapters["qv16"][0].parent == root and tmp_path.is_relative_to(root)
    server = start_server("--enable-lora", "--max-loras", "2", "--max-model-len", "256", "--api-key", "sekret",
                          "--admin-api-key", "admin-sekret", "--allow-runtime-lora-updates", "--lora-root", str(root),
                          "--lora-modules-file", str(modules))
    key = {"Authorization": "Bearer admin-sekret"}
    client = OpenAI(base_url=f"{server.url}/v1", api_key="sekret", timeout=300)
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{server.url}/v1", api_key="wrong").models.list()
    assert httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/"}).status_code == 401
    inference_key = {"Authorization": "Bearer sekret"}
    assert httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/"},
                      headers=inference_key).status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # probes stay open

    def call(route, **body):
        return httpx.post(f"{server.url}/v1/{route}", json=body, headers=key, timeout=60)

    r = call("load_lora_adapter", lora_name="sql", lora_path=str(adapters["all8"][0]))
    assert r.status_code == 200, r.text
    assert {m.id: m.parent for m in client.models.list().data if m.id != server.model} == {"sql": server.model}
    r = client.completions.create(model="sql", prompt=PROMPTS[0], max_tokens=TOKENS, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert r.model == "sql"
    got = [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]
    assert got == hf_greedy(adapters["all8"][1], llm.tokenizer, PROMPTS[0])[0]

    bad = call("load_lora_adapter", lora_name="sql", lora_path=str(adapters["qv16"][0]))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_name", bad.text
    assert "already loaded" in bad.json()["error"]["message"]
    bad = call("load_lora_adapter", lora_name="missing", lora_path=str(tmp_path / "nowhere"))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path", bad.text
    bad = call("load_lora_adapter", lora_name="sql2")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path", bad.text
    bad = call("unload_lora_adapter", lora_name="nope")
    assert bad.status_code == 404 and bad.json()["error"]["param"] == "lora_name", bad.text

    assert call("unload_lora_adapter", lora_name="sql").status_code == 200
    with pytest.raises(NotFoundError, match="model_not_found|does not exist"):
        client.completions.create(model="sql", prompt="Hi", max_tokens=2)

    # The modules file, written after the start: read within a poll or two.
    modules.write_text(json.dumps({"adapters": [{"name": "filed", "path": str(adapters["qv16"][0])}]}))
    deadline = time.monotonic() + 30
    while "filed" not in {m.id for m in client.models.list().data}:
        assert time.monotonic() < deadline, "the adapter in --lora-modules-file was not loaded"
        time.sleep(0.2)
    r = client.completions.create(model="filed", prompt=PROMPTS[1], max_tokens=TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.model == "filed" and r.choices[0].text


def test_runtime_lora_routes_are_off_unless_allowed(start_server):
    import httpx

    server = start_server("--enable-lora", "--max-model-len", "256")
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"})
    assert r.status_code == 404 and "--allow-runtime-lora-updates" in r.json()["error"]["message"]


def test_lora_metrics_split_tokens_and_requests_by_adapter(llm):
    """The vLLM-shaped info gauge and the per-adapter counters (docs/metrics.md), from a real step loop."""
    from prometheus_client.parser import text_string_to_metric_families

    from sluice_engine.metrics import PrometheusExporter

    engine = llm.engine
    before = engine.stats_snapshot()
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    ids = llm.tokenizer.encode(PROMPTS[0])
    engine.add_request("m-a", ids, params, lora_name="all8")
    engine.add_request("m-b", ids, params, lora_name="qv16")
    engine.add_request("m-c", ids, params)
    engine.step()
    mid = engine.stats_snapshot()
    assert mid.max_lora == 2 and mid.lora_running == ("all8", "qv16")
    while engine.has_unfinished():
        engine.step()
    snap = engine.stats_snapshot()
    for name in ("all8", "qv16"):
        assert snap.lora_generation_tokens[name] - before.lora_generation_tokens.get(name, 0) == 5
        assert snap.lora_prompt_tokens[name] - before.lora_prompt_tokens.get(name, 0) == len(ids)
        assert snap.lora_requests[name] - before.lora_requests.get(name, 0) == 1
    assert snap.lora_running == () and snap.lora_waiting == ()
    body, _ = PrometheusExporter(engine).render()
    fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
    (info,) = fams["sluice_lora_requests_info"].samples
    assert info.labels["max_lora"] == "2" and info.labels["running_lora_adapters"] == ""
    gen = {s.labels["adapter"]: s.value for s in fams["sluice_lora_generation_tokens"].samples
           if s.name.endswith("_total")}
    assert gen == {k: float(v) for k, v in snap.lora_generation_tokens.items()}


# -- a Q4_1 base (the bundled GGUF's blocks, served as they are on CPU) with a float adapter ---------------------
TEXTS = ["The capital of France is Paris. It is known for the Eiffel Tower, the Louvre museum and its cafes along "
         "the river Seine, where people sit for hours.",
         "Once upon a time there was a little fox who lived at the edge of a great forest. Every morning she "
         "walked to the river to drink."]


# PEFT's random B (init_lora_weights=False) moves logprobs by nats; at 0.4 of it the adapter moves them by ~0.6
# nats (a fine-tune's size). The error of the base's block-quantized activations grows with how far an adapter
# pushes the activations: at PEFT's full scale it is 2.5x the base's own, at 0.4 it is the base's.
LORA_B_SCALE = 0.4


def hf_prompt_logprobs(model, tokenizer, text: str) -> list[float]:
    ids = tokenizer.encode(text)
    with torch.no_grad():
        lps = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    return [lps[i - 1, t].item() for i, t in enumerate(ids) if i]


def test_a_q4_1_base_with_an_adapter_is_as_close_to_hf_peft_as_the_base_is_to_hf(hf_model, tmp_path):
    """Acceptance 1, the quantized half. The Q4_1 base differs from the fp32 weights it was converted to (its GEMM
    quantizes activations per block, as llama.cpp's does): the adapter's requests on it must be as close to HF +
    PEFT (fp32) as the base's requests are to HF, teacher-forced over the same texts, with the adapter changing the
    logprobs far more than that. (An adapter at PEFT's own random scale: one scaled far beyond it drives the
    activations where the block quantization's error grows for the base alone too.)"""
    import statistics

    from sluice_engine.entrypoints.llm import LLM

    torch.manual_seed(3)
    peft_model = peft.get_peft_model(copy.deepcopy(hf_model), peft.LoraConfig(
        init_lora_weights=False, r=8, lora_alpha=16, target_modules=list(PROJECTIONS))).eval()
    with torch.no_grad():  # PEFT's random B moves logprobs by nats: to a fine-tune's size (tenths of a nat)
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.mul_(LORA_B_SCALE)
    peft_model.save_pretrained(tmp_path / "nat")
    q41 = LLM(None, max_model_len=256, enable_lora=True, lora_modules=[f"nat={tmp_path / 'nat'}"], max_loras=1,
              kv_cache_memory=64 << 20)
    try:
        layer = q41.engine.runner.model.layers[0].mlp.down_proj
        assert type(layer.base).__name__ == "GgufBlockLinear"
        tok = q41.tokenizer
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
        ours = {lora: [[lp for lp, _ in o.prompt_logprobs] for o in q41.generate(TEXTS, params, lora=lora)]
                for lora in (None, "nat")}
    finally:
        q41.engine.shutdown()
        # On the quantized layer itself the adapter adds exactly B A x (scaled) to the base's own output.
        from sluice_engine.forward_context import ForwardContext, forward_context
        from sluice_engine.lora.ops import LoRASegments

        x = torch.randn(5, layer.in_features)
        with forward_context(ForwardContext(None, [], LoRASegments([0], [5], [1]))):
            y = layer(x.clone())
        a, b = layer.a[1, : layer.max_rank], layer.b_down_proj[1]
        assert torch.allclose(y - layer.base(x.clone()), (x @ a.T) @ b.T, atol=1e-4)
    ref = {None: [hf_prompt_logprobs(hf_model, tok, t) for t in TEXTS],
           "nat": [hf_prompt_logprobs(peft_model, tok, t) for t in TEXTS]}

    def gaps(a, b):
        return [abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]

    base, lora, effect = gaps(ours[None], ref[None]), gaps(ours["nat"], ref["nat"]), gaps(ref["nat"], ref[None])
    print(f"mean |dlogprob|: Q4_1 base vs HF {statistics.mean(base):.4f}, Q4_1 + adapter vs HF + PEFT "
          f"{statistics.mean(lora):.4f}, the adapter's own effect {statistics.mean(effect):.4f}")
    assert statistics.mean(effect) > 4 * statistics.mean(base)  # the adapter matters beyond the base's noise
    assert statistics.mean(lora) <= 1.5 * statistics.mean(base) + 0.01
    p90 = int(0.9 * len(base))
    print(f"90th percentile: base {sorted(base)[p90]:.4f}, adapter {sorted(lora)[p90]:.4f}")
    assert sorted(lora)[p90] <= 1.5 * sorted(base)[p90] + 0.02


# -- sharded: tensor and pipeline parallel ranks (gloo) ----------------------------------------------------------
@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 3}, {"pipeline_parallel_size": 2}], ids=["tp3", "pp2"])
def test_sharded_layouts_serve_adapters_like_hf_with_peft(model_dir, adapters, hf_model, layout):
    """Acceptance 1 over several ranks: every rank loads its shard of each adapter (B's rows of a column-parallel
    layer, A's columns of a row-parallel one; a stage its own layers), and base + both adapters in one batch give
    HF + PEFT's greedy tokens and logprobs within 1e-3. (The bundled model's 9 heads split over 3 ranks, not 2;
    TP 2 is checked on a small model in test_sharded_lora_logits_match_one_rank.)"""
    from sluice_engine.executor.launcher import free_port

    mods = [f"{n}={d}" for n, (d, _) in adapters.items()]
    llm = LLM(str(model_dir), max_model_len=256, enable_lora=True, lora_modules=mods, max_loras=2, max_lora_rank=16,
              kv_cache_memory=64 << 20, master_port=free_port("127.0.0.1"), **layout)
    try:
        jobs = [(p, name) for p in PROMPTS[:2] for name in (None, "all8", "qv16")]
        outs = llm.generate([p for p, _ in jobs], SamplingParams(max_tokens=TOKENS, temperature=0, logprobs=0,
                                                                 ignore_eos=True), lora=[n for _, n in jobs])
        for (prompt, name), out in zip(jobs, outs, strict=True):
            want, want_lps = hf_greedy(hf_model if name is None else adapters[name][1], llm.tokenizer, prompt)
            assert out.token_ids == want, (prompt, name)
            assert max(abs(a - b) for (a, _), b in zip(out.logprobs, want_lps, strict=True)) < 1e-3, (prompt, name)
    finally:
        llm.engine.shutdown()
        from sluice_engine.distributed.parallel_state import destroy_distributed

        destroy_distributed()
