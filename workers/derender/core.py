"""Derender's pure core: `(state, token delta, context) -> (OpenAI documents, next state)`.

Streaming and non-streaming go through the same function: a non-streaming request is one
delta holding every output token and the finish reason.
"""

from __future__ import annotations

from tokenway.errors import InvalidRequest
from tokenway.wire import DerenderEntry, DerenderResult, StreamState
from workers.derender import chunks
from workers.derender.detok import Detokenizer, seed

# Bounds that keep one bad entry from costing the worker more than a normal chunk.
MAX_DELTA_TOKENS = 1 << 20
MAX_WINDOW_TOKENS = 512


def _stop_terminated(entry: DerenderEntry) -> bool:
    """EOS or a stop token ended the sequence (a stop *string* is reported as str)."""
    return entry.finish_reason == "stop" and not isinstance(entry.stop_reason, str)


def derender(detok: Detokenizer, entry: DerenderEntry) -> DerenderResult:
    ctx = entry.context
    ids = entry.token_ids
    if len(ids) > MAX_DELTA_TOKENS:
        raise InvalidRequest(f"{len(ids)} tokens in one chunk, over the {MAX_DELTA_TOKENS} limit")
    state = entry.state
    if state is None:
        state = StreamState(detok=seed(ctx.prompt_tail))
    elif state.finished:
        raise InvalidRequest("stream_state belongs to a finished stream")
    elif len(state.detok.tokens) > MAX_WINDOW_TOKENS:
        raise InvalidRequest(
            f"stream_state window of {len(state.detok.tokens)} tokens is too large"
        )

    visible = ids
    if ids and _stop_terminated(entry) and not ctx.include_stop_str_in_output:
        visible = ids[:-1]
    try:
        text, window = detok.step(state.detok, visible, ctx.skip_special_tokens)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="token_ids") from exc

    completion_tokens = state.completion_tokens + len(ids)
    finished = entry.finish_reason is not None
    next_state = StreamState(
        detok=window,
        completion_tokens=completion_tokens,
        role_sent=state.role_sent or ctx.api == "chat",
        finished=finished,
    )
    if not ctx.stream:
        if not finished:
            raise InvalidRequest("a non-streaming derender needs the finish reason")
        doc = chunks.response(
            ctx,
            text,
            finish_reason=entry.finish_reason,
            stop_reason=entry.stop_reason,
            token_ids=list(ids),
        )
        return DerenderResult(chunks=[doc], state=next_state)

    docs: list[bytes] = []
    first_chat = ctx.api == "chat" and not state.role_sent
    if text or finished or first_chat or (ctx.return_token_ids and ids):
        continuous = ctx.include_usage and ctx.continuous_usage_stats
        docs.append(
            chunks.stream_chunk(
                ctx,
                text,
                role=first_chat,
                finish_reason=entry.finish_reason,
                stop_reason=entry.stop_reason,
                token_ids=list(ids) if ctx.return_token_ids else None,
                usage_=chunks.usage(ctx, completion_tokens) if continuous else None,
            )
        )
    if finished and ctx.include_usage:
        docs.append(chunks.usage_chunk(ctx, completion_tokens))
    return DerenderResult(chunks=docs, state=next_state)
