"""Tool calling: how the tools reach the model, the grammar its calls must follow, and a streaming
parser that turns its output into OpenAI `tool_calls`.

One format, Hermes/Qwen style (what Qwen2/2.5/3 and Hermes models are trained on):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The arguments are constrained by the tool's JSON schema, and the name to the tools given, with an
xgrammar structural tag:

- `auto`: free text in which `<tool_call>` triggers a constrained call (triggered tags); the model
  decides, the grammar only holds it to a well-formed call once it starts one.
- `required`: one or more calls, nothing else (tags separated by newlines).
- a named function: exactly that call.
- `none`: no grammar, and the tools are left out of the prompt.

A chat template that renders tools itself in this format (it mentions `tools` and `<tool_call>`)
gets them as its `tools` variable; any other template (SmolLM2's ignores tools) gets a system prompt
written here, and past calls and tool results rendered as text in the same format.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from .grammar import GrammarError, GrammarSpec

CALL_BEGIN = "<tool_call>"
CALL_END = "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# At most this many whitespace characters in a row inside arguments: room for ", " and ": ", none
# for a small model to stall in.
ARGS_MAX_WHITESPACE = 1


@dataclass(slots=True)
class ToolPlan:
    """The tools of one chat request and how the model may call them."""

    functions: list[dict[str, Any]]  # {"name", "description", "parameters"} per tool, validated
    mode: str  # "auto" | "required" | "named"
    parallel: bool = True

    def grammar(self) -> GrammarSpec:
        tags = [_call_tag(f) for f in self.functions]
        if self.mode == "named":
            fmt: dict[str, Any] = tags[0]
        elif self.mode == "required":
            fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                   "stop_after_first": not self.parallel}
        else:
            fmt = {"type": "triggered_tags", "triggers": [CALL_BEGIN], "tags": tags,
                   "stop_after_first": not self.parallel}
        return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}), "tools")

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as a chat template's `tools` variable expects them (OpenAI's shape)."""
        return [{"type": "function", "function": f} for f in self.functions]


def _call_tag(fn: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tag", "begin": f'{CALL_BEGIN}\n{{"name": "{fn["name"]}", "arguments": ',
            "content": {"type": "json_schema", "json_schema": fn["parameters"],
                        "max_whitespace_cnt": ARGS_MAX_WHITESPACE},
            "end": "}\n" + CALL_END}


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
               parallel_tool_calls: bool | None = True) -> ToolPlan | None:
    """Validates `tools` and `tool_choice` (GrammarError, a 400 naming the field); None when no tool
    may be called."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return None
    if not tools:
        raise GrammarError("tool_choice requires tools", param="tool_choice")
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise GrammarError(f"tools[{i}]: only function tools are supported: "
                               '{"type": "function", "function": {"name", "parameters"}}', param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise GrammarError(f"tools[{i}].function.name must be 1-64 of a-z, A-Z, 0-9, _ and -", param="tools")
        if any(f["name"] == name for f in functions):
            raise GrammarError(f"tools: function name {name!r} appears twice", param="tools")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}  # OpenAI: omitted means no parameters
        if not isinstance(params, dict):
            raise GrammarError(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        entry = {"name": name, "parameters": params}
        if fn.get("description"):
            entry["description"] = fn["description"]
        functions.append(entry)
    parallel = parallel_tool_calls is not False
    if tool_choice in ("auto", "required"):
        return ToolPlan(functions, tool_choice, parallel)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        chosen = [f for f in functions if f["name"] == name]
        if not chosen:
            raise GrammarError(f"tool_choice names function {name!r}, which is not in tools", param="tool_choice")
        return ToolPlan(chosen, "named", False)
    raise GrammarError('tool_choice must be "none", "auto", "required" or '
                       '{"type": "function", "function": {"name": ...}}', param="tool_choice")


# -- the prompt ------------------------------------------------------------------------------------
def template_renders_tools(chat_template: str | None) -> bool:
    """Whether a chat template lays out tools itself, in the format the grammar enforces."""
    return bool(chat_template) and "tools" in chat_template and CALL_BEGIN in chat_template


def system_prompt(functions: list[dict[str, Any]]) -> str:
    lines = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions)
    return (
        "# Tools\n\n"
        "You may call one or more of these functions to answer. Their signatures, one JSON object "
        f"per line:\n<tools>\n{lines}\n</tools>\n\n"
        "To call a function, reply with its name and arguments as a JSON object inside <tool_call></tool_call> "
        f'tags:\n{CALL_BEGIN}\n{{"name": "<function name>", "arguments": <arguments as a JSON object>}}\n{CALL_END}'
    )


def render_messages(messages: list[dict[str, Any]], plan: ToolPlan | None, native: bool) -> list[dict[str, Any]]:
    """The messages as the chat template should see them. A template that renders tools (native)
    gets them unchanged, except arguments parsed to objects as such templates expect. Otherwise the
    tools become (part of) the system prompt, an assistant's past calls become <tool_call> text, and
    a tool's result becomes a user turn in <tool_response> tags."""
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        calls = m.get("tool_calls") or []
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise ValueError(f"messages[{i}].tool_calls must be a list of tool calls")
        if native:
            if calls:
                m["tool_calls"] = [_with_parsed_arguments(c) for c in calls]
            out.append(m)
            continue
        if m.get("role") == "assistant" and calls:
            text = "\n".join(_format_call(c) for c in calls)
            m["content"] = f"{m['content']}\n{text}" if m.get("content") else text
            del m["tool_calls"]
        elif m.get("role") == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    if plan is not None and not native:
        tools_text = system_prompt(plan.functions)
        if out and out[0].get("role") in ("system", "developer") and isinstance(out[0].get("content"), str):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{tools_text}"}
        else:
            out.insert(0, {"role": "system", "content": tools_text})
    return out


def _with_parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            pass
    return {**call, "function": fn}


def _format_call(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    return f"{CALL_BEGIN}\n{json.dumps({'name': fn.get('name', ''), 'arguments': args}, ensure_ascii=False)}\n{CALL_END}"


# -- the output ------------------------------------------------------------------------------------
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # the model's JSON text, as streamed

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ToolCallParser:
    """Splits a model's output, fed piece by piece, into content and tool calls.

    feed() returns what is new as an OpenAI chat delta's parts: content text, and `tool_calls`
    entries (a call's id, type and name first, with empty arguments, then argument fragments).
    Text that could be the start of `<tool_call>` is held back until it is known not to be.
    Feeding everything and calling finish() gives the non-streaming result in `content`/`calls`.
    """

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    _buf: str = ""
    _state: str = "text"  # text | header | args | close
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _started: bool = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._buf += text
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        progressed = True
        while progressed:
            progressed = getattr(self, f"_{self._state}")(content, deltas)
        return self._take_content(content), _merge(deltas)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """At the end of the output: whatever was held back. An unfinished call keeps what arrived."""
        content, deltas = self.feed("")
        if self._state == "text" or self._state == "header":
            rest: list[str] = []
            self._emit_text(rest, self._buf if self._state == "text" else CALL_BEGIN + self._buf)
            content += self._take_content(rest)
        self._buf = ""
        return content, deltas

    def _take_content(self, parts: list[str]) -> str:
        text = "".join(parts)
        self.content += text
        return text

    def _emit_text(self, content: list[str], text: str) -> None:
        # After a call, whitespace alone (the newline between calls) is not content.
        if text and (text.strip() or not self.calls):
            content.append(text)

    def _text(self, content: list[str], deltas: list) -> bool:
        i = self._buf.find(CALL_BEGIN)
        if i >= 0:
            self._emit_text(content, self._buf[:i])
            self._buf = self._buf[i + len(CALL_BEGIN):]
            self._state = "header"
            return True
        keep = _partial_suffix(self._buf, CALL_BEGIN)
        self._emit_text(content, self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _header(self, content: list[str], deltas: list) -> bool:
        m = _HEADER.match(self._buf)
        if m is None:
            end = self._buf.find(CALL_END)
            if end < 0:
                return False  # wait for more
            # Not a call after all (only possible without the grammar): it was text.
            self._emit_text(content, CALL_BEGIN + self._buf[: end + len(CALL_END)])
            self._buf = self._buf[end + len(CALL_END):]
            self._state = "text"
            return True
        call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", json.loads(f'"{m.group(1)}"'))
        self.calls.append(call)
        deltas.append({"index": len(self.calls) - 1, "id": call.id, "type": "function",
                       "function": {"name": call.name, "arguments": ""}})
        self._buf = self._buf[m.end():]
        self._state = "args"
        self._depth, self._in_string, self._escaped, self._started = 0, False, False, False
        return True

    def _args(self, content: list[str], deltas: list) -> bool:
        out = []
        done_at = -1
        for i, ch in enumerate(self._buf):
            if not self._started:
                if ch.isspace():
                    continue
                self._started = True
            out.append(ch)
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    done_at = i
                    break
        fragment = "".join(out)
        if fragment:
            call = self.calls[-1]
            call.arguments += fragment
            deltas.append({"index": len(self.calls) - 1, "function": {"arguments": fragment}})
        if done_at < 0:
            self._buf = ""
            return False
        self._buf = self._buf[done_at + 1:]
        self._state = "close"
        return True

    def _close(self, content: list[str], deltas: list) -> bool:
        i = self._buf.find(CALL_END)
        if i < 0:
            return False  # the '}' closing the call object and the newline: framing, not output
        self._buf = self._buf[i + len(CALL_END):]
        self._state = "text"
        return True


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _merge(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive argument fragments of one call become one entry."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        prev = out[-1] if out else None
        if prev is not None and prev["index"] == d["index"] and "id" not in d:
            prev["function"]["arguments"] += d["function"]["arguments"]
        else:
            out.append({**d, "function": dict(d["function"])})
    return out
