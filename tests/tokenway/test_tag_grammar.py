"""Structural tags as Lark grammars: every format kind vLLM's tool tags use compiles in
llguidance, text that spells an added token asks for that token, the older form is served
as vLLM reads it, what vLLM's xgrammar refuses is refused with the reason and where, and a
well-formed kind without a rule here is `Unsupported` (vLLM decodes it)."""

from __future__ import annotations

import re

import pytest
from llguidance import LLMatcher

from tokenway.tag_grammar import MAX_DEPTH, Unsupported, checked, lark

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
    {"type": "grammar", "grammar": 'root ::= "{" [a-z]+ "}"'},
    {"type": "token", "token": 7},
    {"type": "tag", "begin": "<a>", "content": {"type": "any_text"}, "end": ["</a>", "</b>"]},
]  # fmt: skip


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f["type"])
def test_each_format_compiles(fmt: dict) -> None:
    grammar = LLMatcher.grammar_from_lark(lark({"type": "structural_tag", "format": fmt}))
    assert LLMatcher.validate_grammar(grammar) == ""


def test_text_that_spells_an_added_token_asks_for_the_token() -> None:
    fmt = {"type": "tag", "begin": "<|call|>get<|sep|>", "content": SCHEMA, "end": "<|end|>"}
    got = lark({"format": fmt}, {"<|call|>": 7, "<|sep|>": 8, "<|end|>": 9})
    assert '<[7]> "get" <[8]> f0 <[9]>' in got


def test_the_older_form_is_the_triggered_tags_vllm_reads_it_as() -> None:
    """`structures` (begin, schema, end) and `triggers`: vLLM serves it; a structure may
    start with more than one trigger (its guidance backend takes the first)."""
    structure = {"begin": "<ab>", "schema": {"type": "object"}, "end": "</ab>"}
    got = lark({"type": "structural_tag", "structures": [structure], "triggers": ["<a", "<ab"]})
    assert '"<ab>"' in got and "%json" in got and '"</ab>"' in got
    assert LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(got)) == ""


T = "structural_tag"
END = {"type": "any_text"}
# What vLLM 0.33's xgrammar refuses (checked against it), and the reason given here.
REFUSED = {
    "no-format": ({"type": T}, '"format" object'),
    "not-a-tag-type": ({"type": "other", "format": SCHEMA}, 'must be "structural_tag"'),
    "unknown-kind": ({"format": {"type": "nope"}}, 'format has the type "nope"'),
    "half-a-tag": ({"format": {"type": "tag", "begin": "a"}}, "format needs a content format"),
    "empty-or": ({"format": {"type": "or", "elements": []}}, "at least one element"),
    "empty-sequence": ({"format": {"type": "sequence", "elements": []}}, "at least one element"),
    "not-a-schema": ({"format": {"type": "json_schema", "json_schema": 3}}, "JSON schema object"),
    "bad-style": ({"format": {**SCHEMA, "style": "yaml"}}, "style must be one of"),
    "empty-pattern": ({"format": {"type": "regex", "pattern": ""}}, "non-empty string"),
    "lark-in-grammar": ({"format": {"type": "grammar", "grammar": 'start: "a"'}},
                        "grammar format at format is not valid"),
    "token-by-text": ({"format": {"type": "token", "token": "<a>"}}, "name it by its ID"),
    "no-triggers": ({"format": {"type": "triggered_tags", "triggers": [], "tags": []}},
                    "non-empty list"),
    "untriggered": ({"format": {"type": "triggered_tags", "triggers": ["<b"], "tags": [
        {"type": "tag", "begin": "<a>", "content": SCHEMA, "end": "</a>"}]}},
        "format.tags[0].begin '<a>' starts with none"),
    "two-triggers": ({"format": {"type": "triggered_tags", "triggers": ["<", "<a"], "tags": [
        {"type": "tag", "begin": "<a>", "content": SCHEMA, "end": "</a>"}]}}, "more than one"),
    "endless-tag": ({"format": {"type": "tag", "begin": "<a>", "content": {
        "type": "sequence", "elements": [SCHEMA, END]}, "end": ""}},
        "content of format runs on"),
    "repeat-backwards": ({"format": {"type": "repeat", "min": 3, "max": 1, "content": SCHEMA}},
                         "more than its max"),
    "old-form-empty": ({"type": T, "structures": [], "triggers": []}, "structures must be"),
    "old-form-untriggered": ({"type": T, "triggers": ["<b"], "structures": [
        {"begin": "<a>", "schema": {"type": "object"}, "end": "</a>"}]}, "none of the triggers"),
    "old-form-no-schema": ({"type": T, "triggers": ["<a"], "structures": [
        {"begin": "<a>", "end": "</a>"}]}, "needs a schema"),
}  # fmt: skip


@pytest.mark.parametrize(("tag", "says"), REFUSED.values(), ids=REFUSED.keys())
def test_what_vllm_refuses_is_refused_with_the_reason(tag: dict, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)) as refused:
        lark(tag)
    assert not isinstance(refused.value, Unsupported)


UNSUPPORTED = {
    "qwen-xml": {"type": "qwen_xml_parameter", "json_schema": {"type": "object"}},
    "xml-style": {**SCHEMA, "style": "qwen_xml"},
    "repeat": {"type": "repeat", "min": 1, "max": 3, "content": SCHEMA},
    "dispatch": {"type": "dispatch", "rules": [["<a>", SCHEMA]]},
    "token-set": {"type": "tag", "begin": "<a>", "content": {"type": "any_tokens"}, "end": "</a>"},
    "no-type": {"value": "x"},
}  # fmt: skip


@pytest.mark.parametrize("fmt", UNSUPPORTED.values(), ids=UNSUPPORTED.keys())
def test_a_well_formed_kind_without_a_rule_here_is_unsupported_and_its_parts_compile(
    fmt: dict,
) -> None:
    tag = {"type": T, "format": fmt}
    with pytest.raises(Unsupported, match="is not decoded here"):
        lark(tag)
    assert LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(checked(tag))) == ""


def test_a_bad_schema_inside_an_unsupported_kind_still_fails_to_compile() -> None:
    fmt = {"type": "repeat", "min": 1, "max": 3, "content": {
        "type": "json_schema", "json_schema": {"type": "nonsense"}}}  # fmt: skip
    grammar = LLMatcher.grammar_from_lark(checked({"type": T, "format": fmt}))
    assert "nonsense" in LLMatcher.validate_grammar(grammar)


def test_a_tag_nested_past_the_limit_is_refused_not_recursed_into() -> None:
    fmt: dict = SCHEMA
    for _ in range(MAX_DEPTH + 1):
        fmt = {"type": "optional", "content": fmt}
    with pytest.raises(ValueError, match="nest deeper"):
        lark({"format": fmt})
