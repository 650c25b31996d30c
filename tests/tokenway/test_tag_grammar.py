"""Structural tags as Lark grammars: every format kind vLLM's tool tags use compiles in
llguidance, text that spells an added token asks for that token, and what is not a tag is
refused with the reason."""

from __future__ import annotations

import pytest
from llguidance import LLMatcher

from tokenway.tag_grammar import MAX_DEPTH, Unsupported, lark

SCHEMA = {"type": "json_schema", "json_schema": {"type": "object"}}
FORMATS = [
    {"type": "const_string", "value": "yes"},
    {"type": "const_string", "value": ""},
    SCHEMA,
    {"type": "json_schema", "json_schema": True},
    {"type": "regex", "pattern": "a/b+"},
    {"type": "any_text", "excludes": ["<think>"]},
    {"type": "sequence", "elements": [{"type": "const_string", "value": "x"}, SCHEMA]},
    {"type": "or", "elements": [{"type": "const_string", "value": "x"}, SCHEMA]},
    {"type": "tag", "begin": "<a>", "content": SCHEMA, "end": "</a>"},
    {"type": "optional", "content": SCHEMA},
    {"type": "plus", "content": SCHEMA},
    {"type": "star", "content": SCHEMA},
    {"type": "tags_with_separator", "tags": [{"type": "tag", "begin": "<a>", "content": SCHEMA,
     "end": "</a>"}], "separator": ",", "at_least_one": False, "stop_after_first": False},
    {"type": "triggered_tags", "triggers": ["<a>"], "tags": [{"type": "tag", "begin": "<a>",
     "content": SCHEMA, "end": "</a>"}], "at_least_one": True, "stop_after_first": True},
]  # fmt: skip


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f["type"])
def test_each_format_compiles(fmt: dict) -> None:
    grammar = LLMatcher.grammar_from_lark(lark({"type": "structural_tag", "format": fmt}))
    assert LLMatcher.validate_grammar(grammar) == ""


def test_text_that_spells_an_added_token_asks_for_the_token() -> None:
    fmt = {"type": "tag", "begin": "<|call|>get<|sep|>", "content": SCHEMA, "end": "<|end|>"}
    got = lark({"format": fmt}, {"<|call|>": 7, "<|sep|>": 8, "<|end|>": 9})
    assert '<[7]> "get" <[8]> f0 <[9]>' in got


@pytest.mark.parametrize(
    ("tag", "error", "says"),
    [
        ({"type": "structural_tag"}, ValueError, '"format" object'),
        ({"format": {"type": "grammar", "grammar": "root ::= 'a'"}}, Unsupported, "'grammar'"),
        ({"format": {"type": "tag", "begin": "a"}}, ValueError, "needs 'end'"),
        ({"format": {"type": "or", "elements": []}}, ValueError, "needs elements"),
        ({"format": {"type": "json_schema", "json_schema": 3}}, ValueError, "schema object"),
    ],
    ids=["no-format", "ebnf", "half-a-tag", "empty-or", "not-a-schema"],
)
def test_what_is_not_a_tag_is_refused_with_the_reason(
    tag: dict, error: type[Exception], says: str
) -> None:
    with pytest.raises(error, match=says):
        lark(tag)


def test_a_tag_nested_past_the_limit_is_refused_not_recursed_into() -> None:
    fmt: dict = SCHEMA
    for _ in range(MAX_DEPTH + 1):
        fmt = {"type": "optional", "content": fmt}
    with pytest.raises(ValueError, match="nest deeper"):
        lark({"format": fmt})
