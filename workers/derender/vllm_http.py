"""vLLM 0.33's derender routes over HTTP: a token delta + the carried state → an OpenAI chunk.

A vLLM render server answers `POST /v1/chat/completions/derender` and
`POST /v1/completions/derender`. Streaming (`stream: true`): one call per generate chunk,
carrying the chunk's tokens, the `stream_state` the last call returned, the prompt (here
its tail) and the client's original request; the answer is one OpenAI stream chunk and the
next `stream_state`. Non-streaming: the whole generate response in, a complete OpenAI
response out.

Our `stream_state` bytes hold vLLM's state JSON untouched, wrapped with the count of output
tokens derendered so far (vLLM's state does not count them; usage needs the count). vLLM's
state is not bounded (its parser path carries every output token), so a state past
`MAX_STATE_BYTES` ends the request with an error instead of being committed.

Every answer is a chunk, the request's own error (400/422: the server's message), or the
derender failure domain: `StageUnavailable` (502: unreachable, closed, 5xx, an answer we
cannot use) or `StageTimeout` (504: no whole answer within the timeout). Refused or dropped
connections and 5xx are tried again first, as the owner retries a derender worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx
import msgspec
from msgspec import Raw, Struct

from tokenway import headers as h
from tokenway.errors import InvalidRequest, StageTimeout, StageUnavailable
from tokenway.vllm_sidecar import refusal, sidecar_http, snippet
from tokenway.wire import DerenderEntry, LogprobEntry, OutputContext

log = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions/derender"
COMPLETION_PATH = "/v1/completions/derender"
_HEADERS = {"content-type": "application/json"}
# Raw state bytes whose base64 still fits the `Tw-Stream-State` header bound.
MAX_STATE_BYTES = h.MAX_STATE_BYTES * 3 // 4
_BACKOFF = 0.05  # seconds, times the try's number


# -- vLLM's request shapes (the fields we send) ----------------------------------------------


class GenLogprob(Struct, omit_defaults=True):
    token_id: int
    logprob: float
    rank: int | None = None


class GenLogprobContent(GenLogprob, omit_defaults=True):
    top_logprobs: list[GenLogprob] = []


class GenLogprobs(Struct):
    content: list[GenLogprobContent]


class GenChoice(Struct, omit_defaults=True):
    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: GenLogprobs | None = None


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class GenerateChunk(Struct, omit_defaults=True):
    """vLLM's `GenerateTokensStreamResponse` (and, with every token, its non-streaming twin)."""

    request_id: str
    choices: list[GenChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


class StreamCall(Struct, omit_defaults=True):
    """`DerenderChatStreamRequest` / `DerenderCompletionStreamRequest`."""

    stream: bool
    model: str
    generate_chunk: GenerateChunk
    prompt_tokens: int
    prompt_token_ids: list[int]
    stream_state: Raw | None = None
    chat_request: Raw | None = None
    completion_request: Raw | None = None


class ChatCall(Struct, omit_defaults=True):
    """`DerenderChatRequest`: the whole output of one choice."""

    stream: bool
    model: str
    generate_response: GenerateChunk
    prompt_tokens: int
    prompt_token_ids: list[int]
    chat_request: Raw


class CompletionCall(Struct, omit_defaults=True):
    """`DerenderCompletionRequest`: one generate response per prompt (here always one)."""

    stream: bool
    model: str
    generate_responses: list[GenerateChunk]
    prompt_tokens: list[int]
    prompt_token_ids: list[list[int]]
    completion_request: Raw


class StreamReply(Struct):
    chunk: dict[str, Any]
    stream_state: Raw


class CarriedState(Struct):
    """Our opaque `stream_state` for this backend: vLLM's JSON plus the output count."""

    tokens: int
    vllm: Raw


_json = msgspec.json.Encoder()
_stream_reply = msgspec.json.Decoder(StreamReply)
_doc = msgspec.json.Decoder(dict[str, Any])
_state = msgspec.json.Decoder(CarriedState)


# -- pure: building calls and reading answers ------------------------------------------------


def _logprobs(entries: list[LogprobEntry] | None) -> GenLogprobs | None:
    if entries is None:
        return None
    return GenLogprobs(
        [
            GenLogprobContent(
                e.token_id,
                e.logprob,
                e.rank,
                [GenLogprob(t.token_id, t.logprob, t.rank) for t in e.top],
            )
            for e in entries
        ]
    )


def usage(ctx: OutputContext, completion_tokens: int) -> Usage:
    return Usage(ctx.prompt_tokens, completion_tokens, ctx.prompt_tokens + completion_tokens)


def generate_chunk(entry: DerenderEntry, usage_: Usage | None = None) -> GenerateChunk:
    """The entry as vLLM's generate route would have streamed it (global choice index)."""
    ctx = entry.context
    choice = GenChoice(
        index=ctx.index_base + entry.index,
        token_ids=entry.token_ids,
        finish_reason=entry.finish_reason,
        stop_reason=entry.stop_reason,
        logprobs=_logprobs(entry.logprobs),
    )
    return GenerateChunk(ctx.response_id, [choice], usage_, entry.prompt_token_ids)


def usage_chunk(ctx: OutputContext, completion_tokens: int) -> GenerateChunk:
    """The generate route's closing chunk: no choices, the usage."""
    return GenerateChunk(ctx.response_id, [], usage(ctx, completion_tokens))


def _body(ctx: OutputContext) -> Raw:
    if ctx.request_body is None:  # a deployment mistake, not the client's
        raise StageUnavailable(
            "derender through vLLM needs the client's request: run render with "
            "--derender-backend vllm too"
        )
    return Raw(ctx.request_body)


def stream_call(ctx: OutputContext, chunk: GenerateChunk, state: Raw | None) -> bytes:
    body = _body(ctx)
    call = StreamCall(
        stream=True,
        model=ctx.model,
        generate_chunk=chunk,
        prompt_tokens=ctx.prompt_tokens,
        prompt_token_ids=ctx.prompt_tail,
        stream_state=state,
        chat_request=body if ctx.api == "chat" else None,
        completion_request=body if ctx.api == "completion" else None,
    )
    return _json.encode(call)


def once_call(entry: DerenderEntry) -> bytes:
    """A non-streaming call: every output token of one choice, and its finish."""
    ctx, body = entry.context, _body(entry.context)
    gen = generate_chunk(entry)
    if ctx.api == "chat":
        return _json.encode(
            ChatCall(
                stream=False,
                model=ctx.model,
                generate_response=gen,
                prompt_tokens=ctx.prompt_tokens,
                prompt_token_ids=ctx.prompt_tail,
                chat_request=body,
            )
        )
    return _json.encode(
        CompletionCall(
            stream=False,
            model=ctx.model,
            generate_responses=[gen],
            prompt_tokens=[ctx.prompt_tokens],
            prompt_token_ids=[ctx.prompt_tail],
            completion_request=body,
        )
    )


def _unusable(what: str, exc: Exception, content: bytes) -> StageUnavailable:
    return StageUnavailable(f"the derender server's {what} is unusable ({exc}): {snippet(content)}")


def document(ctx: OutputContext, doc: dict[str, Any]) -> bytes:
    """SSE-ready bytes; every document of a response gets its `created` (vLLM stamps each
    answer with its own clock)."""
    doc["created"] = ctx.created
    return _json.encode(doc)


def read_stream_reply(ctx: OutputContext, content: bytes) -> tuple[bytes | None, Raw]:
    """(the chunk, None when it shows nothing new; vLLM's next state)."""
    try:
        reply = _stream_reply.decode(content)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise _unusable("stream answer", exc, content) from exc
    return (document(ctx, reply.chunk) if shows(reply.chunk) else None), reply.stream_state


def read_response(ctx: OutputContext, content: bytes) -> bytes:
    try:
        doc = _doc.decode(content)
    except msgspec.DecodeError as exc:
        raise _unusable("response", exc, content) from exc
    if not isinstance(doc.get("choices"), list):
        raise _unusable("response", ValueError("no choices"), content)
    return document(ctx, doc)


def shows(chunk: dict[str, Any]) -> bool:
    """Whether a chunk carries anything for the client: vLLM answers every call with one,
    where the local backend sends none (the owner then holds the tokens back)."""
    if chunk.get("usage"):
        return True
    for c in chunk.get("choices") or []:
        delta = c.get("delta") or {}
        fields = (c.get("finish_reason"), c.get("logprobs"), c.get("token_ids"), c.get("text"))
        parts = ("role", "content", "reasoning", "reasoning_content", "tool_calls")
        if any(fields) or any(delta.get(k) for k in parts):
            return True
    return False


def carried(raw: bytes) -> CarriedState:
    try:
        return _state.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidRequest(
            f"stream_state is not one the vLLM derender backend made: {exc}", param="stream_state"
        ) from exc


def carry(tokens: int, vllm_state: Raw) -> bytes:
    state = _json.encode(CarriedState(tokens, vllm_state))
    if len(state) > MAX_STATE_BYTES:
        raise StageUnavailable(
            f"vLLM's stream_state grew to {len(state)} bytes, over tokenway's bound of "
            f"{MAX_STATE_BYTES} (its parser path carries the whole output); use "
            "--derender-backend local for outputs this long"
        )
    return state


# -- the shell: one pooled keep-alive client ---------------------------------------------------


class ServerFailed(StageUnavailable):
    """Refused, dropped or a 5xx: worth another try of the same call."""


class VllmDerenderClient:
    """`post` tries a call again after a `ServerFailed` (the same delta and state: derender
    is pure), `retries` times at most and only while a whole answer still fits in `budget`
    (the owner's wait for the worker's reply)."""

    def __init__(
        self, url: str, connect_timeout: float, timeout: float, retries: int, budget: float
    ) -> None:
        self.timeout = timeout
        self.retries = retries
        self.budget = budget
        self.http = sidecar_http(url, connect_timeout, timeout)

    async def post(self, ctx: OutputContext, body: bytes) -> bytes:
        """The answer's body when it is a 200; raises what the failure maps to."""
        path = CHAT_PATH if ctx.api == "chat" else COMPLETION_PATH
        give_up = time.monotonic() + self.budget - self.timeout
        for attempt in range(1, self.retries + 2):
            try:
                return await self._post(path, body)
            except ServerFailed as exc:
                pause = _BACKOFF * attempt
                if attempt > self.retries or time.monotonic() + pause > give_up:
                    raise
                log.warning(
                    "derender server failed (%s), try %d of %d", exc, attempt, self.retries + 1
                )
                await asyncio.sleep(pause)  # a server restarting
        raise AssertionError("unreachable")

    async def _post(self, path: str, body: bytes) -> bytes:
        started = time.monotonic()
        try:
            resp = await self.http.post(path, content=body, headers=_HEADERS)
        except httpx.TimeoutException as exc:
            raise StageTimeout(
                f"the derender server did not answer within {self.timeout}s "
                f"({type(exc).__name__} after {time.monotonic() - started:.1f}s)"
            ) from exc
        except httpx.TransportError as exc:
            raise ServerFailed(
                f"the derender server could not be reached: {type(exc).__name__}: {exc}"
            ) from exc
        if resp.status_code in (400, 422):
            raise refusal(resp.status_code, resp.content)
        if resp.status_code != 200:
            error = ServerFailed if resp.status_code >= 500 else StageUnavailable
            raise error(
                f"the derender server answered HTTP {resp.status_code}: {snippet(resp.content)}"
            )
        return resp.content

    async def aclose(self) -> None:
        await self.http.aclose()
