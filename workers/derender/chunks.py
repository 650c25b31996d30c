"""OpenAI output documents (stream chunks and full responses), shaped as vLLM 0.33 sends them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
from msgspec import UNSET, Struct, UnsetType

from tokenway.wire import OutputContext

CHAT_CHUNK = "chat.completion.chunk"
CHAT = "chat.completion"
COMPLETION = "text_completion"


@dataclass(slots=True)
class Out:
    """One choice's output for one chunk (or, non-streaming, for the whole response)."""

    text: str = ""  # chat content, or completion text
    reasoning: str = ""
    tool_calls: list[Any] = field(default_factory=list)  # deltas, or assembled calls
    logprobs: Any = None  # already in the API's shape
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class PromptTokensDetails(Struct):
    cached_tokens: int


class Usage(Struct, kw_only=True, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # as vLLM with --enable-prompt-tokens-details: only where the engine said
    prompt_tokens_details: PromptTokensDetails | None = None


class Delta(Struct, kw_only=True, omit_defaults=True):
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[Any] = []


class ChatChunkChoice(Struct, kw_only=True):
    index: int
    delta: Delta
    logprobs: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | UnsetType | None = UNSET  # on the finishing chunk only
    token_ids: list[int] | None = None


class RoleDelta(Struct):
    role: str = "assistant"
    content: str = ""


class RoleChoice(Struct, kw_only=True):
    index: int
    delta: RoleDelta
    logprobs: None = None
    finish_reason: None = None


class RoleChunk(Struct, kw_only=True, omit_defaults=True):
    """A chat choice's first chunk, as vLLM opens each choice's stream: the role and empty
    content, nothing of the output yet; the prompt's ids (or null) on it alone."""

    id: str
    object: str
    created: int
    model: str
    choices: list[RoleChoice]
    usage: Usage | UnsetType = UNSET  # with continuous_usage_stats: no output tokens yet
    prompt_token_ids: list[int] | None
    prompt_text: None


class CompletionChoice(Struct, kw_only=True):
    index: int
    text: str
    logprobs: Any = None
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


class CompletionChunk(Struct, kw_only=True, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessage(Struct, kw_only=True, omit_defaults=True):
    role: str
    content: str | None
    reasoning: str | None = None
    tool_calls: list[Any] = []


class ChatChoice(Struct, kw_only=True):
    index: int
    message: ChatMessage
    logprobs: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatResponse(Struct, kw_only=True, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


class CompletionResponse(Struct, kw_only=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


_json = msgspec.json.Encoder()


def usage(ctx: OutputContext, completion_tokens: int, final: bool = True) -> Usage:
    """`final`: a closing usage or a whole response's, where vLLM says the cached tokens
    (never in `continuous_usage_stats` chunks)."""
    cached = ctx.cached_tokens if final else None
    return Usage(
        prompt_tokens=ctx.prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=ctx.prompt_tokens + completion_tokens,
        prompt_tokens_details=None if cached is None else PromptTokensDetails(cached),
    )


def _completion_choice(index: int, out: Out) -> CompletionChoice:
    return CompletionChoice(
        index=index,
        text=out.text,
        logprobs=out.logprobs,
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
        token_ids=out.token_ids,
        prompt_token_ids=out.prompt_token_ids,
    )


def role_chunk(
    ctx: OutputContext, index: int, prompt_token_ids: list[int] | None, usage_: Usage | None
) -> bytes:
    return _json.encode(
        RoleChunk(
            id=ctx.response_id,
            object=CHAT_CHUNK,
            created=ctx.created,
            model=ctx.model,
            choices=[RoleChoice(index=index, delta=RoleDelta())],
            usage=UNSET if usage_ is None else usage_,
            prompt_token_ids=prompt_token_ids,
            prompt_text=None,
        )
    )


def stream_chunk(ctx: OutputContext, index: int, out: Out, *, usage_: Usage | None) -> bytes:
    if ctx.api == "chat":  # after the choice's role chunk
        delta = Delta(
            content=out.text or None,
            reasoning=out.reasoning or None,
            tool_calls=out.tool_calls,
        )
        choice = ChatChunkChoice(
            index=index,
            delta=delta,
            logprobs=out.logprobs,
            finish_reason=out.finish_reason,
            stop_reason=UNSET if out.finish_reason is None else out.stop_reason,
            token_ids=out.token_ids,
        )
        return _json.encode(
            ChatChunk(
                id=ctx.response_id,
                object=CHAT_CHUNK,
                created=ctx.created,
                model=ctx.model,
                choices=[choice],
                usage=usage_,
            )
        )
    return _json.encode(
        CompletionChunk(
            id=ctx.response_id,
            object=COMPLETION,
            created=ctx.created,
            model=ctx.model,
            choices=[_completion_choice(index, out)],
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


def response(ctx: OutputContext, index: int, out: Out, completion_tokens: int) -> bytes:
    """A complete non-streaming response."""
    u = usage(ctx, completion_tokens)
    if ctx.api == "chat":
        message = ChatMessage(
            role="assistant",
            content=out.text if out.text or not out.tool_calls else None,
            reasoning=out.reasoning or None,
            tool_calls=out.tool_calls,
        )
        choice = ChatChoice(
            index=index,
            message=message,
            logprobs=out.logprobs,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            token_ids=out.token_ids,
        )
        return _json.encode(
            ChatResponse(
                id=ctx.response_id,
                object=CHAT,
                created=ctx.created,
                model=ctx.model,
                choices=[choice],
                usage=u,
                prompt_token_ids=out.prompt_token_ids,
            )
        )
    return _json.encode(
        CompletionResponse(
            id=ctx.response_id,
            object=COMPLETION,
            created=ctx.created,
            model=ctx.model,
            choices=[_completion_choice(index, out)],
            usage=u,
        )
    )


_decode_any = msgspec.json.Decoder()


def merge_responses(into: bytes, other: bytes) -> bytes:
    """One response from two holding different choices of it (n > 1, non-streaming)."""
    return combine_responses([into, other], same_prompt=True)


def combine_responses(docs: list[bytes], same_prompt: bool) -> bytes:
    """One response holding every choice of `docs`, by index, with their usage summed:
    completion tokens always, prompt tokens (and those cached, where every one says) when
    the documents answer different prompts."""
    first, *rest = [_decode_any.decode(d) for d in docs]
    usage_ = first["usage"]
    for doc in rest:
        first["choices"] += doc["choices"]
        usage_["completion_tokens"] += doc["usage"]["completion_tokens"]
        if not same_prompt:
            usage_["prompt_tokens"] += doc["usage"]["prompt_tokens"]
            _add_cached(usage_, doc["usage"].get("prompt_tokens_details"))
    first["choices"].sort(key=lambda c: c["index"])
    usage_["total_tokens"] = usage_["prompt_tokens"] + usage_["completion_tokens"]
    return _json.encode(first)


def _add_cached(usage_: dict[str, Any], details: dict[str, Any] | None) -> None:
    if "prompt_tokens_details" not in usage_:
        return
    if details is None:  # a prompt whose engine did not say: no sum to tell
        del usage_["prompt_tokens_details"]
    else:
        usage_["prompt_tokens_details"]["cached_tokens"] += details["cached_tokens"]
