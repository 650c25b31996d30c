"""What one request may make the process build, checked before anything is templated,
tokenized or compiled, so that a body the size of the HTTP limit (8 MB) cannot cost the
process a gigabyte (issue 30: one tool of 80,000 properties was templated into a 7 MB prompt
and tokenized, 1.1 GB at the peak). Each limit is a setting, and a request past one is the
client's 400 naming the limit, its value and the parameter.

Before the body is decoded into Python objects (`check_text`, from the JSON text alone,
which msgspec reads in a few ms where decoding 7 MB of schema takes 200 ms and 30 MB):

- `max_tools`: the tools of one request. OpenAI takes at most 128; vLLM has no bound.
  Each tool is templated into the prompt, and with strict tool calling each is a branch of
  the structural tag the engine compiles: 1024 leaves eight times OpenAI's room to clients
  that send more (agent hosts gather tools from many servers).
- `max_schema_bytes`: the JSON text of all of a request's schemas together: its tools'
  parameters, `response_format` and `structured_outputs` / `guided_json`. 128 ordinary
  tools take about 80 KB, OpenAI's largest structured-output schema (5,000 properties) a
  few hundred; 1 MiB is twice that. A tool's schema is templated into the prompt, and a
  prompt is tokenized at about 140 bytes of memory per byte: 1 MiB of it, 150 MB.

Once it is decoded (`check_decoded`):

- `max_schema_nodes`: the JSON values (objects, arrays and scalars) in all of a request's
  schemas together, a structural tag's among them. Decoding, templating and compiling work
  per value, and a value can be two bytes: 128 ordinary tools hold about 4,000, OpenAI's
  largest schema about 15,000; 65,536 is four times that.
- `max_grammar_bytes`: what llguidance compiles as text: the request's regexes, grammars
  and choices, and the patterns and grammars in its schemas and structural tag (compiling
  a regex took about 240 bytes per byte of it: 62 MB for 256 KiB). Real grammars take a
  few KiB.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from tokenway.config import Settings
from tokenway.errors import InvalidRequest
from tokenway.wire import StructuredOutputs


class RequestLimits(msgspec.Struct, frozen=True, kw_only=True):
    max_tools: int = 1024
    max_schema_bytes: int = 1 << 20
    max_schema_nodes: int = 65_536
    max_grammar_bytes: int = 64 * 1024

    @classmethod
    def of(cls, settings: Settings) -> RequestLimits:
        return cls(
            max_tools=settings.max_tools,
            max_schema_bytes=settings.max_schema_bytes,
            max_schema_nodes=settings.max_schema_nodes,
            max_grammar_bytes=settings.max_grammar_bytes,
        )


DEFAULT_LIMITS = RequestLimits()  # the settings' defaults


# Where a request's schemas are, as each API names them (the chat's names elsewhere).
_TOOL_SCHEMA = {"responses": "tools[{}].parameters", "messages": "tools[{}].input_schema"}
_FORMAT = {"responses": "text.format", "messages": "output_config.format"}


class _FunctionText(msgspec.Struct):
    parameters: msgspec.Raw = msgspec.Raw()


class _ToolText(msgspec.Struct):
    """A tool's schema as JSON text, wherever its API puts it."""

    function: _FunctionText | None = None  # chat
    parameters: msgspec.Raw = msgspec.Raw()  # Responses
    input_schema: msgspec.Raw = msgspec.Raw()  # Messages
    tools: list[_ToolText] | None = None  # a Responses namespace's tools

    def size(self) -> int:
        inner = len(self.function.parameters) if self.function else 0
        return inner + len(self.parameters) + len(self.input_schema)


class _SchemaText(msgspec.Struct):
    """Where a body's schemas are, on every API, as JSON text (msgspec skips the rest)."""

    tools: list[_ToolText] | None = None
    response_format: msgspec.Raw = msgspec.Raw()
    text: msgspec.Raw = msgspec.Raw()  # Responses' `text.format`
    output_config: msgspec.Raw = msgspec.Raw()  # Messages' `output_config.format`
    structured_outputs: msgspec.Raw = msgspec.Raw()
    guided_json: msgspec.Raw = msgspec.Raw()


_SCHEMA_TEXT = msgspec.json.Decoder(_SchemaText)


def check_text(api: str, body: bytes, limits: RequestLimits) -> None:
    """A body of `api`'s tools and the size of its schemas, before it is decoded (one that
    does not read so is left to the decoder to say what is wrong)."""
    try:
        text = _SCHEMA_TEXT.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return
    where = _TOOL_SCHEMA.get(api, "tools[{}].function.parameters")
    tools: list[tuple[str, _ToolText]] = []
    for i, t in enumerate(text.tools or []):  # a namespace: its tools count, not itself
        tools.append((where.format(i), t))
        tools += [
            (f"tools[{i}].tools[{j}].parameters", inner) for j, inner in enumerate(t.tools or [])
        ]
    _check_tools(limits, sum(1 for _, t in tools if t.tools is None))
    sizes = [(param, t.size()) for param, t in tools]
    fmt = len(text.response_format) + len(text.text) + len(text.output_config)
    sizes += [
        (_FORMAT.get(api, "response_format"), fmt),
        ("structured_outputs", len(text.structured_outputs)),
        ("guided_json", len(text.guided_json)),
    ]
    total = sum(size for _, size in sizes)
    if total > limits.max_schema_bytes:
        past, running = "", 0
        for param, size in sizes:
            running += size
            if running > limits.max_schema_bytes:
                past = param
                break
        raise InvalidRequest(
            f"the request's JSON schemas come to {total} bytes, all together, more than the "
            f"{limits.max_schema_bytes} one request may carry (--max-schema-bytes); {past} "
            "passes it",
            param=past,
        )


def check_decoded(api: str, req: Any, limits: RequestLimits) -> None:
    """A request of `api` decoded (as the chat request it is, or a `/tokenize` chat): its
    tools again (for a body `check_text` could not read), the values of its schemas and
    the size of its grammars."""
    tools = getattr(req, "tools", None) or []
    _check_tools(limits, len(tools))
    where = _TOOL_SCHEMA.get(api, "tools[{}].function.parameters")
    schemas = [(where.format(i), t.function.parameters) for i, t in enumerate(tools)]
    grammars: list[tuple[str, str]] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None:
        schema = fmt.json_schema.schema if fmt.json_schema else None
        schemas.append((_FORMAT.get(api, "response_format"), [schema, fmt.format, fmt.structures]))
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        schemas += _constraint_schemas(so, "structured_outputs")
        grammars += _constraint_texts(so, "structured_outputs")
    if hasattr(req, "guided_json"):  # chat and completions
        schemas.append(("guided_json", req.guided_json))
        grammars += _texts("guided_regex", req.guided_regex)
        grammars += _texts("guided_grammar", req.guided_grammar)
        grammars += _texts("guided_choice", *(req.guided_choice or ()))
        grammars += _texts("guided_whitespace_pattern", req.guided_whitespace_pattern)
    _check_schemas(limits, [(p, s) for p, s in schemas if s is not None], grammars)


def check_constraint(so: StructuredOutputs | None, limits: RequestLimits, param: str) -> None:
    """A constraint that reaches an engine without a request body around it (a direct
    publisher's token-only request): its schemas' values and its grammars' size."""
    if so is not None:
        _check_schemas(limits, _constraint_schemas(so, param), _constraint_texts(so, param))


def _constraint_schemas(so: StructuredOutputs, param: str) -> list[tuple[str, object]]:
    return [(param, s) for s in (so.json, so.structural_tag) if s is not None]


def _constraint_texts(so: StructuredOutputs, param: str) -> list[tuple[str, str]]:
    return _texts(param, so.regex, so.grammar, so.whitespace_pattern, *(so.choice or ()))


def _texts(param: str, *texts: str | None) -> list[tuple[str, str]]:
    return [(param, text) for text in texts if text is not None]


def _check_schemas(
    limits: RequestLimits,
    schemas: Iterable[tuple[str, object]],
    grammars: Iterable[tuple[str, str]],
) -> None:
    """`schemas`: JSON schemas and structural tags by parameter (as JSON text or decoded);
    `grammars`: regexes, grammars and choices by parameter."""
    nodes, texts = 0, list(grammars)
    for param, schema in schemas:
        patterns: list[str] = []
        nodes = _count(schema, nodes, limits.max_schema_nodes, patterns)
        texts += [(param, pattern) for pattern in patterns]
        if nodes > limits.max_schema_nodes:
            raise InvalidRequest(
                f"{param} takes the request's JSON schemas past {limits.max_schema_nodes} "
                "values (objects, arrays and scalars, all schemas together), the most one "
                "request may carry (--max-schema-nodes)",
                param=param,
            )
    size = sum(len(text.encode()) for _, text in texts)
    if size > limits.max_grammar_bytes:
        given = sorted({param for param, _ in texts})
        raise InvalidRequest(
            f"the regexes, grammars and choices of {', '.join(given)} come to {size} bytes, "
            f"more than the {limits.max_grammar_bytes} one request may carry "
            "(--max-grammar-bytes; the patterns in a schema count)",
            param=given[0] if len(given) == 1 else None,
        )


def _check_tools(limits: RequestLimits, tools: int) -> None:
    if tools > limits.max_tools:
        raise InvalidRequest(
            f"{tools} tools in one request, more than the {limits.max_tools} allowed (--max-tools)",
            param="tools",
        )


def _count(value: object, nodes: int, most: int, patterns: list[str]) -> int:
    """`nodes` plus the values in `value`, counted no further than past `most`; the
    patterns and grammars found on the way are added to `patterns`."""
    if isinstance(value, str):  # a schema given as JSON text
        try:
            value = msgspec.json.decode(value)
        except (msgspec.DecodeError, RecursionError):
            return nodes + 1  # not JSON: its own check says so
    nodes += 1
    todo = [value]
    while todo:
        item = todo.pop()
        if not isinstance(item, dict | list):
            continue
        nodes += len(item)  # its values, each one node
        if nodes > most:  # so the walk never holds more than `most` values
            return nodes
        if isinstance(item, list):
            todo.extend(item)
            continue
        for key in ("pattern", "grammar"):  # a schema's, a structural tag's formats'
            if isinstance(text := item.get(key), str):
                patterns.append(text)
        more = item.get("patternProperties")
        if isinstance(more, dict):
            patterns.extend(more)
        todo.extend(item.values())
    return nodes
