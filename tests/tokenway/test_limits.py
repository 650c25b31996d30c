"""What one request may make the process build (`tokenway.limits`), held as its body is
decoded on every API: the client's 400 naming the limit, its value and the parameter."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokenway.api.bodies import decode_body
from tokenway.api.openai import decode_tokenize
from tokenway.config import Settings
from tokenway.errors import InvalidRequest
from tokenway.limits import DEFAULT_LIMITS, RequestLimits

HELLO = [{"role": "user", "content": "hi"}]


def wide(properties: int) -> dict[str, Any]:
    props = {f"p{i}": {"type": "string", "description": f"number {i}"} for i in range(properties)}
    return {"type": "object", "properties": props}


def with_tools(api: str, schemas: list[dict[str, Any]], **extra: Any) -> bytes:
    """A body of `api` whose tools take `schemas` as their parameters."""
    if api == "responses":
        tools = [{"type": "function", "name": f"f{i}", "parameters": s}
                 for i, s in enumerate(schemas)]  # fmt: skip
        return json.dumps({"input": "hi", "tools": tools, **extra}).encode()
    if api == "messages":
        tools = [{"name": f"f{i}", "input_schema": s} for i, s in enumerate(schemas)]
        body = {"max_tokens": 8, "messages": HELLO, "tools": tools, **extra}
        return json.dumps(body).encode()
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": s}}
             for i, s in enumerate(schemas)]  # fmt: skip
    return json.dumps({"messages": HELLO, "tools": tools, **extra}).encode()


def refused(api: str, body: bytes, limits: RequestLimits = DEFAULT_LIMITS) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        decode_body(api, body, limits)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(
    ("api", "param"),
    [("chat", "tools[0].function.parameters"), ("responses", "tools[0].parameters"),
     ("messages", "tools[0].input_schema")],
)  # fmt: skip
def test_a_tool_of_80000_properties_is_refused_naming_the_limit(api: str, param: str) -> None:
    """It was decoded, templated into a 7 MB prompt and tokenized: 1.1 GB for a 400. Its
    schema's size is known from the JSON text, before anything is decoded."""
    body = with_tools(api, [wide(80_000)])
    size = len(json.dumps(wide(80_000)))
    assert size > 4_000_000
    error = refused(api, body)
    assert f"schemas come to {size} bytes" in error.message, error.message
    assert "1048576" in error.message and "--max-schema-bytes" in error.message
    assert error.param == param


def test_the_schemas_bytes_count_together() -> None:
    schema = wide(10)
    limits = RequestLimits(max_schema_bytes=2 * len(json.dumps(schema)) + 10)
    assert decode_body("chat", with_tools("chat", [schema, schema]), limits)
    error = refused("chat", with_tools("chat", [schema] * 3), limits)
    assert error.param == "tools[2].function.parameters", error
    assert f"come to {3 * len(json.dumps(schema))} bytes" in error.message
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    error = refused("chat", with_tools("chat", [schema, schema], response_format=fmt), limits)
    assert error.param == "response_format"
    msg = {"output_config": {"format": {"type": "json_schema", "schema": schema}}}
    error = refused("messages", with_tools("messages", [schema, schema], **msg), limits)
    assert error.param == "output_config.format"
    for extra in ({"guided_json": schema}, {"structured_outputs": {"json": schema}}):
        error = refused("chat", with_tools("chat", [schema, schema], **extra), limits)
        assert error.param == next(iter(extra))


def test_a_dense_schema_under_the_bytes_is_held_to_the_values() -> None:
    """Two bytes a value: 70,000 of them in 140 KB."""
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"enum": [0] * 70_000}}}
    error = refused("chat", json.dumps({"messages": HELLO, "response_format": fmt}).encode())
    assert "past 65536 values" in error.message and "--max-schema-nodes" in error.message
    assert error.param == "response_format"


def test_the_schemas_of_a_request_count_together() -> None:
    """Each of these would pass alone: a request carries all of them at once."""
    limits = RequestLimits(max_schema_nodes=100)
    assert decode_body("chat", with_tools("chat", [wide(30)]), limits)  # 62 values
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": wide(30)}}
    error = refused("chat", with_tools("chat", [wide(30)], response_format=fmt), limits)
    assert error.param == "response_format" and "past 100 values" in error.message
    error = refused("responses", with_tools("responses", [wide(30)],
                    text={"format": {"type": "json_schema", "name": "s", "schema": wide(30)}}),
                    limits)  # fmt: skip
    assert error.param == "text.format"
    for extra in ({"guided_json": wide(30)}, {"guided_json": json.dumps(wide(30))},
                  {"structured_outputs": {"json": wide(30)}}):  # fmt: skip
        error = refused("chat", with_tools("chat", [wide(30)], **extra), limits)
        assert error.param == next(iter(extra))


def test_a_structural_tag_counts_as_a_schema_and_its_grammars_as_grammars() -> None:
    fmt = {"type": "json_schema", "json_schema": wide(60)}
    tag = json.dumps({"type": "structural_tag", "format": fmt})
    body = with_tools("chat", [], structured_outputs={"structural_tag": tag})
    error = refused("chat", body, RequestLimits(max_schema_nodes=100))
    assert error.param == "structured_outputs"
    inner = {"type": "grammar", "grammar": "root ::= " + '"a" ' * 100}
    tag = json.dumps({"type": "structural_tag", "format": inner})
    body = with_tools("chat", [], structured_outputs={"structural_tag": tag})
    error = refused("chat", body, RequestLimits(max_grammar_bytes=100))
    assert "--max-grammar-bytes" in error.message


def test_more_tools_than_allowed_are_refused() -> None:
    tools = [{"type": "object", "properties": {}}] * 1025
    for api in ("chat", "responses", "messages"):
        error = refused(api, with_tools(api, tools))
        assert "1025 tools" in error.message and "1024" in error.message, error.message
        assert "--max-tools" in error.message and error.param == "tools"
    assert decode_body("chat", with_tools("chat", tools[:1024]))
    body = {"tools": [{"function": {"name": "f"}}] * 1025}  # a body only the decoder reads
    with pytest.raises(InvalidRequest, match="1025 tools"):
        decode_body("chat", json.dumps(body).encode())


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"structured_outputs": {"regex": "a" * 101}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "a" * 101}}, "structured_outputs"),
        ({"structured_outputs": {"choice": ["a" * 60, "b" * 60]}}, "structured_outputs"),
        ({"guided_regex": "a" * 101}, "guided_regex"),
        ({"guided_grammar": "a" * 101}, "guided_grammar"),
        ({"guided_choice": ["a" * 60, "b" * 60]}, "guided_choice"),
        ({"guided_json": {"type": "string", "pattern": "a" * 101}}, "guided_json"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
            "type": "object", "patternProperties": {"a" * 101: {}}}}}}, "response_format"),
    ],
    ids=["regex", "grammar", "choice", "guided_regex", "guided_grammar", "guided_choice",
         "pattern", "pattern-properties"],
)  # fmt: skip
def test_grammars_longer_than_allowed_are_refused(extra: dict[str, Any], param: str) -> None:
    """Compiling a regex took about 240 bytes per byte of it (1 MB: 240 MB, 1.4 s)."""
    limits = RequestLimits(max_grammar_bytes=100)
    for api in ("chat", "completion"):
        body = {"messages": HELLO} if api == "chat" else {"prompt": "hi"}
        error = refused(api, json.dumps({**body, **extra}).encode(), limits)
        assert "--max-grammar-bytes" in error.message and "more than the 100" in error.message
        assert error.param == param and param in error.message


def test_tokenize_holds_the_tools_of_a_chat_to_the_limits() -> None:
    body = {"messages": HELLO, "tools": [{"type": "function",
            "function": {"name": "f", "parameters": wide(80_000)}}]}  # fmt: skip
    with pytest.raises(InvalidRequest, match="--max-schema-bytes"):
        decode_tokenize(json.dumps(body).encode())
    body["tools"] = [{"type": "function", "function": {"name": "f"}}] * 1025
    with pytest.raises(InvalidRequest, match="--max-tools"):
        decode_tokenize(json.dumps(body).encode())
    assert decode_tokenize(json.dumps({"prompt": "x" * 100_000}).encode())


def ordinary(i: int) -> dict[str, Any]:
    return {"type": "object", "required": ["key"], "properties": {
        "key": {"type": "string", "description": "The record's key."},
        "fields": {"type": "array", "items": {"type": "string"}},
        "limit": {"type": "integer", "minimum": 1, "maximum": 100},
        "order": {"type": "string", "enum": ["asc", "desc"], "pattern": "^(asc|desc)$"},
    }}  # fmt: skip


def test_honest_large_requests_pass_the_default_limits() -> None:
    """128 ordinary tools, a 5,000-property schema (OpenAI's largest) and a JSON grammar."""
    for api in ("chat", "responses", "messages"):
        assert decode_body(api, with_tools(api, [ordinary(i) for i in range(128)]))
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": wide(5000)}}
    assert decode_body("chat", with_tools("chat", [], response_format=fmt))
    json_grammar = "root ::= value\nvalue ::= object | array | string | number\n" * 200
    body = {"prompt": "hi", "structured_outputs": {"grammar": json_grammar}}
    assert decode_body("completion", json.dumps(body).encode())


def test_the_limits_are_the_settings() -> None:
    assert RequestLimits.of(Settings(data_dir="/nowhere")) == DEFAULT_LIMITS
    settings = Settings(data_dir="/nowhere", max_tools=2, max_schema_bytes=5,
                        max_schema_nodes=3, max_grammar_bytes=4)  # fmt: skip
    assert RequestLimits.of(settings) == RequestLimits(
        max_tools=2, max_schema_bytes=5, max_schema_nodes=3, max_grammar_bytes=4
    )


def test_a_namespaces_tools_count_before_the_body_is_decoded() -> None:
    """Responses' namespace tools (issue 31) hold their schemas a level down: their bytes
    and their number count as the top level's do, from the JSON text."""
    inner = [{"type": "function", "name": "f", "parameters": wide(80_000)}]
    body = {"input": "hi", "tools": [{"type": "namespace", "name": "ns", "tools": inner}]}
    error = refused("responses", json.dumps(body).encode())
    assert "--max-schema-bytes" in error.message, error.message
    assert error.param == "tools[0].tools[0].parameters"
    many = [{"type": "function", "name": f"f{i}"} for i in range(1025)]
    body = {"input": "hi", "tools": [{"type": "namespace", "name": "ns", "tools": many}]}
    error = refused("responses", json.dumps(body).encode())
    assert "1025 tools" in error.message and "--max-tools" in error.message, error.message
