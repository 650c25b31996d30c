"""The structural tag vLLM 0.33 builds for a chat request's tools when its tool parser has
one and strict tool calling is on (vLLM's default; `VLLM_ENFORCE_STRICT_TOOL_CALLING=0`
turns it off there, `--no-strict-tool-calling` here).

The tag constrains output to the model's own call syntax — DeepSeek-V3.1's
`<｜tool▁calls▁begin｜>…` markers, Hermes' `<tool_call>{"name": …, "arguments": …}`, and
the markup families' (Qwen3-Coder's `<function=…>`, MiniMax-M2's `<invoke name=…>`, GLM's
`<arg_key>`, Kimi-K2's sections, DeepSeek's DSML) — so a forced call comes out as the tool
parser reads it, not as a JSON list. Each call's arguments follow the tool's schema where
the tool is strict (`strict: true`, or `--tool-strict-level parameter`), written in the
family's own style (xgrammar's `qwen_xml`, `minimax_xml`, `glm_xml`, `deepseek_xml`), and
are any value the syntax writes otherwise (GLM's tag still names a plain schema's keys and
value types). With `tool_choice` "auto" a tag is built only where something is strict (or
the level says so; GLM's parser starts at "function"), and it ORs the calls with the
request's own structured-outputs constraint.

The tag is xgrammar's structural-tag format, as vLLM builds it (xgrammar 0.2.8's builtin
tags for Qwen3-Coder, Kimi-K2 and DeepSeek-V3.2/V4, vLLM's own for Hermes, MiniMax and
GLM, always without a reasoning part), serialized field by field as vLLM's pydantic models
dump it, so an engine receives the same bytes from tokenway as from vLLM's own frontend.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tokenway.api.openai import ChatCompletionRequest, NamedToolChoice, Tool
from tokenway.parsers import THINK_END, THINK_START, StrictLevel
from tokenway.wire import StructuredOutputs

STRICT_LEVELS: tuple[StrictLevel, ...] = ("auto", "function", "parameter")
# the level a parser's tags start from where the server leaves --tool-strict-level at "auto"
DEFAULT_LEVELS: dict[str, StrictLevel] = {"glm45": "function", "glm47": "function"}

Mode = Literal["auto", "required", "forced"]
Format = dict[str, Any]

DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DS_CALLS_END = "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DS_CALL_END = "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"
THINK_TAGS = [THINK_START, THINK_END]  # never free text inside these families' tags
HERMES_BEGIN, HERMES_END = "<tool_call>", "</tool_call>"
QWEN_BEGIN = "<tool_call>\n<function="
QWEN_END = "\n</function>\n</tool_call>"
MINIMAX_BEGIN, MINIMAX_END = "<minimax:tool_call>", "</minimax:tool_call>"
KIMI_BEGIN, KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_ARGS = "<|tool_call_begin|>", "<|tool_call_argument_begin|>"
KIMI_CALL_END = "<|tool_call_end|>"
GLM_BEGIN, GLM_END = "<tool_call>", "</tool_call>"
GLM_MARKERS = [*THINK_TAGS, GLM_BEGIN, GLM_END, "<arg_key>", "</arg_key>", "<arg_value>",
               "</arg_value>"]  # fmt: skip
GLM_TEXT = [m for m in GLM_MARKERS if m != GLM_BEGIN]  # free text may still open a call
# a schema GLM's loose tag cannot read as plain keys
GLM_NOT_PLAIN = ("$ref", "allOf", "anyOf", "oneOf", "patternProperties")


@dataclass(frozen=True, slots=True)
class Call:
    """A tool as its calls are tagged: what its arguments follow (its schema where strict,
    else `true`: anything), and its schema as given (GLM reads keys from it even so)."""

    name: str
    arguments: dict[str, Any] | bool
    strict: bool
    parameters: dict[str, Any] | None


def default_level(parser: str, level: StrictLevel) -> StrictLevel:
    """The level the parser's tags are built at: its own where the server says "auto"."""
    return DEFAULT_LEVELS.get(parser, level) if level == "auto" else level


def structural_tag(
    req: ChatCompletionRequest, parser: str, level: StrictLevel, so: StructuredOutputs | None
) -> StructuredOutputs | None:
    """The constraint that replaces `so` (the request's own), or None where no tag is
    built and `so` stands."""
    choice = "auto" if req.tool_choice is None else req.tool_choice  # as tools without one
    build = BUILDERS.get(parser)
    if not req.tools or build is None or choice == "none":
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
    fmt = build([_call(t, rank == 2) for t in tools], mode)
    if single:
        _stop_after_first(fmt)
    if output is not None:
        fmt = {"type": "or", "elements": [fmt, output]}
    return StructuredOutputs(structural_tag=json.dumps({"type": "structural_tag", "format": fmt}))


def _call(tool: Tool, pinned: bool) -> Call:
    """`pinned`: every tool strict (the "parameter" level)."""
    fn = tool.function
    strict = pinned or fn.strict is True
    arguments = fn.parameters if strict and fn.parameters is not None else True
    return Call(fn.name, arguments, strict, fn.parameters)


# -- the formats, each as xgrammar's pydantic model dumps it: every field, in its order -------


def _schema(schema: object, style: str = "json") -> Format:
    return {
        "type": "json_schema",
        "json_schema": schema,
        "style": style,
        "any_order": False,
        "max_whitespace_cnt": None,
        "excludes": [],
    }


def _tag(begin: str, content: Format, end: str | list[str]) -> Format:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _const(value: str) -> Format:
    return {"type": "const_string", "value": value}


def _sequence(*elements: Format) -> Format:
    return {"type": "sequence", "elements": list(elements)}


def _one_of(formats: list[Format]) -> Format:
    return formats[0] if len(formats) == 1 else {"type": "or", "elements": formats}


def _any_text(excludes: list[str]) -> Format:
    return {"type": "any_text", "excludes": excludes, "max_tokens": None, "max_chars": None}


def _calls(tags: list[Format], stop_after_first: bool = False) -> Format:
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": "",
        "at_least_one": True,
        "stop_after_first": stop_after_first,
    }


def _triggered(
    trigger: str, tags: list[Format], excludes: list[str], at_least_one: bool = False
) -> Format:
    return {
        "type": "triggered_tags",
        "triggers": [trigger],
        "tags": tags,
        "at_least_one": at_least_one,
        "stop_after_first": False,
        "excludes": excludes,
    }


# -- each family's calls ----------------------------------------------------------------------


def _deepseek(calls: Sequence[Call], mode: Mode) -> Format:
    if mode == "forced":
        call = calls[0]
        begin = f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}{call.name}{DS_SEP}"
        return _tag(begin, _schema(call.arguments), DS_CALL_END + DS_CALLS_END)
    tags = [
        _tag(f"{DS_CALL_BEGIN}{c.name}{DS_SEP}", _schema(c.arguments), DS_CALL_END) for c in calls
    ]
    block = _tag(DS_CALLS_BEGIN, _calls(tags), DS_CALLS_END)
    return block if mode == "required" else _triggered(DS_CALLS_BEGIN, [block], THINK_TAGS)


def _hermes(calls: Sequence[Call], mode: Mode) -> Format:
    # a call on lines of its own, or on one line: both are what Hermes models write
    shapes = (
        (HERMES_BEGIN + '\n{"name": "', "}\n" + HERMES_END),
        (HERMES_BEGIN + '{"name": "', "}" + HERMES_END),
    )
    tags = [
        _tag(begin + c.name + '", "arguments": ', _schema(c.arguments), end)
        for c in calls
        for begin, end in shapes
    ]
    if mode == "auto":
        return _triggered(HERMES_BEGIN, tags, [])
    return _calls(tags, stop_after_first=mode == "forced")


def _qwen(calls: Sequence[Call], mode: Mode) -> Format:
    """Each call its own `<tool_call>`; "required" is at least one of them, with text between."""
    tags = [
        _tag(f"{QWEN_BEGIN}{c.name}>\n", _schema(c.arguments, "qwen_xml"), QWEN_END) for c in calls
    ]
    if mode == "forced":
        return tags[0]
    return _triggered(QWEN_BEGIN, tags, THINK_TAGS, at_least_one=mode == "required")


def _block(
    tags: list[Format], mode: Mode, begin: str, end: str, opening: str, excludes: list[str]
) -> Format:
    """Calls inside one block (`begin`…`end`). "auto": free text until `begin`, then the
    block, opened as `opening` writes it without its leading newlines. A forced call or
    "required": the whole output is the block, from `opening` (with those newlines)."""
    if mode == "auto":
        return _triggered(begin, [_tag(opening.lstrip("\n"), _calls(tags), end)], excludes)
    inner = tags[0] if mode == "forced" else _calls(tags)
    return _sequence(_const(opening), inner, _const(end))


def _minimax(calls: Sequence[Call], mode: Mode) -> Format:
    tags = [
        _tag(f'<invoke name="{c.name}">\n', _schema(c.arguments, "minimax_xml"), "</invoke>\n")
        for c in calls
    ]
    opening = f"\n{MINIMAX_BEGIN}\n"
    if mode == "forced":  # vLLM's tag keeps the list here, stopped after its one call
        return _sequence(_const(opening), _calls(tags, True), _const(MINIMAX_END))
    return _block(tags, mode, MINIMAX_BEGIN, MINIMAX_END, opening, THINK_TAGS)


def _kimi(calls: Sequence[Call], mode: Mode) -> Format:
    """Kimi-K2's arguments are JSON; a call's id (`functions.NAME:N`) ends in its index."""
    tags = [
        _tag(
            f"{KIMI_CALL}functions.{c.name}:",
            _sequence(
                {"type": "regex", "pattern": r"\d+"}, _const(KIMI_ARGS), _schema(c.arguments)
            ),
            KIMI_CALL_END,
        )
        for c in calls
    ]
    return _block(tags, mode, KIMI_BEGIN, KIMI_END, KIMI_BEGIN, [*THINK_TAGS, KIMI_CALL])


def _dsml(block: str) -> Callable[[Sequence[Call], Mode], Format]:
    """DeepSeek-V3.2's (`function_calls`) and V4's (`tool_calls`) DSML blocks."""
    begin, end = f"<｜DSML｜{block}>", f"</｜DSML｜{block}>"

    def build(calls: Sequence[Call], mode: Mode) -> Format:
        tags = [
            _tag(
                f'<｜DSML｜invoke name="{c.name}">\n',
                _schema(c.arguments, "deepseek_xml"),
                "</｜DSML｜invoke>\n",
            )
            for c in calls
        ]
        return _block(tags, mode, begin, end, f"\n\n{begin}\n", THINK_TAGS)

    return build


def _glm(calls: Sequence[Call], mode: Mode) -> Format:
    """A strict tool's arguments follow its schema in GLM's syntax; another's keys and plain
    value types are still pinned. Where every tool is strict the tag is xgrammar's own GLM
    tag (a forced call its one tag, "required" triggered calls); otherwise vLLM's list."""
    tags = [_tag(GLM_BEGIN + c.name, _glm_arguments(c), GLM_END) for c in calls]
    if mode == "auto":
        return _triggered(GLM_BEGIN, tags, GLM_TEXT)
    if all(c.strict for c in calls):
        return tags[0] if mode == "forced" else _triggered(GLM_BEGIN, tags, GLM_TEXT, True)
    return _calls(tags, stop_after_first=mode == "forced")


def _glm_arguments(call: Call) -> Format:
    if call.strict:
        return _schema(call.arguments, "glm_xml")
    props = _plain_properties(call.parameters or {})
    if props is None:
        return _schema(True, "glm_xml")
    pairs = [
        _sequence(
            _const(f"<arg_key>{key}</arg_key><arg_value>"), _glm_value(prop), _const("</arg_value>")
        )
        for key, prop in props.items()
    ]
    return {"type": "star", "content": _one_of(pairs)}


def _plain_properties(schema: dict[str, Any]) -> dict[str, Any] | None:
    """An object schema's properties where it says no more than them, else None."""
    props = schema.get("properties")
    if not isinstance(props, dict) or not props or schema.get("additionalProperties") is True:
        return None
    return None if any(key in schema for key in GLM_NOT_PLAIN) else props


def _glm_value(prop: object) -> Format:
    """A value as GLM writes it: an enum's values as written (a string bare, else its
    JSON), a string any text between the markers, another type its JSON."""
    schema = prop if isinstance(prop, dict) else {}
    if isinstance(schema.get("enum"), list):
        return _one_of([_const(v if isinstance(v, str) else json.dumps(v)) for v in schema["enum"]])
    kind = schema.get("type")
    if isinstance(kind, list):
        values = [_glm_value({"type": k}) for k in kind if k != "string"]
        if "string" in kind:
            values.append(_any_text(GLM_MARKERS))
        return _one_of(values)
    if kind is None or kind == "string":
        return _any_text(GLM_MARKERS)
    return _schema({"type": kind})


# gpt-oss's harmony: a message's end, or (as "") one of harmony's stop tokens, which a
# grammar may not hold; a call's header after `<|start|>assistant`, in either order, each
# content type, on any channel; the final answer's header
HARMONY_END = ["<|end|>", ""]
HARMONY_HEADERS = (" to=functions.{name}{channel}{constrain}<|message|>",
                   "{channel} to=functions.{name}{constrain}<|message|>")  # fmt: skip
HARMONY_CONSTRAINS = (" json", " <|constrain|>json")
HARMONY_CHANNELS = ("<|channel|>commentary", "<|channel|>analysis", "<|channel|>final")
HARMONY_FINAL = "<|channel|>final{}<|message|>"


def _harmony_after(commentary: bool, content: Format) -> Format:
    """`content` after an optional analysis message (and, for calls, a commentary one), each
    followed by the next message's start."""
    return _sequence(
        *(
            {"type": "optional", "content": _sequence(
                _tag(f"<|channel|>{channel}<|message|>", _any_text([]), "<|end|>"),
                _const("<|start|>assistant"))}
            for channel in ("analysis", "commentary")[: 2 if commentary else 1]
        ),
        content,
    )  # fmt: skip


def _harmony(calls: Sequence[Call], mode: Mode) -> Format:
    tags = [
        _tag(header.format(name=c.name, channel=channel, constrain=constrain),
             _schema(c.arguments), HARMONY_END)
        for c in calls
        for header in HARMONY_HEADERS
        for constrain in HARMONY_CONSTRAINS
        for channel in HARMONY_CHANNELS
    ]  # fmt: skip
    if mode == "auto":  # or an answer
        tags += [_tag(HARMONY_FINAL.format(constrain), _any_text([]), HARMONY_END)
                 for constrain in (*HARMONY_CONSTRAINS, "")]  # fmt: skip
    return _harmony_after(True, {"type": "or", "elements": tags})


def harmony_answer(so: StructuredOutputs | None) -> StructuredOutputs | None:
    """A request's own constraint for gpt-oss, as vLLM's harmony parser adjusts it: on the
    final answer, after an optional analysis message (a JSON schema under either JSON
    content type). A grammar stands as given (vLLM converts it to EBNF to wrap it)."""
    fmt = None if so is None else _format_of(so)
    if fmt is None:
        return so
    if fmt.get("type") == "json_schema":
        answer = {"type": "or", "elements": [_tag(HARMONY_FINAL.format(constrain), fmt, HARMONY_END)
                                             for constrain in HARMONY_CONSTRAINS]}  # fmt: skip
    else:
        answer = _tag(HARMONY_FINAL.format(""), fmt, HARMONY_END)
    tag = {"type": "structural_tag", "format": _harmony_after(False, answer)}
    return StructuredOutputs(structural_tag=json.dumps(tag))


# the tool parsers with a structural tag, and how each tags its calls
BUILDERS: dict[str, Callable[[Sequence[Call], Mode], Format]] = {
    "deepseek_v31": _deepseek,
    "hermes": _hermes,
    "qwen3_coder": _qwen,
    "qwen3_xml": _qwen,
    "minimax_m2": _minimax,
    "glm45": _glm,
    "glm47": _glm,
    "kimi_k2": _kimi,
    "deepseek_v32": _dsml("function_calls"),
    "deepseek_v4": _dsml("tool_calls"),
    "openai": _harmony,
}
PARSERS = tuple(BUILDERS)


def _stop_after_first(fmt: Format) -> None:
    """`parallel_tool_calls: false`: every list of calls ends after its first."""
    if fmt.get("type") in ("triggered_tags", "tags_with_separator", "token_triggered_tags"):
        fmt["stop_after_first"] = True
    for key in ("content", "tags", "elements"):  # formats nest there, never in a schema
        value = fmt.get(key)
        for node in value if isinstance(value, list) else [value]:
            if isinstance(node, dict):
                _stop_after_first(node)


def _format_of(so: StructuredOutputs) -> Format | None:
    """The request's own constraint as a structural-tag format (None for a grammar)."""
    if so.json_object:
        return _schema({"type": "object"})
    if so.json is not None:
        return _schema(json.loads(so.json) if isinstance(so.json, str) else so.json)
    if so.regex is not None:
        return {"type": "regex", "pattern": so.regex}
    if so.choice is not None:
        return {"type": "or", "elements": [_const(c) for c in so.choice]}
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
