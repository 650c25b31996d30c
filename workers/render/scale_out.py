"""vLLM's render routes' answer (`POST /v1/chat/completions/render`, `/v1/completions/render`,
`/v1/messages/render`, `/v1/responses/render`): the token-only `GenerateRequest` the request
renders to, in vLLM's JSON shape, made from the same render core that queues requests for
tokenway's own owners. As vLLM names and streams them: a Messages request's id is a chat's
(`chatcmpl-`) and its stream asks for usage on every chunk; a Responses request's id is its
body's `request_id` (else `resp_` and a fresh one, never the client's `X-Request-Id`) and it
names no stream options.

Pure: a rendered `wire.GenerateRequest` in, vLLM's objects out (one per prompt of a
completions request). Deliberately unlike vLLM 0.32: `max_tokens` is always written, where
vLLM leaves out a value equal to its default (16) and a generate server then fills the
context with output.
"""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import Struct

from tokenway.api.anthropic import MESSAGE_ID_PREFIX
from tokenway.wire import GenerateRequest, SamplingParams, StreamOptions

CHAT_PREFIX = "chatcmpl-"


class Rendered(Struct, kw_only=True):
    """vLLM's `GenerateRequest` as its render server answers it (every field written)."""

    request_id: str
    token_ids: list[int]
    token_offsets: None = None
    features: None = None
    content_parts: None = None
    sampling_params: SamplingParams
    model: str | None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: None = None
    return_token_ids: bool | None = None
    output_mode: Literal["tokens"] = "tokens"
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, object] | None = None
    ec_transfer_params: None = None


class _Named(Struct):
    model: str | None = None
    request_id: str | None = None  # a Responses request's own id


_named = msgspec.json.Decoder(_Named)
# A Messages stream's options, as vLLM's conversion to a chat request sets them
_MESSAGES_STREAM = StreamOptions(include_usage=True, continuous_usage_stats=True)


def rendered(generate: GenerateRequest, body: bytes) -> list[Rendered]:
    """One per prompt, in order (chat, Messages and Responses requests have one). `model` is
    the body's, as sent (null when it named none), as vLLM answers it."""
    named = _named.decode(body)
    model, ctx = named.model, generate.context
    base = ctx.response_id
    if ctx.api == "messages":
        base = CHAT_PREFIX + base.removeprefix(MESSAGE_ID_PREFIX)
        if generate.stream:
            generate = msgspec.structs.replace(generate, stream_options=_MESSAGES_STREAM)
    elif ctx.api == "responses":
        base = named.request_id or base
        generate = msgspec.structs.replace(generate, stream_options=None)
    if generate.prompts is None:
        return [_one(generate, base, generate.token_ids, generate.sampling_params, model)]
    return [
        _one(
            generate,
            f"{base}-{i}",
            p.token_ids,
            msgspec.structs.replace(generate.sampling_params, max_tokens=p.max_tokens),
            model,
        )
        for i, p in enumerate(generate.prompts)
    ]


def _one(
    g: GenerateRequest, rid: str, ids: list[int], params: SamplingParams, model: str | None
) -> Rendered:
    return Rendered(
        request_id=rid,
        token_ids=ids,
        sampling_params=params,
        model=model,
        reasoning_ended=g.reasoning_ended,
        return_token_ids=g.return_token_ids,
        stream=g.stream,
        stream_options=g.stream_options,
        cache_salt=g.cache_salt,
        priority=g.priority,
        kv_transfer_params=g.kv_transfer_params,
    )
