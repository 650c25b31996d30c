"""Derender's pure core: `(state, token delta, context) -> (OpenAI documents, next state)`.

Streaming and non-streaming go through the same function: a non-streaming request is one
delta holding every output token and the finish reason.
"""

from __future__ import annotations

from tokenway.errors import InvalidRequest
from tokenway.wire import DerenderEntry, DerenderResult
from workers.derender import chunks
from workers.derender import state as states
from workers.derender.detok import Detokenizer, seed
from workers.derender.state import StreamState

# Bounds that keep one bad entry from costing the worker more than a normal chunk.
MAX_DELTA_TOKENS = 1 << 20


def _stop_terminated(entry: DerenderEntry) -> bool:
    """EOS or a stop token ended the sequence (a stop *string* is reported as str)."""
    return entry.finish_reason == "stop" and not isinstance(entry.stop_reason, str)


def derender(detok: Detokenizer, entry: DerenderEntry) -> DerenderResult:
    ctx = entry.context
    ids = entry.token_ids
    if len(ids) > MAX_DELTA_TOKENS:
        raise InvalidRequest(f"{len(ids)} tokens in one chunk, over the {MAX_DELTA_TOKENS} limit")
    first = entry.state is None
    if entry.state is None:
        state = StreamState(detok=seed(ctx.prompt_tail))
    else:
        state = states.decode(entry.state, detok.vocab_size)

    # The prompt shows on the first chunk only: echoed text, and its ids when asked.
    prompt_ids = entry.prompt_token_ids if first else None
    if first and (ctx.echo or ctx.return_token_ids) and prompt_ids is None:
        raise InvalidRequest("the first chunk of this request needs its prompt_token_ids")
    echo = detok.decode(prompt_ids, False) if ctx.echo and prompt_ids is not None else ""
    if not ctx.return_token_ids:
        prompt_ids = None

    visible = ids
    if ids and _stop_terminated(entry) and not ctx.include_stop_str_in_output:
        visible = ids[:-1]
    try:
        text, window = detok.step(state.detok, visible, ctx.skip_special_tokens)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="token_ids") from exc
    text = echo + text

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
            prompt_token_ids=prompt_ids,
        )
        return DerenderResult(chunks=[doc], state=states.encode(next_state))

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
                prompt_token_ids=prompt_ids,
                usage_=chunks.usage(ctx, completion_tokens) if continuous else None,
            )
        )
    if finished and ctx.include_usage:
        docs.append(chunks.usage_chunk(ctx, completion_tokens))
    return DerenderResult(chunks=docs, state=states.encode(next_state))
