"""Structured output: grammars (JSON schema, regex, choice, EBNF) compiled with xgrammar, applied as
per-request token masks inside the continuous batch, and tool calling built on them."""

from .constraint import GrammarConstraint
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
