"""Derender for vLLM's generate route (`/inference/v1/generate`): token deltas → vLLM's
`tokens` output mode, streamed events or the whole response. Nothing is decoded: the client
gets the engine's token IDs (the stop token included, as vLLM gives it) and logprobs by ID,
so any tokenizer-less derender (the vLLM backend's too) shapes them.

Its `stream_state` is the choice's output token count alone (for `continuous_usage_stats`).
"""

from __future__ import annotations

import msgspec
from msgspec import UNSET, Struct

from tokenway.api import generate as g
from tokenway.errors import InvalidRequest
from tokenway.wire import Derendered, DerenderEntry, OutputContext
from workers.derender.state import bounded

# a count in msgpack: a few bytes; far more is not this module's state
_MAX_STATE_BYTES = 16


class GenerateState(Struct, array_like=True):
    completion_tokens: int = 0


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(GenerateState)
_json = msgspec.json.Encoder()


def _state(raw: bytes | None) -> GenerateState:
    if raw is None:
        return GenerateState()
    state = bounded(raw, _decoder, _MAX_STATE_BYTES)
    if state.completion_tokens < 0:
        raise InvalidRequest("stream_state holds values out of range", param="stream_state")
    return state


def _usage(ctx: OutputContext, completion_tokens: int) -> g.Usage:
    """A whole response's or a continuous-usage event's (where vLLM names no cached tokens)."""
    cached = ctx.cached_tokens
    details = None if ctx.stream or cached is None else g.PromptTokensDetails(cached)
    return g.Usage(
        prompt_tokens=ctx.prompt_tokens,
        total_tokens=ctx.prompt_tokens + completion_tokens,
        completion_tokens=completion_tokens,
        prompt_tokens_details=details,
    )


def usage_event(ctx: OutputContext, completion_tokens: int) -> bytes:
    """The stream's closing `include_usage` event: no choices, null keys left out."""
    cached = ctx.cached_tokens
    closing = g.ClosingUsage(
        prompt_tokens=ctx.prompt_tokens,
        total_tokens=ctx.prompt_tokens + completion_tokens,
        completion_tokens=completion_tokens,
        prompt_tokens_details=None if cached is None else g.CachedTokens(cached),
    )
    return _json.encode(g.StreamEvent(request_id=ctx.response_id, usage=closing, choices=[]))


def derender(entry: DerenderEntry) -> Derendered:
    """One choice's delta (checked by the caller): its event, and the closing usage event
    after a single choice's last; for a request that does not stream, the whole response."""
    ctx, ids = entry.context, entry.token_ids
    state = _state(entry.state)
    state.completion_tokens += len(ids)
    done = entry.finish_reason is not None
    choice = g.TokensChoice(
        index=ctx.index_base + entry.index,
        finish_reason=entry.finish_reason,
        stop_reason=entry.stop_reason,
        token_ids=ids,
        logprobs=None if entry.logprobs is None else g.logprobs(entry.logprobs),
    )
    asked = entry.prompt_token_ids if ctx.return_token_ids and entry.state is None else None
    if not ctx.stream:
        if not done:
            raise InvalidRequest("a non-streaming derender needs the finish reason")
        whole = g.Response(
            request_id=ctx.response_id,
            model=ctx.model,
            created=ctx.created,
            usage=_usage(ctx, state.completion_tokens),
            prompt_token_ids=asked,
            choices=[choice],
        )
        return Derendered(chunks=[_json.encode(whole)])
    docs = []
    if ids or done or asked is not None:
        continuous = ctx.include_usage and ctx.continuous_usage_stats
        event = g.StreamEvent(
            request_id=ctx.response_id,
            usage=_usage(ctx, state.completion_tokens) if continuous else None,
            prompt_token_ids=UNSET if asked is None else asked,
            choices=[choice],
        )
        docs.append(_json.encode(event))
    if done and ctx.include_usage and ctx.closing_usage and ctx.n == 1:
        docs.append(usage_event(ctx, state.completion_tokens))
    return Derendered(chunks=docs, state=_encoder.encode(state))
