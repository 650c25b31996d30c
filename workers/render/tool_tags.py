"""The structural tag vLLM 0.33 builds for a chat request's tools when its tool parser has
one and strict tool calling is on (vLLM's default; `VLLM_ENFORCE_STRICT_TOOL_CALLING=0`
turns it off there, `--no-strict-tool-calling` here).

The tag constrains output to the model's own call syntax — DeepSeek-V3.1's
`<｜tool▁calls▁begin｜>…` markers, Hermes' `<tool_call>{"name": …, "arguments": …}` — so a
forced call comes out as the tool parser reads it, not as a JSON list. Each call's
arguments follow the tool's schema where the tool is strict (`strict: true`, or
`--tool-strict-level parameter`), and are any JSON otherwise. With `tool_choice`
"auto" a tag is built only where something is strict (or the level says so), and it ORs
the calls with the request's own structured-outputs constraint.

The tag is xgrammar's structural-tag format, serialized field by field as vLLM's
pydantic models dump it, so an engine receives the same bytes from tokenway as from
vLLM's own frontend.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from tokenway.api.openai import ChatCompletionRequest, NamedToolChoice, Tool
from tokenway.parsers import THINK_END, THINK_START, StrictLevel
from tokenway.wire import StructuredOutputs

STRICT_LEVELS: tuple[StrictLevel, ...] = ("auto", "function", "parameter")
PARSERS = ("deepseek_v31", "hermes")  # the tool parsers with a structural tag

Mode = Literal["auto", "required", "forced"]

DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DS_CALLS_END = "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DS_CALL_END = "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"
THINK_TAGS = [THINK_START, THINK_END]  # never free text inside DeepSeek's tag
HERMES_BEGIN, HERMES_END = "<tool_call>", "</tool_call>"


def structural_tag(
    req: ChatCompletionRequest, parser: str, level: StrictLevel, so: StructuredOutputs | None
) -> StructuredOutputs | None:
    """The constraint that replaces `so` (the request's own), or None where no tag is
    built and `so` stands."""
    choice = "auto" if req.tool_choice is None else req.tool_choice  # as tools without one
    if not req.tools or parser not in PARSERS or choice == "none":
        return None
    tools = list(req.tools or ())
    auto = choice == "auto"
    single = req.parallel_tool_calls is False
    rank = STRICT_LEVELS.index(level)
    if single and not (auto and so is not None):
        rank = max(rank, 1)  # limiting the calls needs their envelope in the grammar
    if auto and rank == 0 and not any(t.function.strict is True for t in tools):
        return None
    output = None
    if auto and so is not None:
        output = _format_of(so)
        if output is None:  # a grammar: it constrains alone
            return None
    if isinstance(choice, NamedToolChoice):
        mode: Mode = "forced"
        tools = [t for t in tools if t.function.name == choice.function.name]
    else:
        mode = "required" if choice == "required" or output is not None else "auto"
    calls = [(t.function.name, _arguments(t, rank == 2)) for t in tools]
    fmt = _deepseek(calls, mode) if parser == "deepseek_v31" else _hermes(calls, mode)
    if single:
        _stop_after_first(fmt)
    if output is not None:
        fmt = {"type": "or", "elements": [fmt, output]}
    return StructuredOutputs(structural_tag=json.dumps({"type": "structural_tag", "format": fmt}))


def _arguments(tool: Tool, pinned: bool) -> dict[str, Any] | bool:
    """A strict tool's parameters schema; `true` (any JSON) for the others."""
    if not (pinned or tool.function.strict is True) or tool.function.parameters is None:
        return True
    return tool.function.parameters


def _schema(schema: object) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": schema,
        "style": "json",
        "any_order": False,
        "max_whitespace_cnt": None,
        "excludes": [],
    }


def _tag(begin: str, content: dict[str, Any], end: str) -> dict[str, Any]:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _calls(tags: list[dict[str, Any]], stop_after_first: bool = False) -> dict[str, Any]:
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": "",
        "at_least_one": True,
        "stop_after_first": stop_after_first,
    }


def _triggered(trigger: str, tags: list[dict[str, Any]], excludes: list[str]) -> dict[str, Any]:
    return {
        "type": "triggered_tags",
        "triggers": [trigger],
        "tags": tags,
        "at_least_one": False,
        "stop_after_first": False,
        "excludes": excludes,
    }


def _deepseek(calls: Sequence[tuple[str, object]], mode: Mode) -> dict[str, Any]:
    if mode == "forced":
        name, args = calls[0]
        begin = f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}{name}{DS_SEP}"
        return _tag(begin, _schema(args), DS_CALL_END + DS_CALLS_END)
    tags = [_tag(f"{DS_CALL_BEGIN}{name}{DS_SEP}", _schema(a), DS_CALL_END) for name, a in calls]
    block = _tag(DS_CALLS_BEGIN, _calls(tags), DS_CALLS_END)
    return block if mode == "required" else _triggered(DS_CALLS_BEGIN, [block], THINK_TAGS)


def _hermes(calls: Sequence[tuple[str, object]], mode: Mode) -> dict[str, Any]:
    # a call on lines of its own, or on one line: both are what Hermes models write
    shapes = (
        (HERMES_BEGIN + '\n{"name": "', "}\n" + HERMES_END),
        (HERMES_BEGIN + '{"name": "', "}" + HERMES_END),
    )
    tags = [
        _tag(begin + name + '", "arguments": ', _schema(args), end)
        for name, args in calls
        for begin, end in shapes
    ]
    if mode == "auto":
        return _triggered(HERMES_BEGIN, tags, [])
    return _calls(tags, stop_after_first=mode == "forced")


def _stop_after_first(fmt: dict[str, Any]) -> None:
    """`parallel_tool_calls: false`: every list of calls ends after its first."""
    if fmt.get("type") in ("triggered_tags", "tags_with_separator", "token_triggered_tags"):
        fmt["stop_after_first"] = True
    for key in ("content", "tags", "elements"):  # formats nest there, never in a schema
        value = fmt.get(key)
        for node in value if isinstance(value, list) else [value]:
            if isinstance(node, dict):
                _stop_after_first(node)


def _format_of(so: StructuredOutputs) -> dict[str, Any] | None:
    """The request's own constraint as a structural-tag format (None for a grammar)."""
    if so.json_object:
        return _schema({"type": "object"})
    if so.json is not None:
        return _schema(json.loads(so.json) if isinstance(so.json, str) else so.json)
    if so.regex is not None:
        return {"type": "regex", "pattern": so.regex}
    if so.choice is not None:
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in so.choice]}
    if so.structural_tag is not None:
        tag = json.loads(so.structural_tag)
        if "structures" in tag:  # the older form: triggers and begin/schema/end structures
            tags = [_tag(s["begin"], _schema(s["schema"]), s["end"]) for s in tag["structures"]]
            return {
                "type": "triggered_tags",
                "triggers": tag["triggers"],
                "tags": tags,
                "at_least_one": False,
                "stop_after_first": False,
                "excludes": [],
            }
        return tag["format"]
    return None
