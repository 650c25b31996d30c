"""vLLM's derender routes (`POST /v1/chat/completions/derender`, `/v1/completions/derender`),
answered by a render worker: vLLM's generate output (a whole response, or one streamed event
with the `stream_state` the last call answered) and the request that was rendered, turned
into the OpenAI response or chunk vLLM's render server would answer, by tokenway's own
derender core (given to the worker by the program: `Derenderer`).

The request's output context is made as render makes a request's (`RequestBuilder.
output_of`), so parsers, stop strings, logprobs and token IDs act as on tokenway's own
routes: parsers in O(delta) with a bounded state, and stop strings honoured while streaming
(vLLM 0.33 refuses them there): a chunk that meets one ends with `finish_reason: "stop"` and
the string as `stop_reason`, and the client stops generating. A streamed call answers one
chunk, as vLLM's does (tokenway's opening role chunk and content chunk merged into it).
"""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from tokenway.aio import on_big_stack
from tokenway.api import derender as d
from tokenway.api.generate import logprob_entries
from tokenway.api.openai_output import combine_responses
from tokenway.derendering import Derenderer
from tokenway.errors import InvalidRequest, TokenwayError, check_model
from tokenway.wire import (
    SEED_TOKENS,
    Api,
    Derendered,
    DerenderEntry,
    DerenderFailed,
    ErrorInfo,
    FinishReason,
    OutputContext,
    RenderRequest,
)
from workers.render.backend import worked
from workers.render.core import Renderer

# A request body standing in for a client that sent none (no parser configured: plain text)
_NO_REQUEST = b'{"messages": [{"role": "user", "content": ""}]}'
_NO_COMPLETION = b'{"prompt": " "}'
_FINISHES: Mapping[str, FinishReason] = {"repetition": "stop"}  # vLLM's; ours say stop
_json = msgspec.json.Encoder()


class Failed(TokenwayError):
    """An entry derender refused: its error, as it was (`retry_after` too)."""

    def __init__(self, failed: DerenderFailed) -> None:
        super().__init__(failed.error.message, failed.error.param, failed.error.code)
        self.error = failed.error

    def info(self) -> ErrorInfo:
        return self.error


async def answer(renderer: Renderer, derenderer: Derenderer, route: str, body: bytes) -> Any:
    """The route's answer (JSON-encodable); `TokenwayError` for the caller's mistakes."""
    if route == "chat_derender":  # a big body decodes off the event loop
        chat = await worked(len(body), d.decode_chat, body)
        check_model(chat.model, renderer.builder.model)
        return await _chat(renderer, derenderer, chat)
    completion = await worked(len(body), d.decode_completion, body)
    check_model(completion.model, renderer.builder.model)
    if isinstance(completion, d.CompletionStreamDerender):
        return await _completion_stream(renderer, derenderer, completion)
    return await _completion(renderer, derenderer, completion)


async def _context(
    renderer: Renderer, api: Api, request: dict[str, Any] | None, ids: list[int]
) -> OutputContext:
    """The output context of the request as render would make it (off the event loop: its
    constraint compiles), for a prompt of `ids`."""
    flags = renderer.builder.flags
    if request is None and api == "chat" and (flags.reasoning_parser or flags.tool_call_parser):
        raise InvalidRequest(
            "chat_request is required when a tool or reasoning parser is configured: it says "
            "how the output is parsed",
            param="chat_request",
        )
    if request is None:
        raw = _NO_REQUEST if api == "chat" else _NO_COMPLETION
    else:
        raw = _json.encode(request)
    rendered = RenderRequest(api=api, request_id="derender", body=raw, created=int(time.time()))
    builder = renderer.builder
    parsed = await on_big_stack(builder.parse, rendered)
    if flags.reasoning_parser and api == "chat" and not ids:
        raise InvalidRequest(
            "prompt_token_ids are required when a reasoning parser is configured: the prompt "
            "says whether the output begins in reasoning",
            param="prompt_token_ids",
        )
    return builder.output_of(rendered, parsed, ids, renderer.vocab)


def _shaped(
    ctx: OutputContext,
    *,
    response_id: str,
    model: str | None,
    prompt_tokens: int,
    ids: list[int],
    n: int,
    stream: bool,
    logprobs: bool,
) -> OutputContext:
    """The context for this call: the generate response's id, the prompt it counts, and
    logprobs resolved whenever the engine gave them (all its candidates where the request
    asked for none), as vLLM's derender resolves them."""
    asked = ctx.logprobs
    return msgspec.structs.replace(
        ctx,
        response_id=response_id,
        model=model or ctx.model,
        created=int(time.time()),
        prompt_tokens=prompt_tokens,
        prompt_tail=ids[-SEED_TOKENS:],
        n=max(n, 1),
        stream=stream,
        include_usage=False,  # a generate event's own usage is passed on instead
        echo=False,
        logprobs=(asked if asked is not None else -1) if logprobs else None,
    )


def _entry(
    ctx: OutputContext,
    choice: d.GenerateChoice,
    index: int,
    state: bytes | None,
    prompt: list[int],
    stream: bool,
) -> DerenderEntry:
    if not stream and not choice.token_ids:
        raise InvalidRequest(
            f"choice {choice.index} has empty or null token_ids", param="generate_response"
        )
    finish = choice.finish_reason
    return DerenderEntry(
        context=ctx,
        state=state,
        token_ids=choice.token_ids or [],
        prompt_token_ids=prompt if state is None and ctx.return_token_ids else None,
        index=index,
        logprobs=logprob_entries(choice.logprobs),
        finish_reason=_FINISHES.get(finish, finish) if finish else (None if stream else "stop"),  # type: ignore[arg-type]
        stop_reason=choice.stop_reason,
    )


async def _derendered(derenderer: Derenderer, entries: Sequence[DerenderEntry]) -> list[Derendered]:
    results = await derenderer.derender(entries)
    for result in results:
        if isinstance(result, DerenderFailed):
            raise Failed(result)
    return results  # type: ignore[return-value]


# -- whole responses ----------------------------------------------------------------------------


async def _chat(renderer: Renderer, derenderer: Derenderer, body: d.ChatDerender) -> Any:
    if body.stream:
        return await _chat_stream(renderer, derenderer, body)
    whole = body.generate_response
    if whole is None:
        raise InvalidRequest("generate_response is required", param="generate_response")
    ids = body.prompt_token_ids or whole.prompt_token_ids or []
    indexes = [c.index for c in whole.choices]
    if not indexes or len(set(indexes)) != len(indexes):
        raise InvalidRequest(
            "generate_response needs its choices, each index once", param="generate_response"
        )
    ctx = _shaped(
        await _context(renderer, "chat", body.chat_request, ids),
        response_id=whole.request_id,
        model=body.model,
        prompt_tokens=body.prompt_tokens or 0,
        ids=ids,
        n=max(indexes) + 1,
        stream=False,
        logprobs=any(c.logprobs is not None for c in whole.choices),
    )
    entries = [_entry(ctx, c, c.index, None, ids, False) for c in whole.choices]
    (first, *_) = await _derendered(derenderer, entries)
    return _with_nulls(msgspec.json.decode(first.chunks[0]), _CHAT_NULLS)


async def _completion(
    renderer: Renderer, derenderer: Derenderer, body: d.CompletionDerender
) -> Any:
    """Each response's choices numbered on from the last's, usage summed, as vLLM's."""
    responses = body.generate_responses
    if not responses:
        raise InvalidRequest("generate_responses must not be empty", param="generate_responses")
    for name in ("prompt_tokens", "prompt_token_ids"):
        given = getattr(body, name)
        if given and len(given) != len(responses):
            raise InvalidRequest(f"{name} must have one item per generate response", param=name)
    base = await _context(renderer, "completion", body.completion_request, [])
    entries: list[DerenderEntry] = []
    for i, whole in enumerate(responses):
        ids = (body.prompt_token_ids[i] if body.prompt_token_ids else None) or []
        ids = ids or whole.prompt_token_ids or []
        ctx = _shaped(
            base,
            response_id=responses[0].request_id,
            model=body.model,
            prompt_tokens=body.prompt_tokens[i] if body.prompt_tokens else 0,
            ids=ids,
            n=len(whole.choices),
            stream=False,
            logprobs=any(c.logprobs is not None for c in whole.choices),
        )
        ctx = msgspec.structs.replace(ctx, index_base=len(entries))
        entries += [_entry(ctx, c, j, None, ids, False) for j, c in enumerate(whole.choices)]
    done = await _derendered(derenderer, entries)
    docs = [r.chunks[0] for r in done if r.chunks]
    combined = msgspec.json.decode(combine_responses(docs, same_prompt=False))
    return _with_nulls(combined, _COMPLETION_NULLS)


# The keys vLLM's derender writes null where tokenway's documents leave them out: the
# response's, each choice's, and (chat) each message's
_USAGE_NULLS = ("prompt_tokens_details", "completion_tokens_details")
_CHAT_NULLS = (
    ("service_tier", "system_fingerprint", "prompt_logprobs", "prompt_token_ids",
     "prompt_text", "kv_transfer_params", "ec_transfer_params", "metrics"),
    ("routed_experts",),
    ("refusal", "annotations", "audio", "function_call", "reasoning"),
)  # fmt: skip
_COMPLETION_NULLS = (
    ("service_tier", "system_fingerprint", "kv_transfer_params", "ec_transfer_params",
     "metrics"),
    ("prompt_logprobs", "routed_experts"),
    (),
)  # fmt: skip


def _with_nulls(doc: dict[str, Any], nulls: tuple[tuple[str, ...], ...]) -> dict[str, Any]:
    top, per_choice, per_message = nulls
    for key in top:
        doc.setdefault(key, None)
    for choice in doc["choices"]:
        for key in per_choice:
            choice.setdefault(key, None)
        for key in per_message:
            choice["message"].setdefault(key, None)
    for key in _USAGE_NULLS:
        doc["usage"].setdefault(key, None)
    return doc


# -- streams ------------------------------------------------------------------------------------


def _state_in(state: d.StreamState | None) -> bytes | None:
    """tokenway's state from the carried object; a state not made here is the client's 400."""
    if state is None:
        return None
    if state.tokenway is None:
        raise InvalidRequest(
            "stream_state is not tokenway's (it has no `tokenway` key): a stream derendered "
            "here starts with stream_state null",
            param="stream_state",
        )
    try:
        return base64.b64decode(state.tokenway, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest(f"malformed stream_state: {exc}", param="stream_state") from None


def _state_out(raw: bytes | None, role_sent: bool) -> dict[str, Any]:
    """vLLM's keys (what they mean here), and tokenway's own state."""
    return {
        "prev_tokens": [],
        "prefix_offset": 0,
        "read_offset": 0,
        "role_sent": role_sent,
        "logprob_context_token_ids": [],
        "logprob_text_offset": 0,
        "output_token_ids": [],
        "output_chunk_lens": [],
        "tools_streamed": False,
        "last_tool_call_ids": [],
        "tokenway": base64.b64encode(raw or b"").decode(),
    }


def _usage(chunk: d.GenerateChunk, prompt_tokens: int | None) -> dict[str, Any] | None:
    """A generate event's usage, with the request's prompt count where the caller gave it."""
    if chunk.usage is None:
        return None
    prompt = chunk.usage.prompt_tokens if prompt_tokens is None else prompt_tokens
    done = chunk.usage.completion_tokens
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + done,
        "completion_tokens": done,
        **dict.fromkeys(_USAGE_NULLS),
    }


async def _chat_stream(renderer: Renderer, derenderer: Derenderer, body: d.ChatDerender) -> Any:
    chunk = body.generate_chunk
    if chunk is None:
        raise InvalidRequest("generate_chunk is required with stream: true", param="generate_chunk")
    ids = body.prompt_token_ids or chunk.prompt_token_ids or []
    ctx = await _context(renderer, "chat", body.chat_request, ids)
    return await _one_chunk(derenderer, body, chunk, ctx, ids, "chat.completion.chunk")


async def _completion_stream(
    renderer: Renderer, derenderer: Derenderer, body: d.CompletionStreamDerender
) -> Any:
    chunk = body.generate_chunk
    ids = body.prompt_token_ids or chunk.prompt_token_ids or []
    ctx = await _context(renderer, "completion", body.completion_request, ids)
    return await _one_chunk(derenderer, body, chunk, ctx, ids, "text_completion")


async def _one_chunk(
    derenderer: Derenderer,
    body: d.ChatDerender | d.CompletionStreamDerender,
    chunk: d.GenerateChunk,
    base: OutputContext,
    ids: list[int],
    kind: str,
) -> dict[str, Any]:
    """`{"chunk", "stream_state"}` for one generate event: one chunk, always."""
    state = _state_in(body.stream_state)
    choice = chunk.choices[0] if chunk.choices else None
    ctx = _shaped(
        base,
        response_id=chunk.request_id,
        model=body.model,
        prompt_tokens=body.prompt_tokens or 0,
        ids=ids,
        n=(choice.index + 1) if choice else 1,
        stream=True,
        logprobs=choice is not None and choice.logprobs is not None,
    )
    chat = kind == "chat.completion.chunk"
    envelope: dict[str, Any] = {
        "id": ctx.response_id,
        "object": kind,
        "created": ctx.created,
        "model": ctx.model,
        "choices": [],
        "usage": _usage(chunk, body.prompt_tokens),
        "system_fingerprint": None,
        "metrics": None,
    }
    if chat:  # a completion's prompt IDs are its choice's
        envelope |= {"prompt_token_ids": None, "prompt_text": None}
    if choice is None:  # a usage event: nothing of the output, the state as it was
        carried = body.stream_state
        kept = msgspec.to_builtins(carried) if carried is not None else _state_out(None, False)
        return {"chunk": envelope, "stream_state": kept}
    (done,) = await _derendered(derenderer, [_entry(ctx, choice, choice.index, state, ids, True)])
    docs = [msgspec.json.decode(c) for c in done.chunks]
    opened = any("role" in c.get("delta", {}) for doc in docs for c in doc["choices"])
    merged = _merged(kind, choice.index, docs)
    if chat:  # vLLM names the role on a choice's first chunk, and null after
        merged["delta"] = {"role": "assistant" if opened else None, **merged["delta"]}
    prompt = next((doc["prompt_token_ids"] for doc in docs if doc.get("prompt_token_ids")), None)
    if chat:
        envelope["prompt_token_ids"] = prompt
    else:
        merged["prompt_token_ids"] = prompt
    envelope["choices"] = [merged]
    role_sent = opened or (body.stream_state is not None and body.stream_state.role_sent)
    return {"chunk": envelope, "stream_state": _state_out(done.state, role_sent)}


def _merged(kind: str, index: int, docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One choice of a chunk from what derender answered for the event (none or several)."""
    choices = [c for doc in docs for c in doc["choices"]]
    last = choices[-1] if choices else {}
    token_ids = [t for c in choices for t in c.get("token_ids") or []]
    merged: dict[str, Any] = {
        "index": index,
        "logprobs": _logprobs(kind, [c.get("logprobs") for c in choices]),
        "finish_reason": last.get("finish_reason"),
        "stop_reason": last.get("stop_reason"),
        "token_ids": token_ids or None,
    }
    if kind == "text_completion":
        merged["text"] = "".join(c["text"] for c in choices)
        return merged
    deltas = [c["delta"] for c in choices]
    content = "".join(dl.get("content") or "" for dl in deltas)
    reasoning = "".join(dl.get("reasoning") or "" for dl in deltas)
    delta: dict[str, Any] = {"content": content or None, "reasoning": reasoning or None}
    calls: list[dict[str, Any]] = []
    for dl in deltas:
        for call in dl.get("tool_calls") or []:
            _merge_call(calls, call)
    if calls:
        delta["tool_calls"] = calls
    merged["delta"] = delta
    return merged


def _merge_call(calls: list[dict[str, Any]], call: dict[str, Any]) -> None:
    """A tool call's delta joined to the same call's earlier one in this chunk."""
    same = next((c for c in calls if c["index"] == call["index"]), None)
    if same is None:
        calls.append(call)
        return
    piece = call.get("function", {}).get("arguments") or ""
    function = same.setdefault("function", {})
    function["arguments"] = (function.get("arguments") or "") + piece


def _logprobs(kind: str, each: list[Any]) -> Any:
    """The chunk's logprobs: its pieces' joined (chat: `content` lists; completions: each
    list of the four)."""
    given = [lp for lp in each if lp]
    if not given:
        return None
    if kind == "chat.completion.chunk":
        return {"content": [c for lp in given for c in lp.get("content") or []]}
    keys = ("text_offset", "token_logprobs", "tokens", "top_logprobs")
    return {k: [v for lp in given for v in lp.get(k) or []] for k in keys}
