"""OpenAI output documents (stream chunks and full responses), shaped as vLLM 0.33 sends them.

Derender builds them; a schedule worker's fan-out combines its prompts' whole responses and
closes their stream with one usage chunk.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, Struct, UnsetType

from tokenway.parsers import is_harmony
from tokenway.wire import OutputContext

CHAT_CHUNK = "chat.completion.chunk"
CHAT = "chat.completion"
COMPLETION = "text_completion"


class Out(Struct, kw_only=True):
    """One choice's output for one chunk (or, non-streaming, for the whole response). Never
    encoded: a Struct for its C constructor, since one is made per chunk."""

    text: str = ""  # chat content, or completion text
    reasoning: str = ""
    tool_calls: list[Any] = []  # deltas, or assembled calls (each Out its own list)
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


Choice = ChatChunkChoice | CompletionChoice | ChatChoice


class Envelope(Struct, omit_defaults=True):
    """What a chat or completion document wraps its choices in (but a chat choice's role
    chunk, `RoleChunk`): a stream chunk (usage with `continuous_usage_stats` or on the
    closing chunk), or a whole response (usage always; a chat's prompt ids when asked)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


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


def _envelope(
    ctx: OutputContext,
    kind: str,
    choices: list[Choice],
    usage_: Usage | None,
    prompt_token_ids: list[int] | None = None,
) -> bytes:
    """A chat or completion document; `kind` is its `object`."""
    return _json.encode(
        Envelope(ctx.response_id, kind, ctx.created, ctx.model, choices, usage_, prompt_token_ids)
    )


def _chat_delta(index: int, out: Out) -> ChatChunkChoice:
    """A chat stream's choice, after its role chunk."""
    delta = Delta(
        content=out.text or None,
        reasoning=out.reasoning or None,
        tool_calls=out.tool_calls,
    )
    return ChatChunkChoice(
        index=index,
        delta=delta,
        logprobs=out.logprobs,
        finish_reason=out.finish_reason,
        stop_reason=UNSET if out.finish_reason is None else out.stop_reason,
        token_ids=out.token_ids,
    )


def _chat_choice(ctx: OutputContext, index: int, out: Out) -> ChatChoice:
    """A whole chat response's choice; `out.tool_calls` assembled. No content is null where
    a reasoning parser took the output, an auto call has no text or harmony's channels hold
    no answer, "" under a forced tool choice or where nothing parsed the output (as vLLM's
    chat serving builds the message)."""
    parse = ctx.parse
    if out.text or (parse is not None and parse.tool_choice in ("required", "named")):
        content: str | None = out.text
    elif out.tool_calls or (
        parse is not None
        and (
            parse.reasoning_start == "open" or is_harmony(parse.reasoning_parser, parse.tool_parser)
        )
    ):
        content = None
    else:
        content = ""
    message = ChatMessage(
        role="assistant",
        content=content,
        reasoning=out.reasoning or None,
        tool_calls=out.tool_calls,
    )
    return ChatChoice(
        index=index,
        message=message,
        logprobs=out.logprobs,
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
        token_ids=out.token_ids,
    )


def _completion_choice(index: int, out: Out) -> CompletionChoice:
    """A completion's choice, streamed or whole: the same shape."""
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
    if ctx.api == "chat":
        return _envelope(ctx, CHAT_CHUNK, [_chat_delta(index, out)], usage_)
    return _envelope(ctx, COMPLETION, [_completion_choice(index, out)], usage_)


def usage_chunk(ctx: OutputContext, completion_tokens: int) -> bytes:
    """The final `stream_options.include_usage` chunk: empty choices, usage set."""
    kind = CHAT_CHUNK if ctx.api == "chat" else COMPLETION
    return _envelope(ctx, kind, [], usage(ctx, completion_tokens))


def response(ctx: OutputContext, index: int, out: Out, completion_tokens: int) -> bytes:
    """A complete non-streaming response."""
    usage_ = usage(ctx, completion_tokens)
    if ctx.api == "chat":
        return _envelope(ctx, CHAT, [_chat_choice(ctx, index, out)], usage_, out.prompt_token_ids)
    return _envelope(ctx, COMPLETION, [_completion_choice(index, out)], usage_)


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
