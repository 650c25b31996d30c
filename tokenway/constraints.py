"""A structured-outputs constraint as an llguidance grammar: render checks a request's with
it before anything is queued, and the simulated engine decodes under it.

llguidance takes JSON schemas, regular expressions and Lark grammars (GBNF converted), needs
no torch, and is one of vLLM's own backends. Structural tags (xgrammar's format) become Lark
grammars (`tokenway.tag_grammar`); one with a format kind that has no Lark counterpart goes
to engines unchecked, and vLLM checks it itself.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

from tokenway import tag_grammar
from tokenway.tag_grammar import Unsupported
from tokenway.wire import StructuredOutputs


def grammar(so: StructuredOutputs, tokens: Mapping[str, int] | None = None) -> str:
    """The llguidance grammar of `so`'s one constraint (`tokens`: the vocabulary's added
    tokens, which a structural tag's text may spell)."""
    if so.json is not None:
        return LLMatcher.grammar_from_json_schema(so.json)
    if so.json_object:
        return LLMatcher.grammar_from_json_schema({"type": "object"})
    if so.regex is not None:
        return LLMatcher.grammar_from_regex(so.regex)
    if so.choice is not None:
        return LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, so.choice)))
    if so.grammar is not None:
        lark = _lark_of_gbnf(so.grammar) if "::=" in so.grammar else so.grammar
        return LLMatcher.grammar_from_lark(lark)
    assert so.structural_tag is not None
    try:
        tag = json.loads(so.structural_tag)
    except ValueError:
        raise ValueError("the structural tag is not JSON") from None
    return LLMatcher.grammar_from_lark(tag_grammar.lark(tag, tokens))


def _lark_of_gbnf(text: str) -> str:
    """A GBNF grammar as Lark; ValueError where the converter cannot read it. Besides its
    own error it raises a bare Exception for a missing rule (or no `root`), and an
    IndexError reading past an escape the grammar's end cuts off (`root ::= "\\`): the
    client's grammar each time. Any other exception is a bug and stays one."""
    try:
        return gbnf_to_lark(text)
    except GbnfToLarkError as exc:
        raise ValueError(str(exc)) from exc
    except IndexError as exc:
        raise ValueError("incomplete escape sequence at the end of the grammar") from exc
    except Exception as exc:
        if type(exc) is not Exception:
            raise
        raise ValueError(str(exc)) from exc


def problem(so: StructuredOutputs) -> str | None:
    """Why the constraint cannot be decoded (its schema, regex or grammar is not valid),
    or None."""
    try:
        text = grammar(so)
    except Unsupported:  # goes unchecked, but for the grammars in it (vLLM refuses a bad one)
        assert so.structural_tag is not None
        for inner in _grammars(so.structural_tag):
            if not isinstance(inner, str) or not inner.strip():
                return "a grammar format in it has no grammar text"
            if (why := problem(StructuredOutputs(grammar=inner))) is not None:
                return f"a grammar format in it is not valid: {why}"
        return None
    except (ValueError, TypeError, RuntimeError) as exc:  # what the compilers raise
        return str(exc)
    return LLMatcher.validate_grammar(text) or None


def _grammars(tag: str) -> list[object]:
    """The grammars of a structural tag's `grammar` formats (tag_grammar has read it as
    far as the first format it cannot decode, so it is JSON)."""
    found, todo = [], [json.loads(tag).get("format")]
    while todo:
        fmt = todo.pop()
        if isinstance(fmt, list):
            todo.extend(fmt)
        elif isinstance(fmt, dict):
            if fmt.get("type") == "grammar":
                found.append(fmt.get("grammar"))
            todo.extend(fmt.get(key) for key in ("content", "elements", "tags"))
    return found
