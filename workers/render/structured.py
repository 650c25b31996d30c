"""What a request asks for by way of structure, as the one constraint vLLM's sampling
parameters carry (`StructuredOutputs`), by vLLM 0.33's rules:

- `structured_outputs` as given; the older `guided_json`/`guided_regex`/`guided_choice`/
  `guided_grammar` fields stand for it (vLLM 0.33 ignores them: a constraint dropped
  silently is a wrong answer, so here they still constrain);
- `response_format` (`json_object`, `json_schema`, `structural_tag`) sets its kind over
  the same kind there, keeping the options; a second kind is an error, as is none;
- with a tool parser that has a structural tag and strict tool calling on (vLLM's
  default), tool calls are constrained to that parser's own syntax (`tool_tags`) and
  derender's tool parser reads them as it reads "auto" calls;
- otherwise a forced tool (`tool_choice` "required" or named) replaces all of it with the
  tools' JSON schema, as vLLM does without a structural tag: "required" asks for a JSON
  list of `{"name", "parameters"}` objects, one of the tools each; a named tool for its
  parameters object. Derender parses exactly these forms.

Each constraint is then checked (vLLM's request checks, and whether it compiles), so that
what an engine could not decode is refused before anything is tokenized.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

import msgspec

from tokenway.api.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    ResponseFormat,
)
from tokenway.constraints import check
from tokenway.errors import InvalidRequest
from tokenway.parsers import StrictLevel
from tokenway.wire import StructuredOutputs
from workers.render import tool_tags

_GUIDED = ("json", "regex", "choice", "grammar")  # the kinds of vLLM's older guided_* fields


def constraint(
    req: ChatCompletionRequest | CompletionRequest,
    tags: ToolTags | None = None,
    harmony: bool = False,
) -> StructuredOutputs | None:
    """The request's constraint, checked, or None; `InvalidRequest` naming the parameter
    that asks for it wrongly. With `tags`, a tool-calling request gets the structural tag
    of the tool parser's syntax (`tool_tags`) instead of the tools' JSON schema. `harmony`
    (gpt-oss): a chat's own constraint holds its final answer (`tool_tags.harmony_answer`)."""
    if isinstance(req, ChatCompletionRequest):
        so = req.structured_outputs
        named = isinstance(req.tool_choice, NamedToolChoice)
        if named and so is not None and {"json", "regex", "choice"} & set(so.kinds()):
            raise InvalidRequest(
                "You can only either use constraints for structured outputs or tools, not both.",
                param="tool_choice",
            )
        if tags is None and (tools := _forced_tools(req)) is not None:
            check(tools, "tools")
            return tools
    own = _own(req)
    if own is not None:  # checked before a tool tag reads it
        check(own, _own_param(req))
    if isinstance(req, ChatCompletionRequest) and harmony and own is not None:
        own = tool_tags.harmony_answer(own)
    if isinstance(req, ChatCompletionRequest) and tags is not None:
        tagged = tool_tags.structural_tag(req, tags.parser, tags.level, own)
        if tagged is not None:
            check(tagged, _asked_by(req))
            return tagged
    return own


@dataclass(frozen=True)
class ToolTags:
    """Structural tags for tool calls: the parser whose syntax they spell, and how strict."""

    parser: str
    level: StrictLevel = "auto"


def _asked_by(req: ChatCompletionRequest | CompletionRequest) -> str:
    """The parameter the request's constraint comes from."""
    if isinstance(req, ChatCompletionRequest) and _forces_a_call(req):
        return "tools"
    return _own_param(req)


def _own_param(req: ChatCompletionRequest | CompletionRequest) -> str:
    """The parameter the request's own constraint (tools apart) comes from."""
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        return "response_format"
    guided = [f"guided_{kind}" for kind in _GUIDED if getattr(req, f"guided_{kind}") is not None]
    return guided[0] if guided else "structured_outputs"


def _own(req: ChatCompletionRequest | CompletionRequest) -> StructuredOutputs | None:
    """The constraint the request asks for itself (tools apart)."""
    so = req.structured_outputs
    guided = _guided(req)
    if guided is not None:
        if so is not None:
            raise InvalidRequest(
                "give structured_outputs or the guided_* fields, not both",
                param="structured_outputs",
            )
        so = guided
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        kind, value = _from_format(fmt)
        so = (
            StructuredOutputs(**{kind: value})
            if so is None
            else msgspec.structs.replace(so, **{kind: value})
        )
    return so


def _guided(req: ChatCompletionRequest | CompletionRequest) -> StructuredOutputs | None:
    given = {kind: getattr(req, f"guided_{kind}") for kind in _GUIDED}
    set_ = {k: v for k, v in given.items() if v is not None}
    if not set_:
        return None
    return StructuredOutputs(**set_, whitespace_pattern=req.guided_whitespace_pattern)


def _from_format(fmt: ResponseFormat) -> tuple[str, Any]:
    if fmt.type == "json_object":
        return "json_object", True
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise InvalidRequest(
                "When response_format type is 'json_schema', the 'json_schema' field must be "
                "provided.",
                param="response_format",
            )
        if fmt.json_schema.schema is None:
            raise InvalidRequest(
                "response_format.json_schema needs its schema",
                param="response_format.json_schema.schema",
            )
        return "json", fmt.json_schema.schema
    # a structural tag travels as vLLM makes it: its JSON, as Python's json.dumps writes it
    if fmt.format is not None:
        tag: dict[str, Any] = {"type": "structural_tag", "format": fmt.format}
    elif fmt.structures is not None and fmt.triggers is not None:
        structures = [
            {"begin": s.get("begin"), "schema": s.get("schema"), "end": s.get("end")}
            for s in fmt.structures
        ]
        tag = {"type": "structural_tag", "structures": structures, "triggers": fmt.triggers}
    else:
        raise InvalidRequest(
            "Invalid response_format structural_tag specification.", param="response_format"
        )
    return "structural_tag", json.dumps(tag)


def _forces_a_call(req: ChatCompletionRequest) -> bool:
    return bool(req.tools) and req.tool_choice not in (None, "none", "auto")


def _forced_tools(req: ChatCompletionRequest) -> StructuredOutputs | None:
    """The constraint of a forced tool call (None when no call is forced, or for a named
    tool not among the tools: parse_context names it)."""
    if not _forces_a_call(req):
        return None
    choice, tools = req.tool_choice, req.tools or []
    if isinstance(choice, NamedToolChoice):  # its parameters object
        tool = next((t for t in tools if t.function.name == choice.function.name), None)
        return None if tool is None else StructuredOutputs(json=_params(tool.function.parameters))
    defs: dict[str, Any] = {}
    options = []
    for tool in tools:
        params = copy.deepcopy(_params(tool.function.parameters))
        found = params.pop("$defs", None) or {}
        if not isinstance(found, dict):
            raise InvalidRequest(
                f"`$defs` in the parameters of tool '{tool.function.name}' must be an object, "
                f"got {type(found).__name__}.",
                param="tools",
            )
        for name, definition in found.items():
            if defs.setdefault(name, definition) != definition:
                raise InvalidRequest(
                    f"Tool definition '{name}' has multiple schemas, which is not supported.",
                    param="tools",
                )
        options.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": options},
    }
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return StructuredOutputs(json=schema)


def _params(parameters: dict[str, Any] | None) -> dict[str, Any]:
    return parameters or {"type": "object", "properties": {}}
