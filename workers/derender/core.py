"""Derender's pure core: `(state, token delta, context) -> (OpenAI documents, next state)`.

One chunk of one choice flows: token ids → text (incremental detokenizer) → stop strings →
reasoning parser → tool-call parser → logprobs → the documents of the request's API, which
its builder in `BUILDERS` shapes (a chat or completion chunk, Messages or Responses events).
Every stage keeps its memory in `StreamState`, so each chunk costs O(its own size).
Streaming and non-streaming go through the same function: a non-streaming request is one
delta holding every output token and the finish reason, and its builder makes the whole
response.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import msgspec

from tokenway.api import openai_output
from tokenway.api.openai_output import Out
from tokenway.errors import InvalidRequest, TokenwayError, internal
from tokenway.parsers import is_harmony
from tokenway.wire import (
    Api,
    Derendered,
    DerenderEntry,
    DerenderFailed,
    DerenderResult,
    FinishReason,
    LogprobEntry,
    OutputContext,
    responses_of,
)
from workers.derender import (
    generate,
    harmony,
    logprobs,
    messages,
    reasoning,
    responses,
    stops,
    tools,
)
from workers.derender import state as states
from workers.derender.detok import Detokenizer, seed
from workers.derender.state import Opened, StreamState

log = logging.getLogger(__name__)

MAX_DELTA_TOKENS = 1 << 20


def _stop_terminated(finish: str | None, stop_reason: int | str | None) -> bool:
    """EOS or a stop token ended the sequence (a stop *string* is reported as str)."""
    return finish == "stop" and not isinstance(stop_reason, str)


# The APIs whose output is a chat's: reasoning, content and tool calls.
CHATS = ("chat", "messages", "responses")


def initial_state(ctx: OutputContext) -> StreamState:
    parse = ctx.parse if ctx.api in CHATS else None
    # harmony's channels hold reasoning and calls both: one parser, not the two stages
    channels = parse is not None and is_harmony(parse.reasoning_parser, parse.tool_parser)
    staged = parse if not channels else None
    return StreamState(
        detok=seed(ctx.prompt_tail),
        stop=stops.StopState() if ctx.stop else None,
        reasoning=reasoning.start(staged.reasoning_start) if staged else None,
        tools=tools.start(staged) if staged else None,
        harmony=harmony.HarmonyState() if channels else None,
        logprobs=logprobs.LogprobState() if ctx.logprobs is not None else None,
    )


class _Ending(msgspec.Struct):  # a Struct for its C constructor: one is made per chunk
    finish: FinishReason | None
    stop_reason: int | str | None
    kept: int  # how many of the delta's tokens belong to the output


def _text_and_stops(
    ctx: OutputContext, state: StreamState, pieces: Sequence[str], ending: _Ending
) -> str:
    """Apply stop strings token by token, so the token that completes one ends the output."""
    if state.stop is None:
        text = "".join(pieces)
    else:
        out: list[str] = []
        for i, piece in enumerate(pieces):
            active = state.completion_tokens + i + 1 > ctx.min_tokens
            released, hit, state.stop = stops.step(
                ctx.stop, ctx.include_stop_str_in_output, state.stop, piece, active
            )
            out.append(released)
            if hit is not None:
                ending.finish, ending.stop_reason, ending.kept = "stop", hit, i + 1
                return "".join(out)
        text = "".join(out)
        if ending.finish is not None:
            text += stops.finish(state.stop)
    return text


def _parse(ctx: OutputContext, state: StreamState, text: str, done: bool, out: Out) -> None:
    """Split chat text into reasoning, content and tool calls."""
    parse = ctx.parse
    assert parse is not None
    content = text
    if state.harmony is not None:
        _channels(ctx, state, text, done, out)
        return
    if state.reasoning is not None:
        assert parse.reasoning_parser is not None
        thought, content, state.reasoning = reasoning.step(
            parse.reasoning_parser, state.reasoning, text
        )
        if done:
            more_thought, more_content = reasoning.finish(parse.reasoning_parser, state.reasoning)
            thought, content = thought + more_thought, content + more_content
        if parse.include_reasoning:
            out.reasoning = thought
    if state.tools is not None:
        content, calls, state.tools = tools.step(parse, state.tools, content, ctx.response_id)
        if done:
            more_content, more_calls = tools.finish(parse, state.tools, ctx.response_id)
            content, calls = content + more_content, calls + more_calls
        out.tool_calls = calls
        state.tools_called = state.tools_called or bool(calls)
    out.text = content


def _channels(ctx: OutputContext, state: StreamState, text: str, done: bool, out: Out) -> None:
    """Harmony's messages: reasoning, content and calls by channel and recipient."""
    parse = ctx.parse
    assert parse is not None and state.harmony is not None
    rid = ctx.response_id
    thought, content, calls, state.harmony = harmony.step(parse, state.harmony, text, rid)
    if done:
        more_thought, more_content, more_calls = harmony.finish(parse, state.harmony, rid)
        thought, content, calls = thought + more_thought, content + more_content, calls + more_calls
    if parse.include_reasoning:
        out.reasoning = thought
    out.tool_calls = calls
    state.tools_called = state.tools_called or bool(calls)
    out.text = content


def _check(entry: DerenderEntry) -> None:
    """Refuse an entry no owner sends: a choice out of range, too many tokens at once, or
    logprobs that are not one per token."""
    ctx, ids = entry.context, entry.token_ids
    if not 0 <= entry.index < ctx.n:
        raise InvalidRequest(f"choice {entry.index} of a request with n={ctx.n}", param="index")
    if len(ids) > MAX_DELTA_TOKENS:
        raise InvalidRequest(f"{len(ids)} tokens in one chunk, over the {MAX_DELTA_TOKENS} limit")
    if entry.logprobs is not None and len(entry.logprobs) != len(ids):
        raise InvalidRequest(
            f"{len(entry.logprobs)} logprob entries for {len(ids)} tokens", param="logprobs"
        )


def _output(
    detok: Detokenizer,
    entry: DerenderEntry,
    state: StreamState,
    text: str,
    ending: _Ending,
    prompt_ids: list[int] | None,
) -> Out:
    """What the chunk shows: a chat's text as reasoning, content and tool calls, or the text;
    the echoed prompt, logprobs and token ids where asked."""
    ctx, ids = entry.context, entry.token_ids
    out = Out(finish_reason=ending.finish, stop_reason=ending.stop_reason)
    if ctx.api in CHATS and ctx.parse is not None:
        _parse(ctx, state, text, ending.finish is not None, out)
        if out.finish_reason == "stop" and tools.rewrites_finish(ctx.parse, state.tools_called):
            out.finish_reason = "tool_calls"
    else:
        out.text = text
    if ctx.echo and prompt_ids is not None:
        echoed = detok.decode(prompt_ids, False)
        out.text = echoed + out.text
        if state.logprobs is not None:  # completion text offsets count the echoed prompt
            state.logprobs.text_offset += len(echoed)
    if state.logprobs is not None and entry.logprobs is not None:
        out.logprobs = _logprobs(detok, ctx, state, entry.logprobs[: ending.kept])
    if ctx.return_token_ids:
        out.token_ids = ids[: ending.kept]
        out.prompt_token_ids = prompt_ids
    return out


def tokens_out(entry: DerenderEntry) -> Derendered:
    """vLLM's generate route's output: token IDs, nothing decoded (any backend's)."""
    if entry.usage_total is not None:
        total = entry.usage_total
        closing = entry.context.closing_usage
        return Derendered(chunks=[generate.usage_event(entry.context, total)] if closing else [])
    _check(entry)
    return generate.derender(entry)


def derender(detok: Detokenizer, entry: DerenderEntry) -> Derendered:
    ctx = entry.context
    if ctx.api == "generate":
        return tokens_out(entry)
    if entry.usage_total is not None:
        if not ctx.closing_usage:  # a sub-stream: the fan-out owner sums usage itself
            return Derendered()
        return Derendered(chunks=[openai_output.usage_chunk(ctx, entry.usage_total)])
    _check(entry)
    ids = entry.token_ids
    first = entry.state is None
    if entry.state is None:
        state = initial_state(ctx)
    else:
        state = states.decode(entry.state, detok.vocab_size, ctx)

    # The prompt shows on the first chunk only: echoed text, and its ids when asked.
    prompt_ids = entry.prompt_token_ids if first else None
    if first and (ctx.echo or ctx.return_token_ids) and prompt_ids is None:
        raise InvalidRequest("the first chunk of this request needs its prompt_token_ids")

    ending = _Ending(entry.finish_reason, entry.stop_reason, len(ids))
    visible = ids
    if ids and _stop_terminated(ending.finish, ending.stop_reason):
        if not ctx.include_stop_str_in_output:
            visible = ids[:-1]
    # harmony's markers are special tokens, read where vLLM reads its token IDs
    skip = ctx.skip_special_tokens and state.harmony is None
    try:
        pieces, state.detok = detok.pieces(state.detok, visible, skip)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="token_ids") from exc
    text = _text_and_stops(ctx, state, pieces, ending)
    done = ending.finish is not None

    out = _output(detok, entry, state, text, ending, prompt_ids)
    state.completion_tokens += ending.kept
    state.finished = done
    if not ctx.stream:
        if not done:
            raise InvalidRequest("a non-streaming derender needs the finish reason")
        out.tool_calls = tools.merge(out.tool_calls) if out.tool_calls else []
    docs = BUILDERS[ctx.api](detok, entry, state, out, pieces[: ending.kept])
    # Derender decided the end itself (a stop string): the owner must learn it.
    ended_here = ending.finish != entry.finish_reason or ending.stop_reason != entry.stop_reason
    return Derendered(
        chunks=docs,
        state=states.encode(state),
        finish_reason=ending.finish if ended_here else None,
        stop_reason=ending.stop_reason if ended_here else None,
        kept=ending.kept if ending.kept != len(ids) else None,
    )


# One choice's documents for one chunk in its API's shape (for a request that does not
# stream, the whole response): from the entry, the state after it, its output and the texts
# of the tokens the output kept. Each updates its part of the state.
Builder = Callable[[Detokenizer, DerenderEntry, StreamState, Out, Sequence[str]], list[bytes]]


def _completion(
    detok: Detokenizer, entry: DerenderEntry, state: StreamState, out: Out, pieces: Sequence[str]
) -> list[bytes]:
    """A completion's response; streaming, its chunk when it shows anything (logprobs come
    one per token) or ends the choice, then a single choice's closing usage chunk (with
    n > 1 the owner asks for the sum). A chat's are the same in chat's shape."""
    ctx = entry.context
    index = ctx.index_base + entry.index  # global across the prompts of a request
    if not ctx.stream:
        return [openai_output.response(ctx, index, out, state.completion_tokens)]
    docs: list[bytes] = []
    done = out.finish_reason is not None
    if out.text or out.reasoning or out.tool_calls or entry.logprobs or out.token_ids or done:
        continuous = ctx.include_usage and ctx.continuous_usage_stats
        usage = (
            openai_output.usage(ctx, state.completion_tokens, final=False) if continuous else None
        )
        docs.append(openai_output.stream_chunk(ctx, index, out, usage_=usage))
    if done and ctx.include_usage and ctx.closing_usage and ctx.n == 1:
        docs.append(openai_output.usage_chunk(ctx, state.completion_tokens))
    return docs


def _chat(
    detok: Detokenizer, entry: DerenderEntry, state: StreamState, out: Out, pieces: Sequence[str]
) -> list[bytes]:
    """A completion's documents in chat's shape, each choice's stream opened by vLLM with a
    chunk of its own: the role, no output."""
    ctx = entry.context
    opening, state.role_sent = not state.role_sent, True
    if not (opening and ctx.stream):
        return _completion(detok, entry, state, out, pieces)
    continuous = ctx.include_usage and ctx.continuous_usage_stats
    none_yet = openai_output.usage(ctx, 0, final=False) if continuous else None
    index = ctx.index_base + entry.index
    role = openai_output.role_chunk(ctx, index, out.prompt_token_ids, none_yet)
    out.prompt_token_ids = None  # on the role chunk alone
    return [role, *_completion(detok, entry, state, out, pieces)]


def _messages(
    detok: Detokenizer, entry: DerenderEntry, state: StreamState, out: Out, pieces: Sequence[str]
) -> list[bytes]:
    ctx = entry.context
    if not ctx.stream:
        return [messages.message(ctx, out, state.completion_tokens)]
    events, state.opened = messages.events(
        ctx,
        out,
        state.opened or Opened(),
        not state.role_sent,
        state.completion_tokens,
        state.tools_called,
    )
    state.role_sent = True
    return events


def _responses(
    detok: Detokenizer, entry: DerenderEntry, state: StreamState, out: Out, pieces: Sequence[str]
) -> list[bytes]:
    ctx = entry.context
    if not ctx.stream:
        thought = _reasoning_tokens(ctx, pieces)
        return [responses.response(ctx, out, state.completion_tokens, thought)]
    final = _whole(detok, entry) if out.finish_reason is not None else None
    events, state.opened = responses.events(
        ctx, out, state.opened or Opened(), not state.role_sent, final
    )
    state.role_sent = True
    return events


BUILDERS: dict[Api, Builder] = {
    "chat": _chat,
    "completion": _completion,
    "messages": _messages,
    "responses": _responses,
}


def _reasoning_tokens(ctx: OutputContext, pieces: Sequence[str]) -> int:
    """How many of a whole output's tokens (their texts) are its reasoning."""
    parse = ctx.parse
    if parse is None or parse.reasoning_parser is None:
        return 0
    if is_harmony(parse.reasoning_parser, parse.tool_parser):
        return harmony.count(parse, pieces)
    return reasoning.count(parse.reasoning_parser, parse.reasoning_start, pieces)


def _whole(detok: Detokenizer, entry: DerenderEntry) -> bytes:
    """The response a request that did not stream gets, from every output token: what a
    Responses stream's closing events hold."""
    whole = DerenderEntry(
        context=msgspec.structs.replace(entry.context, stream=False),
        token_ids=[*(entry.output_ids or ()), *entry.token_ids],
        index=entry.index,
        finish_reason=entry.finish_reason,
        stop_reason=entry.stop_reason,
    )
    return derender(detok, whole).chunks[0]


def _logprobs(
    detok: Detokenizer, ctx: OutputContext, state: StreamState, entries: Sequence[LogprobEntry]
) -> logprobs.ChatLogprobs | logprobs.CompletionLogprobs:
    assert ctx.logprobs is not None and state.logprobs is not None
    if ctx.api == "chat":
        content, state.logprobs = logprobs.chat_logprobs(
            detok.texts, entries, ctx.logprobs, state.logprobs
        )
        return logprobs.ChatLogprobs(content)
    shaped, state.logprobs = logprobs.completion_logprobs(
        detok.texts, entries, ctx.logprobs, state.logprobs
    )
    return shaped


def derender_call(detok: Detokenizer, entries: Sequence[DerenderEntry]) -> list[DerenderResult]:
    """A call's entries, each on its own (one bad entry fails only itself)."""
    results: list[DerenderResult] = []
    for entry in entries:
        try:
            result: DerenderResult = derender(detok, entry)
        except TokenwayError as exc:
            result = DerenderFailed(error=exc.info())
        except Exception:  # a bug must still answer the caller
            log.exception("derendering %s failed", entry.context.response_id)
            result = DerenderFailed(error=internal(entry.context.response_id))
        results.append(result)
    return merge_choices(entries, results)


def merge_choices(
    entries: Sequence[DerenderEntry], results: list[DerenderResult]
) -> list[DerenderResult]:
    """The non-streaming choices of one response (`responses_of`: a run of its entries, not
    its id) merged into its first entry's document (the others carry none), whichever
    backend derendered them."""
    for run in responses_of(entries):
        kept = [r for r in results[run.start : run.stop] if isinstance(r, Derendered)]
        for other in kept[1:]:
            kept[0].chunks = [openai_output.merge_responses(kept[0].chunks[0], other.chunks[0])]
            other.chunks = []
    return results
