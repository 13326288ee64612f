"""Structured output (xgrammar): the token masks and their batch application, grammars composed with
speculative decoding and preemption in the engine, and, through a real `sluice serve` and the
`openai` client, JSON schemas / json_object / regex / choice / EBNF, 400s for malformed specs, and
mixed batches (acceptance 3 of issue 7)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
import torch
from openai import OpenAI

from sluice_engine.entrypoints.llm import LLM
from sluice_engine.sampling_params import SamplingParams
from sluice_engine.structured import (
    GrammarConstraint,
    GrammarError,
    GrammarSpec,
    StructuredOutputs,
    grammar_spec,
)
from sluice_engine.tokenizer import Tokenizer

EOS = 2  # SmolLM2's <|im_end|>


# -- masks ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def structured(model_dir) -> StructuredOutputs:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return StructuredOutputs(Tokenizer.from_dir(model_dir), vocab, [EOS])


def _allowed(logits_row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(logits_row).nonzero().flatten().tolist())


def test_mask_allows_exactly_the_tokens_that_fit(structured):
    """The first mask of `[a-z]{2,5}` allows exactly the tokens that decode to 1-5 lowercase letters:
    checked against our own tokenizer's decoding, so the vocabulary handed to xgrammar is the right one
    (byte-level: "Ġthe" is " the" and must not fit)."""
    tok = structured.tokenizer
    c = structured.constraint(structured.compile_sync(GrammarSpec("regex", "[a-z]{2,5}", "guided_regex")))
    logits = torch.zeros(1, structured.vocab_size)
    GrammarConstraint.apply_batch(logits, [(0, c, [])])
    want = {t for t in range(structured.vocab_size) if re.fullmatch(r"[a-z]{1,5}", tok.decode([t]))}
    assert len(want) > 1000 and _allowed(logits[0]) == want


def test_apply_batch_masks_draft_rows_and_leaves_the_state_alone(structured):
    tok = structured.tokenizer
    compiled = structured.compile_sync(GrammarSpec("ebnf", 'root ::= "ab" [0-9]+ "cd"', "guided_grammar"))
    a, b = structured.constraint(compiled), structured.constraint(compiled)
    ab, one, cd = tok.token_to_id("ab"), tok.token_to_id("1"), tok.token_to_id("cd")
    assert None not in (ab, one, cd)
    assert b.valid_prefix([ab, one, one, ab, one]) == 3  # a second "ab" does not fit
    # Row 0: a plain row of `a`. Rows 1-4: `b` with drafts [ab, 1, cd]; row 1+i sees drafts[:i].
    logits = torch.zeros(6, structured.vocab_size)
    GrammarConstraint.apply_batch(logits, [(0, a, []), (1, b, [ab, one, cd])])
    assert ab in _allowed(logits[0]) and one not in _allowed(logits[0])
    assert _allowed(logits[1]) == _allowed(logits[0])
    assert one in _allowed(logits[2]) and cd not in _allowed(logits[2])
    assert {one, cd} <= _allowed(logits[3])
    assert _allowed(logits[4]) == {EOS}  # the grammar is complete: only the stop token
    assert torch.isfinite(logits[5]).all()  # an unconstrained row is untouched
    # Both matchers are where they were: b accepts "ab" again and nothing else.
    assert b.valid_prefix([ab]) == 1 and b.valid_prefix([one]) == 0


def test_a_terminated_grammar_allows_only_stop_tokens(structured):
    tok = structured.tokenizer
    c = structured.constraint(structured.compile_sync(GrammarSpec("ebnf", 'root ::= "yes"', "guided_choice")))
    for t in tok.encode("yes", add_special_tokens=False):
        c.accept(t)
    c.accept(EOS)
    assert c.matcher.is_terminated()
    c.accept(EOS)  # ignore_eos goes on emitting stop tokens: tolerated
    logits = torch.zeros(2, structured.vocab_size)
    GrammarConstraint.apply_batch(logits, [(1, c, [])])
    assert _allowed(logits[1]) == {EOS} and c.valid_prefix([EOS]) == 0


class _Fields:
    def __init__(self, **kw):
        for name in ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            setattr(self, name, kw.get(name))


def test_request_fields_map_to_grammar_specs():
    assert grammar_spec(_Fields()) is None
    assert grammar_spec(_Fields(response_format={"type": "text"})) is None
    assert grammar_spec(_Fields(response_format={"type": "json_object"})).kind == "json_object"
    spec = grammar_spec(_Fields(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"b": {}, "a": {}}}}}))
    assert spec.kind == "json_schema" and spec.source.index('"b"') < spec.source.index('"a"')  # order kept
    assert grammar_spec(_Fields(guided_json='{"type": "integer"}')).source == '{"type": "integer"}'
    assert grammar_spec(_Fields(guided_choice=['a"b', "c"])).source == 'root ::= "a\\"b" | "c"'
    assert grammar_spec(_Fields(response_format={"type": "text"}, guided_regex="x+")).kind == "regex"
    for kw, param in ((dict(response_format={"type": "xml"}), "response_format"),
                      (dict(response_format={"type": "json_schema", "json_schema": {}}), "response_format"),
                      (dict(guided_json="{nope"), "guided_json"),
                      (dict(guided_choice=[]), "guided_choice"),
                      (dict(guided_regex="a", guided_grammar="root ::= \"a\""), "guided_grammar")):
        with pytest.raises(GrammarError) as e:
            grammar_spec(_Fields(**kw))
        assert e.value.param == param


# -- in the engine: speculative decoding, preemption ----------------------------------------------
ECHO = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                          "maxItems": 4},
    "population": {"type": "integer", "minimum": 0, "maximum": 100000000}}, "required": ["city", "tags", "population"]}
ECHO_PROMPTS = [
    'Repeat this JSON exactly: {"city": "Lyon", "tags": ["food", "silk", "food"], "population": 522000}',
    'Copy: {"city": "Oslo", "tags": ["fjord", "fjord", "ski"], "population": 709000}',
    'Return {"city": "Rome", "tags": ["art", "art", "art", "pasta"], "population": 2873000} as is.',
    "Describe Paris as JSON with its city name, a few tags and its population.",
]


def _generate(llm: LLM, structured: StructuredOutputs, prompts: list[str], params: SamplingParams,
              spec: GrammarSpec) -> list[str]:
    compiled = structured.compile_sync(spec)
    texts = {}
    for i, p in enumerate(prompts):
        ids = llm.tokenizer.encode_chat([{"role": "user", "content": p}])
        llm.engine.add_request(f"r{i}", ids, params, logits_processors=[structured.constraint(compiled)])
        texts[f"r{i}"] = ""
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            texts[out.request_id] += out.new_text
            if out.finished:
                assert out.finish_reason == "stop", (out.request_id, texts[out.request_id])
    return [texts[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def spec_llm(model_dir) -> LLM:
    return LLM(str(model_dir), kv_cache_memory=32 << 20, max_model_len=512, seed=0,
               speculative_method="ngram", num_speculative_tokens=4)


@pytest.mark.slow
def test_grammar_with_speculation_is_lossless_and_drafts_are_checked(spec_llm, structured):
    """Greedy constrained output is the same with speculation (requests side by side) as without (one
    at a time, opted out), and drafts were accepted: verified against the grammar, not skipped."""
    spec = GrammarSpec("json_schema", json.dumps(ECHO), "response_format")
    off = SamplingParams(max_tokens=80, temperature=0, speculative=False)
    on = SamplingParams(max_tokens=80, temperature=0)
    want = [_generate(spec_llm, structured, [p], off, spec)[0] for p in ECHO_PROMPTS]
    stats = spec_llm.engine.stats
    before = stats.spec_accepted_tokens
    assert _generate(spec_llm, structured, ECHO_PROMPTS, on, spec) == want
    assert stats.spec_accepted_tokens > before, "no draft was accepted"
    # Sampling: drafts accepted with the masked rows' probabilities; the output still validates.
    sampled = _generate(spec_llm, structured, ECHO_PROMPTS, SamplingParams(max_tokens=80, temperature=0.7, seed=1), spec)
    for text in want + sampled:
        jsonschema.validate(json.loads(text), ECHO)


@pytest.mark.slow
def test_preempted_requests_keep_their_grammar_state(model_dir, structured):
    """Preemption recomputes the KV of the tokens so far but keeps them, so the grammar state (which
    followed those tokens) stays right."""
    # ~270 tokens of KV cache: one request fits, six at once preempt each other.
    llm = LLM(str(model_dir), kv_cache_memory=12 << 20, max_model_len=256, seed=0, speculative_method="ngram")
    spec = GrammarSpec("json_schema", json.dumps(ECHO), "response_format")
    prompts = [f"{p} (request {i})" for i in range(2) for p in ECHO_PROMPTS[:3]]  # distinct: no shared KV
    texts = _generate(llm, structured, prompts, SamplingParams(max_tokens=64, temperature=0), spec)
    assert llm.engine.scheduler.num_preemptions > 0, "the KV cache was big enough: no preemption"
    for text in texts:
        jsonschema.validate(json.loads(text), ECHO)


# -- through the server --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(start_server):
    # Speculation on: every test here also runs with drafts unless it opts out per request.
    return start_server("--max-model-len", "2048", "--max-num-seqs", "32", "--kv-cache-memory", "256MiB",
                        "--speculative-method", "ngram")


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=600, max_retries=0)


S = {"type": "string", "maxLength": 24}
SCHEMAS: list[tuple[str, dict]] = [
    ("A person: name and age.", {"type": "object", "properties": {"name": S, "age": {
        "type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]}),
    ("A postal address in Germany.", {"type": "object", "properties": {
        "street": S, "city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "country": {"enum": ["DE", "AT", "CH"]}}, "required": ["street", "city", "zip", "country"]}),
    ("A product in a shop.", {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999}, "name": S,
        "price": {"type": "number", "minimum": 0, "maximum": 1000}, "in_stock": {"type": "boolean"}},
        "required": ["id", "name", "price", "in_stock"]}),
    ("Tags for a blog post about cooking.", {"type": "object", "properties": {"tags": {
        "type": "array", "items": {"type": "string", "maxLength": 15}, "minItems": 1, "maxItems": 4}},
        "required": ["tags"]}),
    ("The colour of the sky.", {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                                "required": ["color"]}),
    ("Three small prime numbers.", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                                    "minItems": 3, "maxItems": 3}),
    ("Is water wet? Answer with your confidence.", {"type": "object", "properties": {
        "answer": {"type": "boolean"}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["answer", "confidence"]}),
    ("An online order with a customer and items.", {"type": "object", "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
        "customer": {"type": "object", "properties": {"name": S, "email": {
            "type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"}}, "required": ["name", "email"]},
        "items": {"type": "array", "maxItems": 3, "minItems": 1, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
            "qty": {"type": "integer", "minimum": 1, "maximum": 10}}, "required": ["sku", "qty"]}}},
        "required": ["order_id", "customer", "items"]}),
    ("A calendar event.", {"type": "object", "properties": {
        "title": S, "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
        "required": ["title", "date"]}),
    ("A famous novel.", {"type": "object", "properties": {
        "title": S, "author": S, "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
        "genres": {"type": "array", "items": {"enum": ["fiction", "drama", "sci-fi", "romance"]}, "maxItems": 3}},
        "required": ["title", "author", "year", "genres"]}),
    ("The coordinates of Paris.", {"type": "object", "properties": {
        "lat": {"type": "number", "minimum": -90, "maximum": 90},
        "lon": {"type": "number", "minimum": -180, "maximum": 180}}, "required": ["lat", "lon"]}),
    ("A user profile; only the username is required.", {"type": "object", "properties": {
        "username": {"type": "string", "pattern": "^[a-z]{3,12}$"}, "bio": S, "age": {
            "type": "integer", "minimum": 13, "maximum": 99}}, "required": ["username"]}),
    ("Rate the movie Titanic.", {"type": "object", "properties": {"rating": {"enum": [1, 2, 3, 4, 5]},
                                                                 "summary": S}, "required": ["rating", "summary"]}),
    ("A measurement: a value that is a label or a count.", {"type": "object", "properties": {"value": {
        "anyOf": [{"type": "string", "maxLength": 10}, {"type": "integer", "minimum": 0, "maximum": 1000}]}},
        "required": ["value"]}),
    ("A 2x2 matrix of small integers.", {"type": "object", "properties": {"matrix": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "array", "minItems": 2, "maxItems": 2,
                                                                  "items": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9}}}},
        "required": ["matrix"]}),
    ("A team with a lead and a member.", {"$defs": {"person": {"type": "object", "properties": {
        "name": S, "role": {"enum": ["dev", "ops", "pm"]}}, "required": ["name", "role"]}},
        "type": "object", "properties": {"lead": {"$ref": "#/$defs/person"}, "member": {"$ref": "#/$defs/person"}},
        "required": ["lead", "member"]}),
    ("A phone contact.", {"type": "object", "properties": {
        "name": S, "phone": {"type": "string", "pattern": "^\\+[0-9]{7,12}$"}}, "required": ["name", "phone"]}),
    ("A pet, with an optional nickname that may be null.", {"type": "object", "properties": {
        "species": {"enum": ["cat", "dog", "fish"]}, "nickname": {"type": ["string", "null"], "maxLength": 12}},
        "required": ["species", "nickname"]}),
    ("A pancake recipe.", {"type": "object", "properties": {
        "name": S, "ingredients": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"item": S, "grams": {"type": "integer", "minimum": 1, "maximum": 999}},
            "required": ["item", "grams"]}},
        "steps": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "string", "maxLength": 40}}},
        "required": ["name", "ingredients", "steps"]}),
    ("App settings.", {"type": "object", "properties": {
        "theme": {"enum": ["light", "dark"]}, "notifications": {"type": "object", "properties": {
            "email": {"type": "boolean"}, "sms": {"type": "boolean"}}, "required": ["email", "sms"]},
        "language": {"type": "string", "pattern": "^[a-z]{2}$"}}, "required": ["theme", "notifications", "language"]}),
    ("The weather in Oslo.", {"type": "object", "properties": {
        "city": S, "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
        "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
        "wind": {"type": "object", "properties": {"speed_kmh": {"type": "integer", "minimum": 0, "maximum": 300},
                                                  "direction": {"enum": ["N", "E", "S", "W"]}},
                 "required": ["speed_kmh", "direction"]}},
        "required": ["city", "temperature_c", "conditions", "wind"]}),
    ("Should I bring an umbrella?", {"enum": ["yes", "no", "maybe"]}),
    ("A server's status.", {"type": "object", "additionalProperties": False, "properties": {
        "host": {"type": "string", "pattern": "^[a-z]{2,8}[0-9]{1,2}$"}, "up": {"type": "boolean"},
        "load": {"type": "integer", "minimum": 0, "maximum": 100}}, "required": ["host", "up", "load"]}),
    ("A point in 3D with a label.", {"type": "object", "properties": {
        "label": {"type": "string", "enum": ["origin", "target"]},
        "xyz": {"type": "array", "prefixItems": [{"type": "integer", "minimum": -9, "maximum": 9}] * 3,
                "items": False, "minItems": 3}}, "required": ["label", "xyz"]}),
]
SYSTEM = {"role": "system", "content": "You reply with JSON only."}


def _chat(client, model, prompt, max_tokens=160, temperature=0, **kw):
    return client.chat.completions.create(model=model, messages=[SYSTEM, {"role": "user", "content": prompt}],
                                          max_tokens=max_tokens, temperature=temperature, **kw)


@pytest.mark.slow
def test_every_schema_output_parses_and_validates(server, client):
    assert len(SCHEMAS) >= 20

    def one(i_item):
        i, (prompt, schema) = i_item
        rf = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        if i % 4 == 3:  # some through completions and vLLM's guided_json
            r = client.completions.create(model=server.model, prompt=f"{prompt} As JSON:\n", max_tokens=160,
                                          temperature=0, extra_body={"guided_json": schema})
            return schema, r.choices[0].text, r.choices[0].finish_reason
        r = _chat(client, server.model, prompt, response_format=rf)
        return schema, r.choices[0].message.content, r.choices[0].finish_reason

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        results = list(pool.map(one, enumerate(SCHEMAS)))
    for schema, text, finish in results:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.slow
def test_json_object_regex_choice_and_grammar(server, client):
    def json_object():
        r = _chat(client, server.model, 'Give a JSON object with the keys "name" and "colour" for a cat.',
                  max_tokens=200, response_format={"type": "json_object"})
        return r.choices[0].message.content, r.choices[0].finish_reason

    def regex():
        r = client.completions.create(model=server.model, prompt="Call me on", max_tokens=20, temperature=0,
                                      extra_body={"guided_regex": r" \+44 [0-9]{4} [0-9]{6}"})
        return r.choices[0].text, r.choices[0].finish_reason

    def choice():
        r = _chat(client, server.model, "Is the sky green?", extra_body={"guided_choice": ["yes", "no", "unsure"]})
        return r.choices[0].message.content, r.choices[0].finish_reason

    grammar = 'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no" | [0-9]+'

    def ebnf():
        r = _chat(client, server.model, "What is 2 + 2?", extra_body={"guided_grammar": grammar}, max_tokens=30)
        return r.choices[0].message.content, r.choices[0].finish_reason

    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(f) for f in (json_object, regex, choice, ebnf)]
        (obj, f1), (reg, f2), (ch, f3), (gr, f4) = [f.result() for f in futs]
    assert (f1, f2, f3, f4) == ("stop",) * 4
    assert isinstance(json.loads(obj), dict)
    assert re.fullmatch(r" \+44 [0-9]{4} [0-9]{6}", reg)
    assert ch in ("yes", "no", "unsure")
    assert re.fullmatch(r"The answer is (yes|no|[0-9]+)\.", gr)


@pytest.mark.slow
def test_malformed_specs_are_400s_naming_the_field(server):
    url = f"{server.url}/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}}, "guided_json"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_grammar": 'root ::= "a" |'}, "guided_grammar"),
        ({"guided_grammar": 'start ::= "a"'}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ]
    for extra, param in cases:
        r = httpx.post(url, json={"model": server.model, "messages": msgs, "max_tokens": 4, **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", (extra, err)
    r = httpx.post(f"{server.url}/v1/completions", json={"model": server.model, "prompt": "x", "max_tokens": 4,
                                                          "guided_regex": "[z-a]"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"
    # The server is fine afterwards, and a good spec that follows a bad one compiles.
    r = httpx.post(url, json={"model": server.model, "messages": msgs, "max_tokens": 4,
                              "guided_choice": ["ok"]}, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"


@pytest.mark.slow
def test_constrained_and_free_requests_share_a_batch(server, client):
    """Constrained (some with n=2) and unconstrained requests in one continuous batch: each row gets
    its own mask, and the free ones are not held to anyone's grammar."""
    schema = SCHEMAS[0][1]
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}

    def constrained(i):
        r = _chat(client, server.model, f"Person number {i}.", response_format=rf, n=2 if i % 2 else 1,
                  temperature=0.8, seed=i)
        return [(c.message.content, c.finish_reason) for c in r.choices]

    def free(i):
        r = client.chat.completions.create(model=server.model, max_tokens=24, temperature=0, messages=[
            {"role": "user", "content": f"Say hello to person number {i} in one sentence."}])
        return r.choices[0].message.content, r.choices[0].finish_reason

    with ThreadPoolExecutor(12) as pool:
        cons = [pool.submit(constrained, i) for i in range(6)]
        frees = [pool.submit(free, i) for i in range(6)]
        cons_out = [x for f in cons for x in f.result()]
        free_out = [f.result() for f in frees]
    assert len(cons_out) == 9
    for text, finish in cons_out:
        assert finish == "stop"
        jsonschema.validate(json.loads(text), schema)
    for text, finish in free_out:
        assert finish in ("stop", "length") and text and not text.lstrip().startswith("{")


@pytest.mark.slow
def test_outputs_stay_valid_with_speculation(server, client):
    """The server runs n-gram speculation (echo prompts draft well): drafts were verified against the
    grammars and the outputs still validate. Losslessness: test_grammar_with_speculation_is_lossless..."""
    rf = {"type": "json_schema", "json_schema": {"name": "echo", "schema": ECHO}}

    def run(prompt):
        r = _chat(client, server.model, prompt, max_tokens=80, response_format=rf)
        return r.choices[0].message.content, r.choices[0].finish_reason

    drafts_before = server.metrics().get("sluice_spec_decode_num_draft_tokens_total", 0)
    with ThreadPoolExecutor(len(ECHO_PROMPTS)) as pool:
        outs = list(pool.map(run, ECHO_PROMPTS))
    assert server.metrics().get("sluice_spec_decode_num_draft_tokens_total", 0) > drafts_before
    for text, finish in outs:
        assert finish == "stop"
        jsonschema.validate(json.loads(text), ECHO)
