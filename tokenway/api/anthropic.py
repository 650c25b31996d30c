"""Anthropic's Messages API (`POST /v1/messages`): its request bodies, the chat completion
request each one is, and its error and stop-reason vocabulary.

A Messages request runs as the chat completion it translates to: the model's chat template
renders it, and derender shapes the output as Messages events (`workers.derender.messages`).
The translation keeps what the template sees: `system` leads as a system message, an
assistant's `thinking` blocks are its reasoning, `tool_use` blocks its tool calls, and a
user's `tool_result` blocks become tool messages before the user's own text.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

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
    NonNegInt,
    PosInt,
    ResponseFormat,
    Tool,
    ToolCall,
    TopP,
    check_nesting,
    template_kwargs,
    thinking_switch,
)
from tokenway.errors import InvalidRequest

MESSAGE_ID_PREFIX = "msg_"


class Block(Struct, kw_only=True, omit_defaults=True):
    """A content block: `text`, `thinking`, `tool_use` or `tool_result` (others: a 400)."""

    type: str
    text: str | None = None
    thinking: str | None = None
    signature: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None
    is_error: bool | None = None


class InputMessage(Struct, kw_only=True):
    role: Literal["user", "assistant", "system"]  # system: inline, as agents send reminders
    content: str | list[Block]


class ToolDef(Struct, kw_only=True):
    name: str
    input_schema: dict[str, Any] | None = None  # a custom tool's; Anthropic's typed ones have none
    description: str | None = None
    type: str | None = None  # "custom" or absent, or one of Anthropic's (`bash_20250124`)
    strict: bool | None = None


class ToolChoice(Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(Struct, kw_only=True):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: NonNegInt | None = None


class OutputFormat(Struct, kw_only=True):
    """Structured outputs: the text is JSON held to `schema` by the engine."""

    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(Struct, kw_only=True):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Metadata(Struct, kw_only=True):
    user_id: str | None = None


class MessagesRequest(Struct, kw_only=True):
    model: str | None = None
    max_tokens: PosInt
    messages: Annotated[list[InputMessage], Meta(min_length=1)]
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    metadata: Metadata | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra


class CountTokensRequest(Struct, kw_only=True):
    """`POST /v1/messages/count_tokens`: a request without `max_tokens`."""

    model: str | None = None
    messages: Annotated[list[InputMessage], Meta(min_length=1)]
    system: str | list[Block] | None = None
    tools: list[ToolDef] | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra


Messages = MessagesRequest | CountTokensRequest


# Blocks a multimodal render would show; this one renders text only, so they are refused.
_MEDIA = ("image", "document")


def _not_text(where: str, b: Block, served: str) -> InvalidRequest:
    if b.type in _MEDIA:
        return InvalidRequest(
            f"{where}: {b.type!r} blocks are not served here (images and "
            "documents need a multimodal render; this deployment takes "
            "text only)",
            param=where,
        )
    return InvalidRequest(
        f"{where}: only {served} blocks are served here, not {b.type!r}", param=where
    )


def _text(blocks: str | list[Block] | None, where: str, sep: str = "") -> str:
    """The text of a string or of text blocks (joined by `sep`)."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    parts = []
    for i, b in enumerate(blocks):
        if b.type != "text":
            raise _not_text(f"{where}[{i}]", b, "text")
        parts.append(b.text or "")
    return sep.join(parts)


# A thinking block's signature: "tw1." and a digest of its thinking, the text's UTF-8 bytes
# read as one number mod a Mersenne prime, so a stream can fold it delta by delta in a few
# bytes of state. A checksum, not a key's proof: it shows the thinking came back unchanged.
SIGNATURE_PREFIX = "tw1."
_PRIME = (1 << 61) - 1  # a digest fits the stream state's msgpack integer


def fold_thinking(digest: int, text: str) -> int:
    """The digest of the thinking so far, `text` added."""
    data = text.encode()
    return (digest * pow(256, len(data), _PRIME) + int.from_bytes(data, "big")) % _PRIME


def signature(digest: int) -> str:
    return f"{SIGNATURE_PREFIX}{digest:016x}"


def _check_signature(b: Block, where: str) -> None:
    """A signature tokenway made must fit its thinking; others (another server's, or none)
    are taken, as the thinking reaches only the template."""
    if b.signature and b.signature.startswith(SIGNATURE_PREFIX):
        if b.signature != signature(fold_thinking(0, b.thinking or "")):
            raise InvalidRequest(
                f"{where}.signature: does not fit the block's thinking (it "
                "was changed after tokenway signed it)",
                param=where,
            )


def _assistant(content: str | list[Block], where: str) -> Message:
    if isinstance(content, str):
        return Message(role="assistant", content=content)
    text, thought, calls = [], [], []
    for i, b in enumerate(content):
        if b.type == "text":
            text.append(b.text or "")
        elif b.type == "thinking":
            _check_signature(b, f"{where}[{i}]")
            thought.append(b.thinking or "")
        elif b.type == "redacted_thinking":
            continue  # nothing to show a template
        elif b.type == "tool_use":
            if not b.id or not b.name:
                raise InvalidRequest(
                    f"{where}[{i}]: a tool_use block needs an id and a name", param=where
                )
            check_nesting(f"{where}[{i}].input", b.input)
            arguments = json.dumps(b.input or {}, ensure_ascii=False)
            calls.append(ToolCall(id=b.id, function=FunctionCall(name=b.name, arguments=arguments)))
        else:
            raise InvalidRequest(
                f"{where}[{i}]: an assistant cannot send a {b.type!r} block", param=where
            )
    return Message(
        role="assistant",
        content="".join(text),
        tool_calls=calls or None,
        reasoning_content="".join(thought) or None,
    )


def _user(content: str | list[Block], where: str) -> list[Message]:
    """Tool results first (as tool messages), then the user's own text, if any."""
    if isinstance(content, str):
        return [Message(role="user", content=content)]
    results, text = [], []
    for i, b in enumerate(content):
        if b.type == "tool_result":
            if not b.tool_use_id:
                raise InvalidRequest(
                    f"{where}[{i}]: a tool_result block needs its tool_use_id", param=where
                )
            # a block a line, as vLLM's route joins them (run together, two outputs merge)
            result = _text(b.content, f"{where}[{i}].content", sep="\n")
            if b.is_error:  # a chat's tool message has no flag: the text says it failed
                result = f"Error: {result}" if result else "Error"
            results.append(Message(role="tool", tool_call_id=b.tool_use_id, content=result))
        elif b.type == "text":
            text.append(b.text or "")
        else:
            raise _not_text(f"{where}[{i}]", b, "text and tool_result")
    return results + ([Message(role="user", content="".join(text))] if text else [])


# Claude Code's first system block: its version and a hash of the request (`cch=`), new in
# every request. In the prompt it would make each request's prefix its own, so no turn
# would hit the prefix cache; it says nothing to the model (vLLM's route drops it too).
_BILLING = "x-anthropic-billing-header"


def _system(blocks: str | list[Block] | None, where: str) -> str:
    if isinstance(blocks, str):
        return "" if blocks.startswith(_BILLING) else blocks
    kept = [
        b for b in blocks or () if not (b.type == "text" and (b.text or "").startswith(_BILLING))
    ]
    return _text(kept, where)


def _messages(req: Messages) -> list[Message]:
    out = []
    if req.system and (text := _system(req.system, "system")):
        out.append(Message(role="system", content=text))
    for i, m in enumerate(req.messages):
        where = f"messages[{i}].content"
        if m.role == "system":  # where it stands (a template that wants it first refuses)
            if text := _system(m.content, where):
                out.append(Message(role="system", content=text))
        elif m.role == "assistant":
            out.append(_assistant(m.content, where))
        else:
            out.extend(_user(m.content, where))
    return out


# Anthropic's client tools: typed, without a schema (its models know it), run by the client
# as any tool. A template needs the schema, so the same interface is written out here.
_BASH = (
    "Run a command in a persistent bash session.",
    {
        "type": "object",
        "required": ["command"],
        "properties": {
            "command": {"type": "string", "description": "The command to run."},
            "restart": {"type": "boolean", "description": "Restart the session instead."},
        },
    },
)
_EDITS = ["view", "create", "str_replace", "insert"]
_EDITOR_PROPERTIES = {
    "path": {"type": "string", "description": "The file or directory, an absolute path."},
    "file_text": {"type": "string", "description": "create: the new file's text."},
    "old_str": {"type": "string", "description": "str_replace: the text to replace, once."},
    "new_str": {"type": "string", "description": "str_replace, insert: the new text."},
    "insert_line": {"type": "integer", "description": "insert: after this line (0: first)."},
    "view_range": {
        "type": "array",
        "items": {"type": "integer"},
        "description": "view: the first and last line (-1: to the end).",
    },
}


def _editor(edits: list[str]) -> tuple[str, dict[str, Any]]:
    command = {"type": "string", "enum": edits, "description": "What to do."}
    return (
        "View, create and edit text files.",
        {
            "type": "object",
            "required": ["command", "path"],
            "properties": {"command": command, **_EDITOR_PROPERTIES},
        },
    )


CLIENT_TOOLS = {
    "bash_20241022": _BASH,
    "bash_20250124": _BASH,
    "text_editor_20241022": _editor([*_EDITS, "undo_edit"]),
    "text_editor_20250124": _editor([*_EDITS, "undo_edit"]),
    "text_editor_20250429": _editor(_EDITS),
    "text_editor_20250728": _editor(_EDITS),
}
# Tools Anthropic's servers run (the model's call and its result both come from there).
SERVER_TOOLS = ("web_search_", "web_fetch_", "code_execution_", "tool_search_tool_")


def _tool(i: int, t: ToolDef) -> Tool:
    """A tool as a function the template shows: a custom one, or an Anthropic client tool
    with its known schema; server tools and the computer tool are refused by name."""
    description, schema = t.description, t.input_schema
    if t.type in CLIENT_TOOLS:
        description, schema = CLIENT_TOOLS[t.type]
    elif t.type not in (None, "custom"):
        why = (
            "a server tool (Anthropic runs it); server tools are not served here"
            if t.type.startswith(SERVER_TOOLS)
            else "not served here"
        )
        raise InvalidRequest(
            f"tools[{i}]: {t.type!r} ({t.name!r}) is {why}: give a custom "
            "tool (name, input_schema) and run it yourself",
            param="tools",
        )
    elif schema is None:
        raise InvalidRequest(
            f"tools[{i}].input_schema: a custom tool ({t.name!r}) needs one", param="tools"
        )
    return Tool(
        function=FunctionDef(
            name=t.name, description=description, parameters=schema, strict=t.strict
        )
    )


def _tools(req: Messages) -> list[Tool] | None:
    return [_tool(i, t) for i, t in enumerate(req.tools)] if req.tools else None


# Anthropic's least thinking budget (vLLM's `/v1/messages` holds to it as well).
LEAST_BUDGET = 1024


def _thinking(req: Messages) -> dict[str, Any] | None:
    """The template's switch: on for `enabled` or `adaptive`, off for `disabled`; unsaid,
    the template's own default. The client's own `chat_template_kwargs` win.

    `output_config.effort` does not turn thinking on (vLLM reads it so): in Anthropic's API
    it shapes how much a model spends, and thinking blocks come only where `thinking` asks
    for them. Claude Code sends an effort with thinking off, and a thinking-only reply
    leaves it nothing to show.

    vLLM's route maps `enabled` to the budget alone, so a template that thinks only when
    told (DeepSeek's) does not think there; here a client asking for thinking gets it."""
    thinking = req.thinking
    if thinking is not None and thinking.type == "enabled":
        budget = thinking.budget_tokens
        if budget is None or budget < LEAST_BUDGET:
            raise InvalidRequest(
                f"thinking.budget_tokens: enabled thinking needs a budget of "
                f"at least {LEAST_BUDGET} tokens",
                param="thinking",
            )
        if isinstance(req, MessagesRequest) and budget >= req.max_tokens:
            raise InvalidRequest(
                "thinking.budget_tokens must be less than max_tokens", param="thinking"
            )
    switch = None if thinking is None else thinking_switch(thinking.type != "disabled")
    return template_kwargs(switch, req.chat_template_kwargs)


def _format(req: MessagesRequest) -> ResponseFormat | None:
    f = req.output_config.format if req.output_config else None
    if f is None:
        return None
    return ResponseFormat(
        type="json_schema", json_schema=JsonSchemaFormat(name="output", schema=f.schema)
    )


def _tool_choice(choice: ToolChoice | None) -> Any:
    if choice is None or choice.type == "auto":
        return None
    if choice.type == "any":
        return "required"
    if choice.type == "none":
        return "none"
    if not choice.name:
        raise InvalidRequest("tool_choice of type tool needs the tool's name", param="tool_choice")
    return NamedToolChoice(function=NamedFunction(choice.name))


def to_chat(req: Messages) -> ChatCompletionRequest:
    """The chat completion request a Messages request is."""
    if isinstance(req, CountTokensRequest):
        return ChatCompletionRequest(
            model=req.model,
            messages=_messages(req),
            tools=_tools(req),
            chat_template_kwargs=_thinking(req),
        )
    parallel = not (req.tool_choice and req.tool_choice.disable_parallel_tool_use)
    return ChatCompletionRequest(
        model=req.model,
        messages=_messages(req),
        max_tokens=req.max_tokens,
        stop=req.stop_sequences,
        stream=req.stream,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        tools=_tools(req),
        tool_choice=_tool_choice(req.tool_choice),
        parallel_tool_calls=parallel,
        chat_template_kwargs=_thinking(req),
        response_format=_format(req),
        thinking_token_budget=req.thinking.budget_tokens
        if req.thinking and req.thinking.type == "enabled"
        else None,
        user=req.metadata.user_id if req.metadata else None,
    )


MessagesDecoder = msgspec.json.Decoder(MessagesRequest, strict=False)
CountDecoder = msgspec.json.Decoder(CountTokensRequest, strict=False)


def stop_reason(finish: str | None, stop: int | str | None, called: bool) -> str | None:
    """Why a message stopped, from the chat's finish reason (and whether it called tools:
    a named tool's call ends a chat with `stop`, a message with `tool_use`)."""
    if finish == "length":
        return "max_tokens"
    if finish == "tool_calls" or (finish == "stop" and called):
        return "tool_use"
    if finish == "stop" and isinstance(stop, str):
        return "stop_sequence"
    return "end_turn" if finish is not None else None


# Anthropic's error types, by HTTP status.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


class AnthropicErrorDetail(Struct, kw_only=True):
    type: str
    message: str


class AnthropicError(Struct, kw_only=True, tag="error", tag_field="type"):
    """An error, as Anthropic's API answers it."""

    error: AnthropicErrorDetail


_decode_any = msgspec.json.Decoder()
_json = msgspec.json.Encoder()


def error_body(status: int, openai_body: bytes) -> bytes:
    """An OpenAI error body in Anthropic's shape."""
    try:
        doc = _decode_any.decode(openai_body)
        message = str(doc.get("error", doc).get("message", "")) if isinstance(doc, dict) else ""
    except (msgspec.DecodeError, AttributeError):
        message = ""
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return _json.encode(AnthropicError(error=AnthropicErrorDetail(type=kind, message=message)))
