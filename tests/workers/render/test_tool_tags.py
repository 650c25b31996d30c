"""The structural tags render builds for tool calls: vLLM 0.33's, byte for byte (the
expected strings are what vLLM's own frontend serializes for the same request), and the
rules that decide whether a tag is built at all."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from tokenway.api.openai import ChatCompletionRequest
from tokenway.parsers import ParserFlags
from tokenway.wire import StructuredOutputs
from workers.derender import tools
from workers.render.parse import call_tags, parse_context
from workers.render.structured import ToolTags, constraint
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


# -- the markup families: xgrammar's builtin tags (vLLM's own for MiniMax and GLM) ------------
# Each as vLLM 0.33 dumps it for the tools above: get_weather not strict (its arguments any
# value the syntax writes), get_time strict (its schema). Key order is vLLM's: the tag is
# compared as the bytes json.dumps writes.
THINK = ["<think>", "</think>"]


def schema(of: object, style: str = "json") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": of, "style": style, "any_order": False,
            "max_whitespace_cnt": None, "excludes": []}  # fmt: skip


def a_tag(begin: str, content: dict[str, Any], end: str) -> dict[str, Any]:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def const(value: str) -> dict[str, Any]:
    return {"type": "const_string", "value": value}


def seq(*elements: dict[str, Any]) -> dict[str, Any]:
    return {"type": "sequence", "elements": list(elements)}


def listed(tags: list[dict[str, Any]], stop: bool = False) -> dict[str, Any]:
    return {"type": "tags_with_separator", "tags": tags, "separator": "", "at_least_one": True,
            "stop_after_first": stop}  # fmt: skip


def triggered(trigger: str, tags: list[dict[str, Any]], excludes: list[str], least: bool = False,
              stop: bool = False) -> dict[str, Any]:  # fmt: skip
    return {"type": "triggered_tags", "triggers": [trigger], "tags": tags, "at_least_one": least,
            "stop_after_first": stop, "excludes": excludes}  # fmt: skip


def qwen(name: str, of: object) -> dict[str, Any]:
    begin = f"<tool_call>\n<function={name}>\n"
    return a_tag(begin, schema(of, "qwen_xml"), "\n</function>\n</tool_call>")


def minimax(name: str, of: object) -> dict[str, Any]:
    return a_tag(f'<invoke name="{name}">\n', schema(of, "minimax_xml"), "</invoke>\n")


def kimi(name: str, of: object) -> dict[str, Any]:
    args = seq({"type": "regex", "pattern": "\\d+"}, const("<|tool_call_argument_begin|>"),
               schema(of))  # fmt: skip
    return a_tag(f"<|tool_call_begin|>functions.{name}:", args, "<|tool_call_end|>")


def dsml(name: str, of: object) -> dict[str, Any]:
    begin = f'<｜DSML｜invoke name="{name}">\n'
    return a_tag(begin, schema(of, "deepseek_xml"), "</｜DSML｜invoke>\n")


GLM_MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
               "<arg_value>", "</arg_value>"]  # fmt: skip
GLM_TEXT = [m for m in GLM_MARKERS if m != "<tool_call>"]
ANY_VALUE = {"type": "any_text", "excludes": GLM_MARKERS, "max_tokens": None, "max_chars": None}


def glm_pair(key: str, value: dict[str, Any]) -> dict[str, Any]:
    return seq(const(f"<arg_key>{key}</arg_key><arg_value>"), value, const("</arg_value>"))


# GLM's tag for a tool that is not strict still names its keys and their plain types
GLM_CITY = {"type": "star", "content": glm_pair("city", ANY_VALUE)}
GLM_WEATHER = a_tag("<tool_call>get_weather", GLM_CITY, "</tool_call>")
GLM_TIME = a_tag("<tool_call>get_time", schema(ZONE, "glm_xml"), "</tool_call>")
Q = (qwen("get_weather", True), qwen("get_time", ZONE))
M = (minimax("get_weather", True), minimax("get_time", ZONE))
K = (kimi("get_weather", True), kimi("get_time", ZONE))
D = (dsml("get_weather", True), dsml("get_time", ZONE))
QT, MT, KT = "<tool_call>\n<function=", "<minimax:tool_call>", "<|tool_calls_section_begin|>"
KE = "<|tool_calls_section_end|>"


def dsml_family(block: str) -> dict[str, dict[str, Any]]:
    begin, end = f"<｜DSML｜{block}>", f"</｜DSML｜{block}>"
    return {
        "required": seq(const(f"\n\n{begin}\n"), listed(list(D)), const(end)),
        "named": seq(const(f"\n\n{begin}\n"), D[0], const(end)),
        "single": seq(const(f"\n\n{begin}\n"), listed(list(D), stop=True), const(end)),
        "auto": triggered(begin, [a_tag(begin + "\n", listed(list(D)), end)], THINK),
    }


QWEN = {
    "required": triggered(QT, list(Q), THINK, least=True),
    "named": Q[0],
    "single": triggered(QT, list(Q), THINK, least=True, stop=True),
    "auto": triggered(QT, list(Q), THINK),
}
GLM = {
    "required": listed([GLM_WEATHER, GLM_TIME]),
    "named": listed([GLM_WEATHER], stop=True),
    "single": listed([GLM_WEATHER, GLM_TIME], stop=True),
    "auto": triggered("<tool_call>", [GLM_WEATHER, GLM_TIME], GLM_TEXT),
}
FAMILIES: dict[str, dict[str, dict[str, Any]]] = {
    "qwen3_coder": QWEN,
    "qwen3_xml": QWEN,
    "minimax_m2": {
        "required": seq(const(f"\n{MT}\n"), listed(list(M)), const("</minimax:tool_call>")),
        "named": seq(const(f"\n{MT}\n"), listed([M[0]], stop=True), const("</minimax:tool_call>")),
        "single": seq(
            const(f"\n{MT}\n"), listed(list(M), stop=True), const("</minimax:tool_call>")
        ),
        "auto": triggered(MT, [a_tag(f"{MT}\n", listed(list(M)), "</minimax:tool_call>")], THINK),
    },
    "glm45": GLM,
    "glm47": GLM,
    "kimi_k2": {
        "required": seq(const(KT), listed(list(K)), const(KE)),
        "named": seq(const(KT), K[0], const(KE)),
        "single": seq(const(KT), listed(list(K), stop=True), const(KE)),
        "auto": triggered(KT, [a_tag(KT, listed(list(K)), KE)], [*THINK, "<|tool_call_begin|>"]),
    },
    "deepseek_v32": dsml_family("function_calls"),
    "deepseek_v4": dsml_family("tool_calls"),
}
ASKS: dict[str, dict[str, Any]] = {
    "required": {"tool_choice": "required"},
    "named": {"tool_choice": NAMED},
    "single": {"tool_choice": "required", "parallel_tool_calls": False},
    "auto": {"tool_choice": "auto"},  # get_time is strict: a tag, its schema pinned
}


@pytest.mark.parametrize("ask", ASKS)
@pytest.mark.parametrize("parser", FAMILIES)
def test_each_markup_family_gets_vllms_tag(parser: str, ask: str) -> None:
    expected = {"type": "structural_tag", "format": FAMILIES[parser][ask]}
    assert tag(chat(**ASKS[ask]), parser=parser) == json.dumps(expected)


def test_glms_tag_for_a_tool_that_is_not_strict_types_its_plain_keys() -> None:
    """Keys and plain types pinned (an enum's values as written, a scalar type as JSON, a
    string as any text between the markers); a schema with more than plain properties is
    any arguments in GLM's syntax. A request whose tools are all strict gets xgrammar's own
    GLM tag: "required" as triggered calls, a named tool as its one call."""
    rich = {"type": "object", "properties": {
        "unit": {"enum": ["c", 1, None]}, "days": {"type": "integer"},
        "note": {"type": ["string", "null"]}, "any": {}, "one": {"enum": ["x"]}}}  # fmt: skip
    loose = {"type": "object", "properties": {"q": {"type": "string"}},
             "additionalProperties": True}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "rich", "parameters": rich}},
             {"type": "function", "function": {"name": "open", "parameters": loose}},
             {"type": "function", "function": {"name": "bare"}}]  # fmt: skip
    enum = {"type": "or", "elements": [const("c"), const("1"), const("null")]}
    note = {"type": "or", "elements": [schema({"type": "null"}), ANY_VALUE]}
    days = schema({"type": "integer"})
    pairs = [glm_pair("unit", enum), glm_pair("days", days), glm_pair("note", note),
             glm_pair("any", ANY_VALUE), glm_pair("one", const("x"))]  # fmt: skip
    expected = triggered("<tool_call>", [
        a_tag("<tool_call>rich", {"type": "star", "content": {"type": "or", "elements": pairs}},
              "</tool_call>"),
        a_tag("<tool_call>open", schema(True, "glm_xml"), "</tool_call>"),
        a_tag("<tool_call>bare", schema(True, "glm_xml"), "</tool_call>"),
    ], GLM_TEXT)  # fmt: skip
    got = tag(chat(tools=tools, tool_choice="auto"), parser="glm47", level="function")
    assert got == json.dumps({"type": "structural_tag", "format": expected})
    strict_only = chat(tools=[TIME], tool_choice="required")
    required = triggered("<tool_call>", [GLM_TIME], GLM_TEXT, least=True)
    assert tag(strict_only, parser="glm47") == json.dumps(
        {"type": "structural_tag", "format": required}
    )
    named = chat(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert tag(named, parser="glm47") == json.dumps({"type": "structural_tag", "format": GLM_TIME})


def test_glm_tags_calls_unless_the_server_says_how_strict() -> None:
    """vLLM's GLM parser starts from the "function" level: even "auto" without a strict tool
    holds a call to GLM's syntax. A level the server sets stands."""
    assert call_tags(ParserFlags(None, "glm47", True)) == ToolTags("glm47", "function")
    assert call_tags(ParserFlags(None, "glm45", True)) == ToolTags("glm45", "function")
    pinned = ParserFlags(None, "glm47", True, tool_strict_level="parameter")
    assert call_tags(pinned) == ToolTags("glm47", "parameter")
    assert call_tags(ParserFlags(None, "qwen3_coder", True)) == ToolTags("qwen3_coder", "auto")
    assert call_tags(ParserFlags(None, "kimi_k2", True, strict_tool_calling=False)) is None


# -- a forced call in the family's syntax, read by its parser ---------------------------------
TYPED = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
FORECAST = {"type": "function", "function": {"name": "get_weather", "parameters": TYPED}}
CALL = {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}


def written(parser: str) -> str:
    """A call to get_weather(city="Paris", days=3) as the family's tag lets the model write it
    (values as raw text, typed by the tool's schema, except Kimi's JSON)."""
    if parser.startswith("qwen3"):
        params = "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
        return f"<tool_call>\n<function=get_weather>\n{params}</function>\n</tool_call>"
    if parser == "minimax_m2":
        params = '<parameter name="city">Paris</parameter>\n<parameter name="days">3</parameter>\n'
        invoke = f'<invoke name="get_weather">\n{params}</invoke>\n'
        return f"\n<minimax:tool_call>\n{invoke}</minimax:tool_call>"
    if parser.startswith("glm"):
        params = "<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        params += "<arg_key>days</arg_key><arg_value>3</arg_value>"
        return f"<tool_call>get_weather{params}</tool_call>"
    if parser == "kimi_k2":
        head = "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        args = '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|>'
        return f"{head}{args}<|tool_calls_section_end|>"
    block = "function_calls" if parser == "deepseek_v32" else "tool_calls"
    params = ('<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
              '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n')  # fmt: skip
    invoke = f'<｜DSML｜invoke name="get_weather">\n{params}</｜DSML｜invoke>\n'
    return f"\n\n<｜DSML｜{block}>\n{invoke}</｜DSML｜{block}>"


@pytest.mark.parametrize("choice", ["required", "named"])
@pytest.mark.parametrize("parser", FAMILIES)
def test_a_forced_call_in_the_familys_syntax_comes_out_in_tool_calls(
    parser: str, choice: str
) -> None:
    """What render builds (the tag the engine gets, the parse plan) and what derender's tool
    parsing makes of the call the tag let through: the call, its values typed by the tool's
    schema, no content."""
    flags = ParserFlags(None, parser, True)
    req = chat(tools=[FORECAST], tool_choice=NAMED if choice == "named" else "required")
    sent = constraint(req, call_tags(flags))
    assert sent is not None and sent.structural_tag is not None
    plan = parse_context(req, [1, 2], flags, {}, sent)
    assert plan is not None and plan.native_calls and plan.tool_parser == parser
    state = tools.start(plan)
    assert state is not None
    content, deltas, state = tools.step(plan, state, written(parser), "chatcmpl-1")
    tail, more = tools.finish(plan, state, "chatcmpl-1")
    calls = [c["function"] for c in tools.merge(deltas + more)]
    assert calls == [CALL] and not (content + tail).strip()
