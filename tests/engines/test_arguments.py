"""What the simulated model writes as a call's arguments: the called tool's parameters read
in the prompt, whichever way a chat template lists the tools, and a small document of them."""

from __future__ import annotations

import json

import pytest

from engines.arguments import chosen, example, listed, openings, planned, triggers

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {
    "type": "string", "enum": ["c", "f"]}}, "required": ["city", "unit"]}  # fmt: skip
TIME = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
SPECIALS = ["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<tool_call>"]

# The tools as the bundled template lists them, and as Hermes-style templates dump them.
HEADINGS = (
    "## Tools\n\n### get_time\nDescription: The time {in a zone}.\nParameters: "
    f"{json.dumps(TIME)}\n\n### get_weather\nParameters: {json.dumps(WEATHER)}\n"
)
DUMPS = "<tools>\n" + "\n".join(
    json.dumps({"type": "function", "function": {"name": n, "parameters": p}})
    for n, p in (("get_time", TIME), ("get_weather", WEATHER))
) + "\n</tools>"  # fmt: skip


@pytest.mark.parametrize("prompt", [HEADINGS, DUMPS], ids=["headings", "dumps"])
@pytest.mark.parametrize(
    "begin",
    ["<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>",
     '<tool_call>\n{"name": "get_weather", "arguments": '],
    ids=["deepseek", "hermes"],
)  # fmt: skip
def test_the_called_tools_parameters_are_read_in_the_prompt(prompt: str, begin: str) -> None:
    assert listed(prompt, begin, SPECIALS) == WEATHER
    assert listed(prompt, begin.replace("weather", "time"), SPECIALS) == TIME
    assert listed(prompt, begin.replace("weather", "news"), SPECIALS) is None


@pytest.mark.parametrize("key", range(6))
def test_a_document_of_the_schema_holds_its_required_keys_and_choices(key: int) -> None:
    args = json.loads(planned("get_weather", True, HEADINGS, SPECIALS, key))
    assert set(args) == {"city", "unit"} and isinstance(args["city"], str)
    assert args["unit"] in ("c", "f")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3,
              "maximum": 5}, "tags": {"type": "array", "items": {"type": "boolean"}},
              "note": {"type": "string"}}, "required": ["tags", "n"]}  # fmt: skip
    value = example(schema, key)
    assert list(value) == ["n", "tags"] and 3 <= value["n"] <= 5  # the schema's order
    assert len(value["tags"]) == 1 and isinstance(value["tags"][0], bool)
    assert planned("f", True, "no tools here", SPECIALS, key) == "{}"


def test_a_structural_tags_openings_are_where_json_schemas_start() -> None:
    tag = {"type": "tag", "begin": "<calls>", "end": "</calls>", "content": {
        "type": "tags_with_separator", "separator": "", "tags": [
            {"type": "tag", "begin": "<a>", "end": "</a>",
             "content": {"type": "json_schema", "json_schema": True}},
            {"type": "tag", "begin": "<b>", "end": "</b>",
             "content": {"type": "json_schema", "json_schema": TIME}}]}}  # fmt: skip
    assert list(openings(tag)) == [("<a>", True), ("<b>", TIME)]
    older = {"structures": [{"begin": "<f>", "schema": WEATHER, "end": "</f>"}]}
    assert list(openings(older)) == [("<f>", WEATHER)]


DS_BEGINS = [
    "<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>",
    "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>",
]
HERMES_BEGINS = ['<tool_call>{"name": "get_time", "arguments": ',
                 '<tool_call>{"name": "get_weather", "arguments": ']  # fmt: skip


@pytest.mark.parametrize("begins", [DS_BEGINS, HERMES_BEGINS], ids=["deepseek", "hermes"])
@pytest.mark.parametrize(
    ("asked", "index"),
    [("Call get_weather for Oslo.", 1), ("What time is it?", 0), ("my_get_weather_x", 0)],
    ids=["named", "unnamed", "inside-a-word"],
)
def test_the_call_made_is_the_tool_the_turn_names_else_the_first(
    begins: list[str], asked: str, index: int
) -> None:
    assert chosen(begins, asked, SPECIALS) == index


def test_a_triggered_tags_triggers_are_read_and_a_schemas_are_not() -> None:
    schema = {"type": "json_schema", "json_schema": {"triggers": ["<no>"]}}
    call = {"type": "tag", "begin": "<a>", "content": schema, "end": "</a>"}
    fmt = {"type": "triggered_tags", "triggers": ["<a>"], "tags": [call]}
    tag = {"type": "structural_tag", "format": fmt}
    assert list(triggers(tag)) == ["<a>"]
    assert list(triggers({"structures": [], "triggers": ["<b>"]})) == ["<b>"]
