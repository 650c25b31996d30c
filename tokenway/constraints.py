"""A structured-outputs constraint as an llguidance grammar: render checks a request's with
it before anything is queued, and the simulated engine decodes under it. Its form (one kind,
each well formed) is checked by whoever takes a constraint in (`check_form`), an owner too.

llguidance takes JSON schemas, regular expressions and Lark grammars (GBNF converted), needs
no torch, and is one of vLLM's own backends. Structural tags (xgrammar's format) are checked
as xgrammar checks them and become Lark grammars (`tokenway.tag_grammar`); a well-formed one
with a format kind that has no Lark counterpart is checked as far as llguidance can (its
schemas, patterns and grammars compile), and vLLM decodes the rest.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from llguidance import LLMatcher

from tokenway import tag_grammar
from tokenway.errors import InvalidRequest
from tokenway.tag_grammar import Unsupported, lark_of_gbnf
from tokenway.wire import StructuredOutputs

KINDS = "json, regex, choice, grammar, json_object or structural_tag"


def check_form(so: StructuredOutputs, param: str) -> None:
    """vLLM's request checks of a constraint, none of which compiles anything: exactly one
    kind, and that one well formed. `InvalidRequest` naming `param`."""
    kinds = so.kinds()
    if len(kinds) > 1:
        raise InvalidRequest(
            f"only one kind of structured outputs constraint may be given ({KINDS}); "
            f"this request gives {', '.join(kinds)}",
            param=param,
        )
    if not kinds:
        raise InvalidRequest(f"structured_outputs gives no constraint: one of {KINDS}", param=param)
    if so.choice is not None and not so.choice:
        raise InvalidRequest("Choice '[]' cannot be an empty list", param=param)
    for kind in ("grammar", "json", "structural_tag"):
        value = getattr(so, kind)
        if isinstance(value, str) and not value.strip():
            raise InvalidRequest(
                f"structured_outputs.{kind} cannot be an empty string", param=param
            )
    if so.json_object is False:
        raise InvalidRequest(
            "structured_outputs.json_object must be True if set; omit structured_outputs to "
            "disable structured outputs",
            param=param,
        )
    if so.regex is not None and "\x00" in so.regex:
        raise InvalidRequest(
            "structured_outputs.regex must not contain a NUL character", param=param
        )
    if so.structural_tag is not None:
        try:
            json.loads(so.structural_tag)
        except ValueError:
            raise InvalidRequest("Invalid structural tag specification.", param=param) from None


def check(so: StructuredOutputs, param: str) -> None:
    """Its form, and that it compiles (which may take a while for a large schema, and recurse
    as deep as a grammar's rules chain: off the event loop, on a big stack)."""
    check_form(so, param)
    if (why := problem(so)) is not None:
        raise InvalidRequest(
            f"the structured outputs {so.kinds()[0]} is not valid: {why}", param=param
        )


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
        lark = lark_of_gbnf(so.grammar) if "::=" in so.grammar else so.grammar
        return LLMatcher.grammar_from_lark(lark)
    assert so.structural_tag is not None
    try:
        tag = json.loads(so.structural_tag)
    except ValueError:
        raise ValueError("the structural tag is not JSON") from None
    return LLMatcher.grammar_from_lark(tag_grammar.lark(tag, tokens))


def problem(so: StructuredOutputs) -> str | None:
    """Why the constraint cannot be decoded (its schema, regex, grammar or structural tag is
    not valid), or None."""
    try:
        text = grammar(so)
    except Unsupported:  # vLLM decodes it: what llguidance compiles of it is checked
        assert so.structural_tag is not None
        text = LLMatcher.grammar_from_lark(tag_grammar.checked(json.loads(so.structural_tag)))
    except (ValueError, TypeError, RuntimeError) as exc:  # what the compilers raise
        return str(exc)
    return LLMatcher.validate_grammar(text) or None
