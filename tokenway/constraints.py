"""A structured-outputs constraint as an llguidance grammar: render checks a request's with
it before anything is queued, and the simulated engine decodes under it.

llguidance takes JSON schemas, regular expressions and Lark grammars (GBNF converted), needs
no torch, and is one of vLLM's own backends. Structural tags (xgrammar's format) are passed
to engines as they came, unchecked here; vLLM checks them itself.
"""

from __future__ import annotations

import json

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import gbnf_to_lark

from tokenway.wire import StructuredOutputs


class Unsupported(ValueError):
    """A constraint llguidance does not take (a structural tag)."""


def grammar(so: StructuredOutputs) -> str:
    """The llguidance grammar of `so`'s one constraint."""
    if so.json is not None:
        return LLMatcher.grammar_from_json_schema(so.json)
    if so.json_object:
        return LLMatcher.grammar_from_json_schema({"type": "object"})
    if so.regex is not None:
        return LLMatcher.grammar_from_regex(so.regex)
    if so.choice is not None:
        return LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, so.choice)))
    if so.grammar is not None:
        lark = gbnf_to_lark(so.grammar) if "::=" in so.grammar else so.grammar
        return LLMatcher.grammar_from_lark(lark)
    raise Unsupported("structural tags are not decoded here")


def problem(so: StructuredOutputs) -> str | None:
    """Why the constraint cannot be decoded (its schema, regex or grammar is not valid),
    or None."""
    try:
        text = grammar(so)
    except Unsupported:
        return None
    except (ValueError, TypeError, RuntimeError) as exc:  # what the compilers raise
        return str(exc)
    return LLMatcher.validate_grammar(text) or None
