"""OpenAI output documents (stream chunks and full responses), shaped as vLLM sends them."""

from __future__ import annotations

import msgspec
from msgspec import Struct

from tokenway.wire import OutputContext


class Usage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Delta(Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(Struct, kw_only=True):
    index: int
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class CompletionChoice(Struct, kw_only=True):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class ChatChunk(Struct, kw_only=True, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # first chunk, with return_token_ids


class CompletionChunk(Struct, kw_only=True, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessage(Struct, kw_only=True):
    role: str
    content: str | None
    tool_calls: list[dict[str, object]] = []
    reasoning_content: str | None = None


class ChatChoice(Struct, kw_only=True):
    index: int
    message: ChatMessage
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatResponse(Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    prompt_token_ids: list[int] | None = None


class CompletionResponse(Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    object: str = "text_completion"


_json = msgspec.json.Encoder()

CHAT_CHUNK = "chat.completion.chunk"
COMPLETION = "text_completion"


def usage(ctx: OutputContext, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=ctx.prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=ctx.prompt_tokens + completion_tokens,
    )


def stream_chunk(
    ctx: OutputContext,
    text: str,
    *,
    role: bool,
    finish_reason: str | None,
    stop_reason: int | str | None,
    token_ids: list[int] | None,
    prompt_token_ids: list[int] | None,
    usage_: Usage | None,
) -> bytes:
    if ctx.api == "chat":
        delta = Delta(role="assistant", content=text) if role else Delta(content=text)
        choice = ChatChunkChoice(
            index=0,
            delta=delta,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            token_ids=token_ids,
        )
        return _json.encode(
            ChatChunk(
                id=ctx.response_id,
                object=CHAT_CHUNK,
                created=ctx.created,
                model=ctx.model,
                choices=[choice],
                usage=usage_,
                prompt_token_ids=prompt_token_ids,
            )
        )
    choice = CompletionChoice(
        index=0,
        text=text,
        finish_reason=finish_reason,
        stop_reason=stop_reason,
        token_ids=token_ids,
        prompt_token_ids=prompt_token_ids,
    )
    return _json.encode(
        CompletionChunk(
            id=ctx.response_id,
            object=COMPLETION,
            created=ctx.created,
            model=ctx.model,
            choices=[choice],
            usage=usage_,
        )
    )


def usage_chunk(ctx: OutputContext, completion_tokens: int) -> bytes:
    """The final `stream_options.include_usage` chunk: empty choices, usage set."""
    cls, obj = (ChatChunk, CHAT_CHUNK) if ctx.api == "chat" else (CompletionChunk, COMPLETION)
    return _json.encode(
        cls(
            id=ctx.response_id,
            object=obj,
            created=ctx.created,
            model=ctx.model,
            choices=[],
            usage=usage(ctx, completion_tokens),
        )
    )


def response(
    ctx: OutputContext,
    text: str,
    *,
    finish_reason: str | None,
    stop_reason: int | str | None,
    token_ids: list[int],
    prompt_token_ids: list[int] | None,
) -> bytes:
    """A complete non-streaming response."""
    u = usage(ctx, len(token_ids))
    ids = token_ids if ctx.return_token_ids else None
    if ctx.api == "chat":
        message = ChatMessage(role="assistant", content=text)
        choice = ChatChoice(
            index=0,
            message=message,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            token_ids=ids,
        )
        return _json.encode(
            ChatResponse(
                id=ctx.response_id,
                created=ctx.created,
                model=ctx.model,
                choices=[choice],
                usage=u,
                prompt_token_ids=prompt_token_ids,
            )
        )
    choice = CompletionChoice(
        index=0,
        text=text,
        finish_reason=finish_reason,
        stop_reason=stop_reason,
        token_ids=ids,
        prompt_token_ids=prompt_token_ids,
    )
    return _json.encode(
        CompletionResponse(
            id=ctx.response_id, created=ctx.created, model=ctx.model, choices=[choice], usage=u
        )
    )
