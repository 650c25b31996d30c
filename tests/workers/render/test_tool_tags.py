"""The structural tags render builds for tool calls: vLLM 0.33's, byte for byte (the
expected strings are what vLLM's own frontend serializes for the same request), and the
rules that decide whether a tag is built at all."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from tokenway.api.openai import ChatCompletionRequest
from tokenway.wire import StructuredOutputs
from workers.render.tool_tags import structural_tag

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ZONE = {"type": "object", "properties": {"zone": {"type": "string"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": ZONE}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER, TIME], **fields}
    return msgspec.convert(body, ChatCompletionRequest)


def tag(req: ChatCompletionRequest, parser: str = "deepseek_v31", level: Any = "auto",
        so: StructuredOutputs | None = None) -> str | None:  # fmt: skip
    built = structural_tag(req, parser, level, so)
    return None if built is None else built.structural_tag


def test_a_named_deepseek_call_is_vllms_tag() -> None:
    # the non-strict tool's arguments are any JSON; at "parameter" they follow its schema
    assert tag(chat(tool_choice=NAMED)) == (
        '{"type": "structural_tag", "format": {"type": "tag", "begin": "<\\uff5ctool\\u2581calls'
        "\\u2581begin\\uff5c><\\uff5ctool\\u2581call\\u2581begin\\uff5c>get_weather<\\uff5ctool"
        '\\u2581sep\\uff5c>", "content": {"type": "json_schema", "json_schema": true, "style": '
        '"json", "any_order": false, "max_whitespace_cnt": null, "excludes": []}, "end": "<\\uff5c'
        'tool\\u2581call\\u2581end\\uff5c><\\uff5ctool\\u2581calls\\u2581end\\uff5c>"}}'
    )
    pinned = json.loads(tag(chat(tool_choice=NAMED), level="parameter") or "")
    assert pinned["format"]["content"]["json_schema"] == CITY


def test_a_required_hermes_call_without_parallel_calls_is_vllms_tag() -> None:
    got = tag(chat(tool_choice="required", parallel_tool_calls=False), parser="hermes")
    tags = [
        '{"type": "tag", "begin": "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments'
        '\\": ", "content": {"type": "json_schema", "json_schema": true, "style": "json", '
        '"any_order": false, "max_whitespace_cnt": null, "excludes": []}, "end": "}\\n'
        '</tool_call>"}',
        '{"type": "tag", "begin": "<tool_call>{\\"name\\": \\"get_weather\\", \\"arguments\\": '
        '", "content": {"type": "json_schema", "json_schema": true, "style": "json", '
        '"any_order": false, "max_whitespace_cnt": null, "excludes": []}, "end": "}'
        '</tool_call>"}',
        '{"type": "tag", "begin": "<tool_call>\\n{\\"name\\": \\"get_time\\", \\"arguments\\": '
        '", "content": {"type": "json_schema", "json_schema": {"type": "object", "properties": '
        '{"zone": {"type": "string"}}}, "style": "json", "any_order": false, '
        '"max_whitespace_cnt": null, "excludes": []}, "end": "}\\n</tool_call>"}',
        '{"type": "tag", "begin": "<tool_call>{\\"name\\": \\"get_time\\", \\"arguments\\": ", '
        '"content": {"type": "json_schema", "json_schema": {"type": "object", "properties": '
        '{"zone": {"type": "string"}}}, "style": "json", "any_order": false, '
        '"max_whitespace_cnt": null, "excludes": []}, "end": "}</tool_call>"}',
    ]
    assert got == (
        '{"type": "structural_tag", "format": {"type": "tags_with_separator", "tags": ['
        + ", ".join(tags)
        + '], "separator": "", "at_least_one": true, "stop_after_first": true}}'
    )


def test_auto_gets_a_tag_only_where_a_tool_is_strict_or_the_level_asks() -> None:
    lax = {"tools": [WEATHER], "tool_choice": "auto"}
    assert tag(chat(**lax)) is None  # free text and free calls, as vLLM leaves them
    assert tag(chat(**lax), level="function") is not None
    assert tag(chat(**lax, parallel_tool_calls=False)) is not None  # one call: its envelope
    assert tag(chat()) == tag(chat(tool_choice="auto"))  # tools without a tool_choice: auto
    fmt = json.loads(tag(chat(tool_choice="auto")) or "")["format"]
    assert fmt["type"] == "triggered_tags" and fmt["excludes"] == ["<think>", "</think>"]
    assert fmt["triggers"] == [fmt["tags"][0]["begin"]] == ["<｜tool▁calls▁begin｜>"]


def test_auto_with_a_constraint_of_its_own_is_calls_or_that_constraint() -> None:
    so = StructuredOutputs(regex="[a-z]+")
    fmt = json.loads(tag(chat(tool_choice="auto"), so=so) or "")["format"]
    calls, own = fmt["elements"]
    assert fmt["type"] == "or" and own == {"type": "regex", "pattern": "[a-z]+"}
    assert calls["type"] == "tag"  # as for "required": at least one call, or the regex
    # a grammar has no structural-tag form here: the request's own constraint stands alone
    assert structural_tag(chat(tool_choice="auto"), "deepseek_v31", "auto",
                          StructuredOutputs(grammar='root ::= "a"')) is None  # fmt: skip


@pytest.mark.parametrize("choice", ["none", None])
def test_no_tag_without_a_call_to_make(choice: str | None) -> None:
    assert tag(chat(tool_choice=choice) if choice else chat(tools=None)) is None
