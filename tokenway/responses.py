"""OpenAI's Responses API (`POST /v1/responses`): its request bodies and the chat
completion request each one is.

A Responses request runs as the chat completion it translates to, like a Messages request
(`tokenway.anthropic`): `instructions` lead as a system message, message items keep their
role, `function_call` items are an assistant's tool calls, `function_call_output` items
tool messages, and a `reasoning` item is the reasoning of the assistant turn after it.
The ingress resolves `previous_response_id` (`ingress.responses`) before render sees the
request; the response object echoes the request's fields (`echoed`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from tokenway.errors import InvalidRequest
from tokenway.protocol import (
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

RESPONSE_ID_PREFIX = "resp_"
# The chat request's parameters a Responses request gives by other names (`to_chat`): what
# an error about one names.
CHAT_PARAMS = {
    "messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
    "response_format.json_schema.schema": "text.format.schema",
}  # fmt: skip
COMPLETED = "response.completed"  # a Responses stream's last event, holding the response


class Part(Struct, kw_only=True, omit_defaults=True):
    """A content part: `input_text`, `output_text`, `text`, or `reasoning_text`/
    `summary_text` in a reasoning item (others: a 400)."""

    type: str
    text: str | None = None


class Item(Struct, kw_only=True, omit_defaults=True):
    """An input item: a message (with or without `type`), a function call, its output, or
    reasoning."""

    type: str = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[Part] | None = None
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None
    arguments: str | None = None
    output: str | None = None
    summary: list[Part] | None = None  # reasoning
    id: str | None = None
    status: str | None = None


class FunctionTool(Struct, kw_only=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


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
            raise InvalidRequest(f"{where}[{i}]: {p.type!r} parts are not served here",
                                 param=where)  # fmt: skip
        parts.append(p.text or "")
    return "".join(parts)


def _messages(req: ResponsesRequest) -> list[Message]:
    out = [Message(role="system", content=req.instructions)] if req.instructions else []
    items = [Item(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    thought = None  # a reasoning item's text, for the assistant turn after it
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if item.type == "reasoning":
            thought = _text(item.content or item.summary, f"{where}.content")
        elif item.type == "message":
            if item.role is None:
                raise InvalidRequest(f"{where}: a message needs its role", param=where)
            text = _text(item.content, f"{where}.content")
            if item.role == "assistant":
                out.append(Message(role="assistant", content=text, reasoning_content=thought))
                thought = None
            else:
                out.append(Message(role=item.role, content=text))
        elif item.type == "function_call":
            if not item.call_id or not item.name:
                raise InvalidRequest(f"{where}: a function_call needs its call_id and name",
                                     param=where)  # fmt: skip
            call = ToolCall(id=item.call_id, function=FunctionCall(
                name=item.name, arguments=item.arguments or "{}"))  # fmt: skip
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and thought is None:
                last.tool_calls = [*(last.tool_calls or []), call]  # the same turn's calls
            else:
                out.append(Message(role="assistant", content="", tool_calls=[call],
                                   reasoning_content=thought))  # fmt: skip
                thought = None
        elif item.type == "function_call_output":
            if not item.call_id:
                raise InvalidRequest(f"{where}: a function_call_output needs its call_id",
                                     param=where)  # fmt: skip
            out.append(Message(role="tool", tool_call_id=item.call_id, content=item.output or ""))
        else:
            raise InvalidRequest(f"{where}: {item.type!r} items are not served here", param=where)
    return out


def _tools(req: ResponsesRequest) -> list[Tool] | None:
    if not req.tools:
        return None
    tools = []
    for i, t in enumerate(req.tools):
        if t.type != "function" or not t.name:
            raise InvalidRequest(f"tools[{i}]: only function tools (with a name) are served "
                                 f"here, not {t.type!r}", param="tools")  # fmt: skip
        function = FunctionDef(name=t.name, description=t.description,
                               parameters=t.parameters, strict=t.strict)  # fmt: skip
        tools.append(Tool(function=function))
    return tools


def _tool_choice(choice: str | NamedTool | None, tools: list[Tool] | None) -> Any:
    """The chat's tool choice. Without tools there is nothing to call: `auto` is `none`,
    as OpenAI and vLLM take it, and a choice that forces a call is the client's 400."""
    if isinstance(choice, NamedTool):
        if choice.type != "function" or not choice.name:
            raise InvalidRequest("tool_choice: name a function tool", param="tool_choice")
        if not tools:
            raise InvalidRequest(f"tool_choice names the function {choice.name!r}, but the "
                                 "request gives no tools", param="tool_choice")  # fmt: skip
        return NamedToolChoice(function=NamedFunction(choice.name))
    if choice == "required" and not tools:
        raise InvalidRequest("tool_choice 'required' needs tools: the request gives none to call",
                             param="tool_choice")  # fmt: skip
    return choice if tools else None


def _format(text: Text | None) -> ResponseFormat | None:
    f = text.format if text else None
    if f is None or f.type == "text":
        return None
    if f.type == "json_object":
        return ResponseFormat(type="json_object")
    schema = JsonSchemaFormat(name=f.name or "response", description=f.description,
                              schema=f.schema, strict=f.strict)  # fmt: skip
    return ResponseFormat(type="json_schema", json_schema=schema)


def _thinking(req: ResponsesRequest) -> dict[str, Any] | None:
    """The template's switch: off for effort `none` or `minimal`, on for any other; what
    the client's own `chat_template_kwargs` say wins."""
    effort = req.reasoning.effort if req.reasoning else None
    switch = None if effort is None else thinking_switch(effort not in ("none", "minimal"))
    return template_kwargs(switch, req.chat_template_kwargs)


LOGPROBS = "message.output_text.logprobs"  # the `include` of logprobs, not served here


def _refuse_unserved(req: ResponsesRequest) -> None:
    """OpenAI's fields that would change the answer, were they served: a 400 naming the
    first one set. Hints (other `include`s, such as the encrypted reasoning Codex asks for
    with `store: false`; `service_tier`, `prompt_cache_key`) change nothing and are taken."""
    unserved = {
        "background": (req.background, "responses run while the request waits; none is "
                       "served in the background"),
        "conversation": (req.conversation is not None, "the Conversations API is not served; "
                         "go on from a stored response with previous_response_id"),
        "prompt": (req.prompt is not None, "stored prompt templates are not served"),
        "truncation": (req.truncation not in (None, "disabled"), "only 'disabled' is "
                       "served: a prompt past the context is a 400"),
        "top_logprobs": (bool(req.top_logprobs), "logprobs are not served on this route "
                         "(/v1/chat/completions has them)"),
        "include": (LOGPROBS in (req.include or []), f"{LOGPROBS} is not served on this "
                    "route (/v1/chat/completions has logprobs)"),
        "max_tool_calls": (req.max_tool_calls is not None, "a cap on tool calls is not "
                           "served (parallel_tool_calls: false allows one)"),
    }  # fmt: skip
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
            "before the input", param="previous_response_id",
        )  # fmt: skip
    tools = _tools(req)
    return ChatCompletionRequest(
        model=req.model, messages=_messages(req), max_tokens=req.max_output_tokens,
        stream=req.stream, temperature=req.temperature, top_p=req.top_p, tools=tools,
        tool_choice=_tool_choice(req.tool_choice, tools),
        parallel_tool_calls=req.parallel_tool_calls is not False,
        response_format=_format(req.text), chat_template_kwargs=_thinking(req),
        include_reasoning=req.include_reasoning, user=req.user, **sampling_of(req),
    )  # fmt: skip


ResponsesDecoder = msgspec.json.Decoder(ResponsesRequest, strict=False)


def echoed(body: bytes, previous: str | None) -> bytes:
    """The request's fields its response object repeats (a JSON object), as OpenAI's do."""
    req = decoded(ResponsesDecoder, body)
    f = req.text.format if req.text else None
    return _json.encode({
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": previous,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                      "summary": req.reasoning.summary if req.reasoning else None},
        "store": req.store is not False, "temperature": req.temperature,
        "text": {"format": msgspec.to_builtins(f) if f else {"type": "text"}},
        "tool_choice": msgspec.to_builtins(req.tool_choice) if req.tool_choice else "auto",
        "tools": msgspec.to_builtins(req.tools or []), "top_p": req.top_p,
        "truncation": "disabled", "user": req.user,
    })  # fmt: skip


_json = msgspec.json.Encoder()
