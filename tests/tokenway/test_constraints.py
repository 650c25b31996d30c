"""Whether a constraint can be decoded (`problem`), for each way llguidance fails on the
client's text: a reason to refuse it with, never an exception out of render."""

from __future__ import annotations

import json

import pytest

from tokenway.constraints import grammar, problem
from tokenway.wire import StructuredOutputs


def tag(fmt: dict) -> StructuredOutputs:
    return StructuredOutputs(structural_tag=json.dumps({"type": "structural_tag", "format": fmt}))


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("root ::= ((", "Expected ')'"),  # the converter's own error
        ("root ::= foo", "Rule 'foo' not found"),  # a bare Exception
        ('a ::= "x"', "No 'root' rule found"),  # a bare Exception
        ('root ::= "\\', "incomplete escape"),  # an IndexError past the text's end
        ("root ::= [\\", "incomplete escape"),
        ("root ::= [z-a]", "invalid character class"),  # llguidance's Lark compiler
        ("start: ((", "Expected token"),  # a Lark grammar
        ("root ::= " + "(" * 5000 + '"a"' + ")" * 5000, "recursion"),
    ],
    ids=["unclosed", "missing-rule", "no-root", "cut-escape", "cut-class-escape", "bad-range",
         "lark", "too-deep"],
)  # fmt: skip
def test_a_grammar_that_does_not_parse_has_a_reason(text: str, says: str) -> None:
    why = problem(StructuredOutputs(grammar=text))
    assert why is not None and says in why, why
    if "::=" in text and says not in ("invalid character class", "recursion"):
        with pytest.raises(ValueError):  # what the simulated engine is told as well
            grammar(StructuredOutputs(grammar=text))


def test_a_grammar_that_parses_has_none() -> None:
    assert problem(StructuredOutputs(grammar='root ::= "a" | "b" [0-9]+')) is None
    assert problem(StructuredOutputs(grammar='start: "a" | "b"')) is None


@pytest.mark.parametrize(
    ("fmt", "says"),
    [
        ({"type": "grammar", "grammar": "root ::= (("}, "Expected ')'"),
        ({"type": "tag", "begin": "<a>", "end": "</a>",
          "content": {"type": "grammar", "grammar": "root ::= foo"}}, "Rule 'foo'"),
        ({"type": "triggered_tags", "triggers": ["<a>"], "tags": [{"type": "tag",
          "begin": "<a>", "end": "</a>", "content": {"type": "grammar", "grammar": "start: (("}}]},
         "Expected ::="),
        ({"type": "sequence", "elements": [{"type": "grammar", "grammar": 5}]}, "no grammar"),
    ],
    ids=["top", "in-a-tag", "in-triggered-tags", "not-a-text"],
)  # fmt: skip
def test_a_grammar_in_a_structural_tag_that_does_not_parse_has_a_reason(
    fmt: dict, says: str
) -> None:
    """A grammar format's grammar is EBNF (xgrammar's reading: a Lark one does not parse
    there), which vLLM refuses when it does not parse."""
    why = problem(tag(fmt))
    assert why is not None and "grammar format" in why and says in why, why


def test_a_structural_tag_with_a_grammar_that_parses_has_none() -> None:
    assert problem(tag({"type": "grammar", "grammar": 'root ::= "a"'})) is None
