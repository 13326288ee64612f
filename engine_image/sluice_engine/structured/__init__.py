"""Structured output: grammars (JSON schema, regex, choice, EBNF) compiled with xgrammar, applied as
per-request token masks inside the continuous batch, and tool calling built on them."""

from .grammar import CompiledGrammar, GrammarError, GrammarSpec, StructuredOutputs, grammar_spec
from .tools import ToolCallParser, ToolPlan, plan_tools, render_messages, template_renders_tools

__all__ = [
    "CompiledGrammar",
    "GrammarConstraint",
    "GrammarError",
    "GrammarSpec",
    "StructuredOutputs",
    "ToolCallParser",
    "ToolPlan",
    "grammar_spec",
    "plan_tools",
    "render_messages",
    "template_renders_tools",
]


def __getattr__(name: str):
    # GrammarConstraint holds tensors: torch is imported only by who applies one (the engine), so the API process,
    # which compiles grammars to check them, stays free of it.
    if name == "GrammarConstraint":
        from .constraint import GrammarConstraint

        return GrammarConstraint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
