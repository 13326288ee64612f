"""Tool calling: the output parser (streamed at any split), the tools' prompt and grammar, and,
through a real `sluice serve`, the `openai` client's tools API with every tool_choice, streaming and
not (acceptance 4 of issue 7)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from openai import OpenAI

from sluice_engine.structured import (
    GrammarError,
    StructuredOutputs,
    ToolCallParser,
    plan_tools,
    render_messages,
)
from sluice_engine.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "pattern": "^[A-Z][a-z]{2,12}/[A-Z][a-z]{2,12}$"}},
                   "required": ["timezone"]}}}
PING = {"type": "function", "function": {"name": "ping", "description": "No arguments."}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in (WEATHER, TIME, PING)}

OUTPUT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Pa{ris}\\""}}\n</tool_call>')


# -- the parser ----------------------------------------------------------------------------------
def _stream(parser: ToolCallParser, pieces: list[str]) -> tuple[str, dict[int, dict]]:
    content, calls = "", {}
    for i, piece in enumerate(pieces):
        c, deltas = parser.feed(piece)
        if i == len(pieces) - 1:
            c2, d2 = parser.finish()
            c, deltas = c + c2, deltas + d2
        content += c
        for d in deltas:
            if "id" in d:  # a call starts: id, type and name come first, once
                assert d["index"] == len(calls) and d["type"] == "function" and d["function"]["name"]
                calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return content, calls


def test_parser_splits_content_and_calls():
    p = ToolCallParser()
    content, calls = _stream(p, [OUTPUT])
    assert content == p.content == "Let me check. "
    assert [(c.name, json.loads(c.arguments)) for c in p.calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": 'Europe/Pa{ris}"'})]
    assert [calls[i]["arguments"] for i in range(2)] == [c.arguments for c in p.calls]
    assert len({c.id for c in p.calls}) == 2 and all(c.id.startswith("call_") for c in p.calls)


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_parser_gives_the_same_result_at_any_split(step):
    whole = ToolCallParser()
    _stream(whole, [OUTPUT])
    p = ToolCallParser()
    content, calls = _stream(p, [OUTPUT[i : i + step] for i in range(0, len(OUTPUT), step)])
    assert content == whole.content
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(c.name, c.arguments) for c in whole.calls]


def test_parser_holds_back_only_what_could_start_a_call():
    p = ToolCallParser()
    assert p.feed("a <tool_c") == ("a ", [])
    assert p.feed("ar is a word") == ("<tool_car is a word", [])
    assert p.finish() == ("", [])
    p = ToolCallParser()
    assert p.feed("x <tool_call>not json</tool_call> y") == ("x <tool_call>not json</tool_call> y", [])
    assert not p.calls
    # Cut off mid-call (finish_reason length): the call keeps the arguments that arrived.
    p = ToolCallParser()
    _stream(p, ['<tool_call>\n{"name": "ping", "arguments": {"a": [1, 2'])
    assert [(c.name, c.arguments) for c in p.calls] == [("ping", '{"a": [1, 2')]


# -- the plan, the prompt, the grammar ------------------------------------------------------------
def test_tool_choice_validation():
    assert plan_tools(None, None) is None and plan_tools(TOOLS, "none") is None
    assert plan_tools(TOOLS, None).mode == "auto"
    plan = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert plan.mode == "named" and [f["name"] for f in plan.functions] == ["get_time"]
    assert plan_tools([PING], "required").functions[0]["parameters"] == {"type": "object", "properties": {}}
    assert plan_tools(TOOLS, "required", parallel_tool_calls=False).parallel is False
    for tools, choice, param in ((TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
                                 (TOOLS, "sometimes", "tool_choice"), (None, "required", "tool_choice"),
                                 ([{"type": "code_interpreter"}], "auto", "tools"),
                                 ([{"type": "function", "function": {"name": "bad name!"}}], "auto", "tools"),
                                 ([WEATHER, WEATHER], "auto", "tools")):
        with pytest.raises(GrammarError) as e:
            plan_tools(tools, choice)
        assert e.value.param == param


def test_prompt_for_a_template_without_tools():
    plan = plan_tools(TOOLS, "auto")
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    msgs = render_messages(history, plan, native=False)
    assert msgs[0]["role"] == "system" and '"name": "get_weather"' in msgs[0]["content"]
    assert "<tool_call>" in msgs[0]["content"]
    assert msgs[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                       '{"city": "Paris", "unit": "celsius"}}\n</tool_call>'}
    assert msgs[3] == {"role": "user", "content": "<tool_response>\n18 C, sunny\n</tool_response>"}
    # A system prompt of the user's own is kept, the tools appended to it.
    msgs = render_messages([{"role": "system", "content": "Be brief."}, history[0]], plan, native=False)
    assert msgs[0]["content"].startswith("Be brief.\n\n# Tools") and len(msgs) == 2
    # A template that renders tools itself gets the messages as they are (arguments as objects).
    native = render_messages(history, plan, native=True)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "celsius"}


@pytest.fixture(scope="module")
def structured(model_dir) -> StructuredOutputs:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return StructuredOutputs(Tokenizer.from_dir(model_dir), vocab, [2])


def test_grammar_holds_calls_to_the_tools(structured):
    def accepts(choice, text, parallel=True):
        c = structured.constraint(structured.compile_sync(plan_tools(TOOLS, choice, parallel).grammar()))
        return c.matcher.accept_string(text)

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    assert accepts("auto", "Sure! " + call) and accepts("auto", "No tools needed.")
    assert accepts("required", call + "\n" + call.replace("Oslo", "Rome"))
    assert not accepts("required", "Sure! " + call)  # required: calls only
    assert not accepts("required", call + "\n" + call, parallel=False)
    assert not accepts("auto", call.replace("get_weather", "get_wether"))
    assert not accepts("auto", call.replace('"celsius"', '"kelvin"'))
    assert not accepts({"type": "function", "function": {"name": "get_time"}}, call)


# -- through the server --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--max-model-len", "2048", "--max-num-seqs", "16", "--kv-cache-memory", "256MiB",
                        "--speculative-method", "ngram")


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=600, max_retries=0)


ASK = [{"role": "user", "content": "What's the weather like in Paris right now?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _check_calls(calls, names=None):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert names is None or c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def _collect_stream(stream):
    """A streamed reply assembled by hand, checking the OpenAI delta shape on the way."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for d in ch.delta.tool_calls or []:
            if d.id is not None:
                assert d.type == "function" and d.function.name and d.index not in calls
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""}
            else:
                assert d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments
        finish = ch.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.slow
def test_tool_choices_non_streaming(server, client):
    def create(**kw):
        kw = {"tools": TOOLS, "max_tokens": 80, **kw}
        return client.chat.completions.create(model=server.model, messages=ASK, temperature=0, **kw).choices[0]

    jobs = {"named": dict(tool_choice=NAMED), "required": dict(tool_choice="required", parallel_tool_calls=False),
            "auto": dict(tool_choice="auto"), "default": {}, "none": dict(tool_choice="none", max_tokens=16),
            "no_args": dict(tools=[PING], tool_choice="required", parallel_tool_calls=False)}
    with ThreadPoolExecutor(len(jobs)) as pool:
        futs = {k: pool.submit(create, **kw) for k, kw in jobs.items()}
        res = {k: f.result() for k, f in futs.items()}

    named = res["named"]
    assert named.finish_reason == "tool_calls" and named.message.content is None
    _check_calls(named.message.tool_calls, {"get_weather"})
    assert len(named.message.tool_calls) == 1

    req = res["required"]
    assert req.finish_reason == "tool_calls" and len(req.message.tool_calls) == 1
    _check_calls(req.message.tool_calls, {"get_weather", "get_time"})

    assert json.loads(res["no_args"].message.tool_calls[0].function.arguments) == {}

    for k in ("auto", "default"):  # the model decides; whatever it did must be well-formed
        c = res[k]
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls"
            _check_calls(c.message.tool_calls)
        else:
            assert c.message.content and c.finish_reason in ("stop", "length")

    none = res["none"]
    assert not none.message.tool_calls and none.message.content and none.finish_reason in ("stop", "length")


@pytest.mark.slow
def test_tool_calls_stream_in_the_openai_shape(server, client):
    kw = dict(model=server.model, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0)
    full = client.chat.completions.create(**kw, tool_choice=NAMED).choices[0]
    content, calls, finish = _collect_stream(client.chat.completions.create(**kw, tool_choice=NAMED, stream=True))
    assert finish == "tool_calls" and not content.strip()
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (t.function.name, t.function.arguments) for t in full.message.tool_calls]

    # The openai client's own streaming helper accumulates the deltas into a final message.
    with client.chat.completions.stream(**kw, tool_choice="required", parallel_tool_calls=False) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    _check_calls(final.message.tool_calls, {"get_weather", "get_time"})

    content, calls, finish = _collect_stream(client.chat.completions.create(**kw, tool_choice="auto", stream=True))
    if calls:
        assert finish == "tool_calls"
        for c in calls:
            jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])
    else:
        assert content and finish in ("stop", "length")


@pytest.mark.slow
def test_a_tool_result_goes_back_to_the_model(server, client):
    first = client.chat.completions.create(model=server.model, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                           max_tokens=80, temperature=0).choices[0].message
    history = ASK + [first.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "18 degrees and sunny"}]
    r = client.chat.completions.create(model=server.model, messages=history, tools=TOOLS, max_tokens=24,
                                       temperature=0, tool_choice="none")
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


@pytest.mark.slow
def test_bad_tool_requests_are_400s(server):
    url = f"{server.url}/v1/chat/completions"
    base = {"model": server.model, "messages": ASK, "max_tokens": 4}
    for extra, param in (
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "bogus"}}}],
          "tool_choice": "required"}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ):
        r = httpx.post(url, json={**base, **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.json())
