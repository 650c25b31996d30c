"""Render's core on `tools` and `tool_choice` together: what the tools cannot meet is a 400
naming the parameter before anything reads them (a named tool that is not among the tools
was an IndexError in its structural tag), and no combination of tools, choice, parallel
calls and the request's own constraint, under any parser's flags, is anything but an
answer or a 400."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from tokenway.errors import InvalidRequest
from tokenway.model import ModelInfo, load_model_info
from tokenway.parsers import ParserFlags
from tokenway.wire import ParseContext, RenderRequest, ToolParams
from workers.render.core import RequestBuilder
from workers.render.parse import parse_context

F = {"type": "function", "function": {"name": "f", "parameters": {}}}
G = {"type": "function", "function": {"name": "g", "strict": True,
     "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}  # fmt: skip
NAMELESS = {"type": "function", "function": {"name": ""}}
MESSAGES = [{"role": "user", "content": "x"}]

FLAGS = {
    "no-parser": ParserFlags(),
    "deepseek": ParserFlags("deepseek_v3", "deepseek_v31", True),
    "deepseek-parameter": ParserFlags("deepseek_v3", "deepseek_v31", True,
                                      tool_strict_level="parameter"),
    "deepseek-not-strict": ParserFlags("deepseek_v3", "deepseek_v31", True,
                                       strict_tool_calling=False),
    "hermes-function": ParserFlags(None, "hermes", True, tool_strict_level="function"),
    "qwen3-coder": ParserFlags("qwen3", "qwen3_coder", True),
}  # fmt: skip
TOOLS: list[Any] = [None, [], [F], [G], [F, G], [NAMELESS]]
CHOICES: list[Any] = [None, "none", "auto", "required", {"type": "function", "function":
                      {"name": "f"}}, {"type": "function", "function": {"name": "nope"}},
                      {"type": "function", "function": {"name": ""}}]  # fmt: skip
OWN: list[dict[str, Any]] = [
    {},
    {"structured_outputs": {"grammar": 'root ::= "a"'}},
    {"structured_outputs": {"grammar": "root ::= (("}},
    {"structured_outputs": {"structural_tag": "{}"}},
    {"structured_outputs": {"structural_tag": "[1]"}},
    {"structured_outputs": {"structural_tag": json.dumps({"type": "structural_tag",
     "format": {"type": "const_string", "value": "a"}})}},
    {"structured_outputs": {"structural_tag": '{"structures": [{}], "triggers": ["<"]}'}},
    {"guided_json": "{not json"},
    {"guided_json": {"type": "object"}},
    {"response_format": {"type": "json_object"}},
]  # fmt: skip


@pytest.fixture(scope="module")
def info(model_dir: Path) -> ModelInfo:
    return load_model_info(model_dir)


def parsed(builder: RequestBuilder, **body: Any) -> ParseContext | None:
    """Render's core up to the parse plan: the body decoded and checked, its constraint,
    and the plan derender gets."""
    request = RenderRequest(api="chat", request_id="r", created=1,
                            body=json.dumps({"messages": MESSAGES, **body}).encode())  # fmt: skip
    done = builder.parse(request)
    return parse_context(done.req, [1, 2], builder.flags, {}, done.constraint)  # type: ignore[arg-type]


def test_a_markup_tool_parser_gets_the_tools_parameter_types(info: ModelInfo) -> None:
    builder = RequestBuilder(info, "m", FLAGS["qwen3-coder"])
    plan = parsed(builder, tools=[F, G])
    assert plan is not None and plan.tool_parser == "qwen3_coder"
    assert plan.tools == [ToolParams("f"), ToolParams("g", {"a": ["string"]})]
    # other parsers read JSON: their plans do not carry the tools
    hermes = parsed(RequestBuilder(info, "m", FLAGS["hermes-function"]), tools=[F, G])
    assert hermes is not None and hermes.tools == []


@pytest.mark.parametrize("flags", FLAGS.values(), ids=FLAGS.keys())
@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"tools": [F], "tool_choice": CHOICES[5]}, "tool_choice", "'nope'"),
        ({"tools": [F], "tool_choice": CHOICES[5],
          "structured_outputs": {"grammar": 'root ::= "a"'}}, "tool_choice", "'nope'"),
        ({"tools": [F], "tool_choice": CHOICES[6]}, "tool_choice.function.name", "empty"),
        ({"tools": [NAMELESS], "tool_choice": CHOICES[6]}, "tool_choice.function.name",
         "empty"),
        ({"tool_choice": CHOICES[4]}, "tool_choice", "`tools` must be set"),
        ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
        ({"tool_choice": "auto"}, "tool_choice", "`tools` must be set"),
        ({"tools": [], "tool_choice": "required"}, "tools", "empty array"),
        ({"tools": [], "tool_choice": CHOICES[4]}, "tools", "empty array"),
        ({"tools": [G], "structured_outputs": {"structural_tag": "{}"}}, "structured_outputs",
         "structural_tag"),
        ({"tools": [G], "guided_json": "{not json"}, "guided_json", "json"),
    ],
    ids=["named-not-a-tool", "named-not-a-tool-with-grammar", "named-no-name",
         "named-no-name-nameless-tool", "named-no-tools", "required-no-tools", "auto-no-tools",
         "required-empty-tools", "named-empty-tools", "auto-bad-tag", "auto-bad-guided-json"],
)  # fmt: skip
def test_what_the_tools_cannot_meet_is_a_400_naming_it(
    info: ModelInfo, flags: ParserFlags, body: dict, param: str, says: str
) -> None:
    with pytest.raises(InvalidRequest) as bad:
        parsed(RequestBuilder(info, "m", flags), **body)
    assert bad.value.param == param and says in bad.value.message, bad.value


@pytest.mark.parametrize("flags", FLAGS.values(), ids=FLAGS.keys())
def test_no_combination_of_tools_choice_and_constraint_is_a_server_error(
    info: ModelInfo, flags: ParserFlags
) -> None:
    builder = RequestBuilder(info, "m", flags)
    answered = 0
    for tools, choice, parallel, own in itertools.product(TOOLS, CHOICES, (True, False), OWN):
        body = {**own, "parallel_tool_calls": parallel}
        body |= {"tools": tools} if tools is not None else {}
        body |= {"tool_choice": choice} if choice is not None else {}
        try:
            parsed(builder, **body)
            answered += 1
        except InvalidRequest as exc:
            assert exc.status == 400 and exc.param, (body, exc)
    assert answered  # the product holds requests that are served, not only refusals


@pytest.mark.parametrize(
    ("flags", "body", "skip"),
    [
        (ParserFlags("deepseek_v3", "deepseek_v31", True), {"tools": [F]}, True),
        (ParserFlags(None, "hermes", True), {"tools": [F]}, False),
        (ParserFlags(None, "hermes", True), {"tools": [F], "tool_choice": "none"}, True),
        (ParserFlags(None, "hermes", True), {}, True),
        (ParserFlags(None, "kimi_k2", True), {"tools": [F]}, False),
        (ParserFlags(None, "kimi_k2", True), {}, True),
        (ParserFlags(None, "qwen3_coder", True), {"tools": [F]}, False),
        (ParserFlags(None, "qwen3_coder", True), {}, True),
        (ParserFlags("deepseek_r1", "qwen3_coder", True), {}, False),
        (ParserFlags("qwen3", None, False), {}, False),
    ],
)  # fmt: skip
def test_parsers_that_read_special_tokens_have_them_decoded(
    info: ModelInfo, flags: ParserFlags, body: dict[str, Any], skip: bool
) -> None:
    """As vLLM 0.33 adjusts a request for its parsers: those built on its parser engine
    decode the output with special tokens (a family's markers may be special tokens), hermes
    and kimi_k2 do so where the request may call a tool; a marker skipped as special would
    leave a call as text."""
    builder = RequestBuilder(info, "m", flags)
    request = RenderRequest(api="chat", request_id="r", created=1,
                            body=json.dumps({"messages": MESSAGES, **body}).encode())  # fmt: skip
    assert builder.parse(request).req.skip_special_tokens is skip
