"""OpenAI's Responses API (`POST /v1/responses`): its request bodies and the chat
completion request each one is.

A Responses request runs as the chat completion it translates to, like a Messages request
(`tokenway.api.anthropic`): `instructions` lead as a system message, message items keep their
role, `function_call` items are an assistant's tool calls, `function_call_output` items
tool messages, and a `reasoning` item is the reasoning of the assistant turn after it.

Tools as vLLM 0.33 shows them to the model: a `namespace`'s tools as functions named
`<namespace>__<name>`, a `custom` (freeform) tool as a function of one string argument,
`input`; hosted tools this deployment cannot run (`HOSTED`: web search, file search, code
interpreter, MCP…) are not shown at all, and their calls sent back as history are skipped.
Derender turns a call back into the item its tool makes (`call_names`).
The ingress resolves `previous_response_id` (`ingress.responses`) before render sees the
request; the response object echoes the request's fields (`echoed`).
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Annotated, Any, Literal, NamedTuple

import msgspec
from msgspec import Meta, Struct

from tokenway.api.openai import (
    ChatCompletionRequest,
    FunctionCall,
    FunctionDef,
    JsonSchemaFormat,
    Message,
    NamedFunction,
    NamedToolChoice,
    PosInt,
    ResponseFormat,
    Sampling,
    Temperature,
    Tool,
    ToolCall,
    TopP,
    decoded,
    sampling_of,
    template_kwargs,
    thinking_switch,
)
from tokenway.errors import InvalidRequest

RESPONSE_ID_PREFIX = "resp_"
# The chat request's parameters a Responses request gives by other names (`to_chat`): what
# an error about one names.
CHAT_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "response_format.json_schema.schema": "text.format.schema",
    "reasoning_effort": "reasoning.effort",
}
COMPLETED = "response.completed"  # a Responses stream's last event, holding the response


class Part(Struct, kw_only=True, omit_defaults=True):
    """A content part: `input_text`, `output_text`, `text`, or `reasoning_text`/
    `summary_text` in a reasoning item (others: a 400)."""

    type: str
    text: str | None = None


class Item(Struct, kw_only=True, omit_defaults=True):
    """An input item: a message (with or without `type`), a function or custom tool call,
    its output, or reasoning."""

    type: str = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[Part] | None = None
    call_id: str | None = None  # function_call, custom_tool_call and their outputs
    name: str | None = None
    namespace: str | None = None
    arguments: str | None = None
    input: str | None = None  # custom_tool_call
    output: str | list[Part] | None = None
    summary: list[Part] | None = None  # reasoning
    encrypted_content: str | None = None  # reasoning, as `sealed` makes it
    id: str | None = None
    status: str | None = None


class FunctionTool(Struct, kw_only=True, omit_defaults=True):
    """A tool: a function, a custom tool (`format`: its grammar or text), a namespace of
    them (`tools`), or a hosted tool (its other fields are not read)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    format: dict[str, Any] | None = None  # custom
    tools: list[FunctionTool] | None = None  # namespace


class NamedTool(Struct, kw_only=True):
    type: str
    name: str | None = None


class Reasoning(Struct, kw_only=True):
    effort: str | None = None
    summary: str | None = None


class TextFormat(Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class Text(Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint: echoed, not acted on


class ResponsesRequest(Sampling, kw_only=True):
    model: str | None = None
    input: str | Annotated[list[Item], Meta(min_length=1)]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = True
    max_output_tokens: PosInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    reasoning: Reasoning | None = None
    text: Text | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = True
    previous_response_id: str | None = None
    stream: bool | None = False
    user: str | None = None
    # vLLM extras (with `Sampling`'s)
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    # OpenAI's, not served: a 400 naming each one set to what would change the answer
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    max_tool_calls: int | None = None


def _text(content: str | list[Part] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for i, p in enumerate(content):
        if p.type not in ("input_text", "output_text", "text", "reasoning_text", "summary_text"):
            why = " (images and files need multimodal input, not served yet)" * (
                p.type in ("input_image", "input_file")
            )
            raise InvalidRequest(
                f"{where}[{i}]: {p.type!r} parts are not served here{why}", param=where
            )
        parts.append(p.text or "")
    return "".join(parts)


# Tools OpenAI runs itself: none runs here, so none is shown to the model (as vLLM drops
# them), and the calls of them a client sends back as history are skipped.
HOSTED = frozenset(
    {
        "web_search",
        "web_search_2025_08_26",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "image_generation",
        "computer",
        "computer_use_preview",
        "mcp",
        "tool_search",
        "programmatic_tool_calling",
    }
)
HOSTED_CALLS = frozenset(
    {
        "web_search_call",
        "file_search_call",
        "code_interpreter_call",
        "image_generation_call",
        "mcp_list_tools",
        "mcp_call",
        "tool_search_call",
        "tool_search_output",
    }
)
SEPARATOR = "__"  # between a namespace and its tool's name, in the name the model calls
CUSTOM_INPUT = "input"  # the one argument a custom tool's function takes
CUSTOM_PARAMETERS = {
    "type": "object",
    "required": [CUSTOM_INPUT],
    "additionalProperties": False,
    "properties": {CUSTOM_INPUT: {"type": "string", "description": "The tool's input."}},
}
_SEALED = "twr1."  # what `encrypted_content` made here starts with


def sealed(reasoning: str) -> str:
    """A reasoning item's `encrypted_content`: its reasoning, base64 (not secret: a stateless
    client keeps it to send back, and `_unsealed` reads it)."""
    return _SEALED + base64.urlsafe_b64encode(reasoning.encode()).decode()


def _unsealed(content: str | None) -> str | None:
    """The reasoning `sealed` made, None from anywhere else (another server's)."""
    if not content or not content.startswith(_SEALED):
        return None
    try:
        return base64.urlsafe_b64decode(content[len(_SEALED) :]).decode()
    except (binascii.Error, ValueError):
        return None


class CallName(NamedTuple):
    """What a call of a shown function is, for its output item."""

    name: str
    namespace: str | None = None
    custom: bool = False


def call_names(tools: list[dict[str, Any]]) -> dict[str, CallName]:
    """The shown names (of the echoed `tools`) whose calls are not plain function calls:
    a namespace's tools, custom tools."""
    names: dict[str, CallName] = {}
    for tool in tools:
        inner = tool.get("tools") if tool.get("type") == "namespace" else [tool]
        ns = tool.get("name") if tool.get("type") == "namespace" else None
        for t in inner or []:
            if ns is None and t.get("type") != "custom":
                continue
            name: str = t["name"]  # a function or custom tool has one (`_function`)
            flat = f"{ns}{SEPARATOR}{name}" if ns else name
            names[flat] = CallName(name, ns, t.get("type") == "custom")
    return names


def _flat(name: str, namespace: str | None) -> str:
    return f"{namespace}{SEPARATOR}{name}" if namespace else name


def _messages(req: ResponsesRequest) -> list[Message]:
    out = [Message(role="system", content=req.instructions)] if req.instructions else []
    items = [Item(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    thought = None  # a reasoning item's text, for the assistant turn after it
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if item.type == "reasoning":
            thought = (
                _text(item.content, f"{where}.content")
                if item.content
                else _unsealed(item.encrypted_content) or _text(item.summary, f"{where}.summary")
            )
        elif item.type == "message":
            if item.role is None:
                raise InvalidRequest(f"{where}: a message needs its role", param=where)
            text = _text(item.content, f"{where}.content")
            if item.role == "assistant":
                out.append(Message(role="assistant", content=text, reasoning_content=thought))
                thought = None
            else:
                out.append(Message(role=item.role, content=text))
        elif item.type in ("function_call", "custom_tool_call"):
            if not item.call_id or not item.name:
                raise InvalidRequest(
                    f"{where}: a {item.type} needs its call_id and name", param=where
                )
            arguments = (
                item.arguments or "{}"
                if item.type == "function_call"
                else json.dumps({CUSTOM_INPUT: item.input or ""})
            )
            call = ToolCall(
                id=item.call_id,
                function=FunctionCall(name=_flat(item.name, item.namespace), arguments=arguments),
            )
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and thought is None:
                last.tool_calls = [*(last.tool_calls or []), call]  # the same turn's calls
            else:
                out.append(
                    Message(
                        role="assistant", content="", tool_calls=[call], reasoning_content=thought
                    )
                )
                thought = None
        elif item.type in ("function_call_output", "custom_tool_call_output"):
            if not item.call_id:
                raise InvalidRequest(f"{where}: a {item.type} needs its call_id", param=where)
            output = _text(item.output, f"{where}.output")  # text parts; images: a 400
            out.append(Message(role="tool", tool_call_id=item.call_id, content=output))
        elif item.type not in HOSTED_CALLS:  # those: what a hosted tool did elsewhere
            raise InvalidRequest(f"{where}: {item.type!r} items are not served here", param=where)
    return out


def _function(t: FunctionTool, where: str, namespace: str | None = None) -> Tool:
    """The function a tool is shown to the model as."""
    if t.type not in ("function", "custom") or not t.name:
        raise InvalidRequest(
            f"{where}: {t.type!r} tools are not served here: function, custom and namespace "
            f"tools are (with a name), and hosted tools are not shown to the model",
            param="tools",
        )
    custom = t.type == "custom"
    function = FunctionDef(
        name=_flat(t.name, namespace),
        description=t.description,
        parameters=CUSTOM_PARAMETERS if custom else t.parameters,
        strict=None if custom else t.strict,
    )
    return Tool(function=function)


def _tools(req: ResponsesRequest) -> list[Tool] | None:
    tools = []
    for i, t in enumerate(req.tools or []):
        if t.type in HOSTED:
            continue
        if t.type != "namespace":
            tools.append(_function(t, f"tools[{i}]"))
            continue
        if not t.name or not t.tools:
            raise InvalidRequest(f"tools[{i}]: a namespace needs its name and tools", param="tools")
        tools += [
            _function(inner, f"tools[{i}].tools[{j}]", t.name) for j, inner in enumerate(t.tools)
        ]
    return tools or None


def _chosen(name: str, req: ResponsesRequest) -> str:
    """The shown name a named tool choice means: its own, or the one namespaced tool of that
    name (two namespaces' tools of the name: the client's 400, naming both)."""
    tools = req.tools or []
    if any(t.name == name for t in tools if t.type != "namespace"):
        return name
    held = [
        _flat(inner.name, t.name)
        for t in tools
        if t.type == "namespace"
        for inner in t.tools or []
        if inner.name == name
    ]
    if len(held) > 1:
        raise InvalidRequest(
            f"tool_choice {name!r} is a tool of more than one namespace "
            f"({', '.join(held)}): name it as one of those",
            param="tool_choice",
        )
    return held[0] if held else name


def _tool_choice(req: ResponsesRequest, tools: list[Tool] | None) -> Any:
    """The chat's tool choice. Without tools there is nothing to call: `auto` is `none`,
    as OpenAI and vLLM take it, and a choice that forces a call is the client's 400."""
    choice = req.tool_choice
    if isinstance(choice, NamedTool):
        if choice.type in HOSTED:
            raise InvalidRequest(
                f"tool_choice: {choice.type!r} is a hosted tool, which is not run here",
                param="tool_choice",
            )
        if choice.type not in ("function", "custom") or not choice.name:
            raise InvalidRequest("tool_choice: name a function or custom tool", param="tool_choice")
        if not tools:
            raise InvalidRequest(
                f"tool_choice names the function {choice.name!r}, but the request gives no tools",
                param="tool_choice",
            )
        return NamedToolChoice(function=NamedFunction(_chosen(choice.name, req)))
    if choice == "required" and not tools:
        raise InvalidRequest(
            "tool_choice 'required' needs tools: the request gives none to call",
            param="tool_choice",
        )
    return choice if tools else None


def _format(text: Text | None) -> ResponseFormat | None:
    f = text.format if text else None
    if f is None or f.type == "text":
        return None
    if f.type == "json_object":
        return ResponseFormat(type="json_object")
    schema = JsonSchemaFormat(
        name=f.name or "response", description=f.description, schema=f.schema, strict=f.strict
    )
    return ResponseFormat(type="json_schema", json_schema=schema)


def _thinking(req: ResponsesRequest) -> dict[str, Any] | None:
    """The template's switch: off for effort `none` or `minimal`, on for any other; what
    the client's own `chat_template_kwargs` say wins."""
    effort = req.reasoning.effort if req.reasoning else None
    switch = None if effort is None else thinking_switch(effort not in ("none", "minimal"))
    return template_kwargs(switch, req.chat_template_kwargs)


LOGPROBS = "message.output_text.logprobs"  # the `include` of logprobs, not served here
SEALED_REASONING = "reasoning.encrypted_content"  # the `include` of `sealed` reasoning
PRIVATE = "_tokenway"  # the echoed fields' key of what derender reads and does not echo


def _refuse_unserved(req: ResponsesRequest) -> None:
    """OpenAI's fields that would change the answer, were they served: a 400 naming the
    first one set. Hints (other `include`s; `service_tier`, `prompt_cache_key`) change
    nothing and are taken."""
    unserved = {
        "background": (
            req.background,
            "responses run while the request waits; none is served in the background",
        ),
        "conversation": (
            req.conversation is not None,
            "the Conversations API is not served; "
            "go on from a stored response with previous_response_id",
        ),
        "prompt": (req.prompt is not None, "stored prompt templates are not served"),
        "truncation": (
            req.truncation not in (None, "disabled"),
            "only 'disabled' is served: a prompt past the context is a 400",
        ),
        "top_logprobs": (
            bool(req.top_logprobs),
            "logprobs are not served on this route (/v1/chat/completions has them)",
        ),
        "include": (
            LOGPROBS in (req.include or []),
            f"{LOGPROBS} is not served on this route (/v1/chat/completions has logprobs)",
        ),
        "max_tool_calls": (
            req.max_tool_calls is not None,
            "a cap on tool calls is not served (parallel_tool_calls: false allows one)",
        ),
    }
    for param, (refused, why) in unserved.items():
        if refused:
            raise InvalidRequest(f"{param}: {why}", param=param)


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request a Responses request is (one naming a stored response
    it continues is the ingress's to resolve: here, a 400)."""
    _refuse_unserved(req)
    if req.previous_response_id:
        raise InvalidRequest(
            "previous_response_id is for the ingress, which puts the stored conversation "
            "before the input",
            param="previous_response_id",
        )
    tools = _tools(req)
    return ChatCompletionRequest(
        model=req.model,
        messages=_messages(req),
        max_tokens=req.max_output_tokens,
        stream=req.stream,
        temperature=req.temperature,
        top_p=req.top_p,
        tools=tools,
        tool_choice=_tool_choice(req, tools),
        parallel_tool_calls=req.parallel_tool_calls is not False,
        response_format=_format(req.text),
        chat_template_kwargs=_thinking(req),
        # harmony's system message says it (a template reads the switch above)
        reasoning_effort=req.reasoning.effort if req.reasoning else None,  # type: ignore[arg-type]
        include_reasoning=req.include_reasoning,
        user=req.user,
        **sampling_of(req),
    )


ResponsesDecoder = msgspec.json.Decoder(ResponsesRequest, strict=False)


def echoed(body: bytes, previous: str | None) -> bytes:
    """The request's fields its response object repeats (a JSON object), as OpenAI's do."""
    req = decoded(ResponsesDecoder, body)
    f = req.text.format if req.text else None
    return _json.encode(
        {
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": previous,
            "reasoning": {
                "effort": req.reasoning.effort if req.reasoning else None,
                "summary": req.reasoning.summary if req.reasoning else None,
            },
            "store": req.store is not False,
            "temperature": req.temperature,
            "text": {
                "format": msgspec.to_builtins(f) if f else {"type": "text"},
                "verbosity": req.text.verbosity if req.text else None,
            },
            "tool_choice": msgspec.to_builtins(req.tool_choice) if req.tool_choice else "auto",
            "tools": msgspec.to_builtins(req.tools or []),
            "top_p": req.top_p,
            "truncation": "disabled",
            "user": req.user,
            # for derender, which takes it out: what the output adds when asked
            PRIVATE: {"sealed_reasoning": SEALED_REASONING in (req.include or [])},
        }
    )


_json = msgspec.json.Encoder()
