"""`POST /v1/chat/completions` and `POST /v1/completions` (and `POST /tokenize` and
`/detokenize`, which a render worker answers), served as plain ASGI.

These two routes carry every request and every streamed chunk, so they skip FastAPI:
its routing, dependency solving and the middleware wrappers around every `send` were
most of the ingress's CPU per request and a third of it per chunk. Every other route stays
in the FastAPI app (`ingress.app`). A request's life here: read the body, publish it to
render, wait for its first committed event, then answer or stream what the router hands
its slot, with one task watching for the client to leave.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.errors import MaxPayloadError, NoRespondersError

from ingress.aborts import Aborts, requested
from ingress.body_rate import BodyRate
from ingress.metrics import OTHER, Metrics
from ingress.models import Catalog
from ingress.responses import Conversation, conversation, final_response
from ingress.sse_writer import SseWriter
from tokenway import bus, heap, ledger, spans, tenancy
from tokenway import headers as h
from tokenway.aio import cancel_and_wait
from tokenway.api import anthropic, generate
from tokenway.api.bodies import decode_body
from tokenway.api.openai import decoded, named_model
from tokenway.errors import (
    BodyTimeout,
    DeadlineExceeded,
    InvalidRequest,
    MethodNotAllowed,
    ModelNotFound,
    RateLimited,
    StageUnavailable,
    TokenwayError,
    TooLarge,
    Unavailable,
    error_body,
    internal,
)
from tokenway.ledger_room import LedgerRoom
from tokenway.limits import DEFAULT_LIMITS, RequestLimits, check_text
from tokenway.metrics import SSE_WRITE
from tokenway.output_router import Event, OutputRouter, Slot
from tokenway.quota import UNLIMITED, Quota
from tokenway.response_store import ResponseStore
from tokenway.tenancy import Limits
from tokenway.trace import traceparent, valid
from tokenway.wire import (
    Api,
    ErrorInfo,
    Failed,
    RenderRequest,
    TokenizeAnswer,
    TokenizeCall,
    TokenizeRoute,
)
from tokenway.worker import enqueue

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

Route = Api | TokenizeRoute | Literal["count_tokens", "abort_requests"]
ROUTES: dict[str, Route] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
    "/v1/messages/count_tokens": "count_tokens",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
    "/v1/chat/completions/render": "chat_render",
    "/v1/completions/render": "completion_render",
    "/v1/messages/render": "messages_render",
    "/v1/responses/render": "responses_render",
    "/v1/chat/completions/derender": "chat_derender",
    "/v1/completions/derender": "completion_derender",
    "/inference/v1/generate": "generate",
    "/inference/v1/abort_requests": "abort_requests",
}
ANTHROPIC: frozenset[Route] = frozenset({"messages", "count_tokens"})  # its error shapes
# A client's X-Request-Id (vLLM's habit): its response's id, echoed on every response.
CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
REQUEST_ID_HEADER = b"x-request-id"
STREAM_ID_HEADER = b"x-tokenway-stream-id"  # what `GET /v1/streams/{id}` resumes
CLIENT_CLOSED = 499  # nginx's "client closed request"
EVENT_IDS_HEADER = "x-tokenway-event-ids"
_EVENT_IDS = EVENT_IDS_HEADER.encode()
_TRACEPARENT = h.TRACEPARENT.encode()  # the bus carries W3C's header under its own name
YES, NO = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}  # event ids or not
_JSON = b"application/json"
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]
_encoder = msgspec.msgpack.Encoder()
_answers = msgspec.msgpack.Decoder(TokenizeAnswer)


def event_ids(value: str) -> bool:
    """Whether the client asked for `id:` lines in its stream (`X-Tokenway-Event-Ids: 1`)."""
    value = value.strip().lower()
    if value not in YES | NO:
        raise InvalidRequest(
            f"X-Tokenway-Event-Ids must be 1/true/yes/on or 0/false/no/off, got {value!r}"
        )
    return value in YES


@dataclass
class Reply:
    """A whole response: an answer, or an error as an OpenAI error body."""

    status: int
    body: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()

    @classmethod
    def error(cls, info: ErrorInfo, *headers: tuple[bytes, bytes]) -> Reply:
        return cls.failed(info.status, error_body(info), info.retry_after, *headers)

    @classmethod
    def failed(
        cls, status: int, body: bytes, retry_after: int = 0, *headers: tuple[bytes, bytes]
    ) -> Reply:
        """An error body; a refusal that may pass (429, 503) says when to ask again (in a
        second, unless whoever refused knows better)."""
        if status in (429, 503):
            headers += ((b"retry-after", b"%d" % (retry_after or 1)),)
        return cls(status, body, headers)

    async def send(self, send: Send) -> None:
        headers = [(b"content-length", b"%d" % len(self.body)), *self.headers]
        if self.body:
            headers.insert(0, (b"content-type", _JSON))
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": self.body})


@dataclass
class Stream:
    """A streamed answer: its first event is in hand, the rest arrive in its slot."""

    rid: str
    slot: Slot
    first: Event
    writer: SseWriter
    talk: Conversation | None = None  # a Responses request's: its response is kept at the end


async def _body(receive: Receive, limit: int) -> bytes | None:
    """The request body, or None when the client left before sending all of it;
    `TooLarge` as soon as it grows past `limit` bytes."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        part = message.get("body", b"")
        size += len(part)
        if size > limit:
            raise _too_large(limit)
        parts.append(part)
        if not message.get("more_body", False):
            return b"".join(parts)


# A body above this had the ingress decode megabytes of JSON: what that freed is given back
# to the system once the request is over (`tokenway.heap`; a few ms, off the event loop).
GIVE_BACK_ABOVE_BYTES = 1 << 20


def _too_large(limit: int) -> TooLarge:
    return TooLarge(f"the request body is over the limit of {limit} bytes")


async def _watch(receive: Receive, slot: Slot) -> None:
    """Abandons the slot when the client closes the connection (its body is already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    slot.abandon()


def header(scope: Scope, name: bytes) -> bytes:
    """A request header's value (the first, by its lower-case name); b"" when absent."""
    for key, value in scope["headers"]:
        if key == name:
            return value
    return b""


class RenderBeside(Protocol):
    """A render stage in the ingress's process (`workers.render`'s, put beside it by the
    program): what a render worker does with a request on `tw.render.*`, called directly."""

    async def submit(self, who: ledger.Identity, request: RenderRequest) -> None:
        """Rendered, admitted and queued for an owner; TokenwayError when refused."""

    async def tokenize(self, data: bytes) -> TokenizeAnswer:
        """A `TokenizeCall`'s answer."""


@dataclass
class Completions:
    nc: NATS
    router: OutputRouter
    metrics: Metrics
    catalog: Catalog
    request_timeout: float
    bus_retry: float
    draining: asyncio.Event
    max_request_bytes: int
    body_timeout: float
    limits: dict[str, Limits]  # tenant → its limits: render enforces them, across ingresses
    responses: Callable[[], Awaitable[ResponseStore]]  # stored Responses API responses
    quota: Callable[[str], Quota] = lambda tenant: UNLIMITED  # tenant → its storage quota
    # whether TW_OUT has room for more requests without losing a running one's records
    ledger_room: LedgerRoom | None = None
    # tenant → how many of its requests this ingress holds, from their queueing to their end
    running: Counter[str] = field(default_factory=Counter)
    request_limits: RequestLimits = DEFAULT_LIMITS  # what one request may make us build
    body_rate: BodyRate = field(default_factory=lambda: BodyRate(0, 0))  # each client's pace
    # model → the render stage in this process (`--render-placement ingress`); other models'
    # requests go to the render workers over the bus
    render_beside: Mapping[str, RenderBeside] = field(default_factory=dict)
    aborts: Aborts | None = None  # vLLM's abort_requests (the ingress's service makes one)

    def __post_init__(self) -> None:
        self.js = self.nc.jetstream()

    async def __call__(
        self, api: Route, scope: Scope, receive: Receive, send: Send, tenant: str, client_id: str
    ) -> None:
        """`tenant`: whose API key the request came with ("" where no key is asked for);
        `client_id`: the client's valid X-Request-Id, or ""."""
        rid = secrets.token_hex(12)
        echo = (REQUEST_ID_HEADER, (client_id or rid).encode())
        if scope["method"] != "POST":
            wrong = MethodNotAllowed(f"{scope['method']} {scope['path']} is not allowed; use POST")
            await self.refuse(api, wrong, send, (b"allow", b"POST"), echo)
            return
        client = tenant or (scope.get("client") or ("",))[0]  # whose pace the body keeps
        try:
            length = int(header(scope, b"content-length") or 0)
            if length > self.max_request_bytes:
                raise _too_large(self.max_request_bytes)  # not a byte of it read
            await self.body_rate.admit(client, length)
            async with asyncio.timeout(self.body_timeout):  # a half-sent body holds nothing
                body = await _body(receive, self.max_request_bytes)
            if not length and body:  # it did not say how long it was
                self.body_rate.charge(client, len(body))
        except TooLarge as exc:
            await self.refuse(api, exc, send, echo)
            return
        except TimeoutError:
            late = BodyTimeout(f"the request body did not arrive within {self.body_timeout:g}s")
            await self.refuse(api, late, send, (b"connection", b"close"), echo)
            return
        if body is None:
            return  # nobody to answer
        if self.draining.is_set():
            stopping = Unavailable("the server is shutting down; send the request again")
            await self.refuse(api, stopping, send, echo)
            return
        match api:  # a render worker answers these whole, nothing queued
            case (
                "tokenize"
                | "detokenize"
                | "chat_render"
                | "completion_render"
                | "messages_render"
                | "responses_render"
                | "chat_derender"
                | "completion_derender"
            ):
                answer = await self._tokenize(api, body, client_id or rid, client_id)
                await self._reply(api, answer, send, echo)
                return
        if api == "abort_requests":
            await self._reply(api, await self._abort(body, tenant), send, echo)
            return
        if api == "count_tokens":
            await self._reply(api, await self._count_tokens(body, client_id or rid), send, echo)
            return
        if self.ledger_room is not None and (full := self.ledger_room.refusal()) is not None:
            await self.refuse(api, full, send, echo)  # the running requests' records first
            return
        limits = self.limits.get(tenant)
        if limits and limits.concurrent and self.running[tenant] >= limits.concurrent:
            # Past its limit on this ingress alone: refused here, before render and the bus
            # do any work for it (render's count, across ingresses, decides the rest).
            refused = tenancy.busy(limits)
            await self.refuse(api, RateLimited(refused.why, refused.retry_after), send, echo)
            return
        self.running[tenant] += 1
        try:
            await self._run(api, scope, receive, send, body, rid, tenant, client_id, echo)
        finally:
            self.running[tenant] -= 1
            if not self.running[tenant]:
                del self.running[tenant]
        if len(body) > GIVE_BACK_ABOVE_BYTES:  # what its decoding took, returned
            del body
            await asyncio.to_thread(heap.give_back)

    async def _run(
        self,
        api: Api,
        scope: Scope,
        receive: Receive,
        send: Send,
        body: bytes,
        rid: str,
        tenant: str,
        client_id: str,
        echo: tuple[bytes, bytes],
    ) -> None:
        """A request the ingress took: queued for render, answered whole or as a stream."""
        given = header(scope, _TRACEPARENT).decode("latin-1")
        span = spans.start(f"POST {scope['path']}", valid(given), "server", request_id=rid)
        trace = span.traceparent() or traceparent(given)
        slot = self.router.open(rid)
        watcher = asyncio.ensure_future(_watch(receive, slot))
        first: Event | None = None
        streaming = False
        try:
            outcome, first = await self._answer(
                api, scope, body, rid, tenant, client_id, trace, slot
            )
            if isinstance(outcome, Stream):
                streaming = True  # the stream closes its slot itself
                self.metrics.requests.labels(api, 200).inc()
                span.set(status=200)
                await self._stream(outcome, send, echo)
            else:
                span.set(status=outcome.status)
                await self._reply(api, outcome, send, echo)
        finally:
            span.end()
            if self.aborts is not None:
                self.aborts.drop(rid)
            await cancel_and_wait(watcher)
            if not streaming:
                self.router.close(rid)
                if first is None or not first.terminal:  # the owner still works for nobody
                    self.router.cancel(rid)

    async def refuse(
        self, api: Route | None, exc: TokenwayError, send: Send, *headers: tuple[bytes, bytes]
    ) -> None:
        """Answered before the request goes anywhere, and counted like every answer (`api`:
        the route's, None for any other)."""
        await self._reply(api or OTHER, Reply.error(exc.info()), send, *headers)

    async def _reply(
        self, api: str, reply: Reply, send: Send, *headers: tuple[bytes, bytes]
    ) -> None:
        """A whole answer, counted, with `headers` added (an error in Anthropic's shape on
        its routes)."""
        self.metrics.requests.labels(api, reply.status).inc()
        if api in ANTHROPIC and reply.status >= 400 and reply.body:
            reply.body = anthropic.error_body(reply.status, reply.body)
        reply.headers += headers
        await reply.send(send)

    async def _answer(
        self,
        api: Api,
        scope: Scope,
        body: bytes,
        rid: str,
        tenant: str,
        client_id: str,
        trace: str,
        slot: Slot,
    ) -> tuple[Reply | Stream, Event | None]:
        """The whole reply, or a stream once its first event is committed; and that event."""
        first: Event | None = None
        try:
            ids = event_ids(header(scope, _EVENT_IDS).decode("latin-1"))
            talk = None
            if api == "responses":  # the conversation it continues, from the store
                check_text(api, body, self.request_limits)  # before it is decoded for that
                talk = await conversation(await self.responses(), body, tenant, self.quota(tenant))
                body = talk.body
            model, stream, named = self._decode(api, body)
            if api == "generate" and self.aborts is not None:  # abortable by its id
                self.aborts.hold(tenant, generate.request_id(client_id or named or rid), rid)
            previous = talk.previous if talk else None
            try:
                await self._submit(api, model, body, rid, tenant, client_id, trace, previous)
            except TokenwayError as exc:  # refused before it was queued: nothing to cancel
                first = ledger.error_event(rid, 1, exc.info())
                return Reply.failed(first.status, first.payload, first.retry_after), first
            first = await self._first(slot)
            if first is None:
                return Reply(CLIENT_CLOSED), None  # nobody reads it; the cancel matters
            if isinstance(first, Failed):
                return Reply.failed(first.status, first.payload, first.retry_after), first
            if not stream:
                if talk is not None:
                    await talk.keep(await self.responses(), first.payload)
                return Reply(200, first.payload), first
            return Stream(rid, slot, first, SseWriter(ids, api=api), talk), first
        except TokenwayError as exc:
            return Reply.error(exc.info()), first
        except Exception:  # a bug still answers its client
            log.exception("request %s failed", rid)
            return Reply.error(internal(rid)), first

    def _decode(self, api: Api, body: bytes) -> tuple[str, bool, str | None]:
        """Checks what the ingress checks itself; the model, whether the client asked for a
        stream, and the request id the body names."""
        if api == "generate":
            tokens = generate.decode(body)
            return self.catalog.resolve(tokens.model), bool(tokens.stream), tokens.request_id
        req = decode_body(api, body, self.request_limits)
        return self.catalog.resolve(req.model), bool(req.stream), req.request_id

    async def _submit(
        self,
        api: Api,
        model: str,
        body: bytes,
        rid: str,
        tenant: str,
        client_id: str,
        trace: str,
        previous: str | None,
    ) -> None:
        request = RenderRequest(
            api=api,
            request_id=rid,
            body=body,
            created=int(time.time()),
            client_request_id=client_id or None,
            previous_response_id=previous,
        )
        who = ledger.Identity(
            rid,
            self.router.ingress_id,
            time.time() + self.request_timeout,
            tenant,
            self.limits.get(tenant),
            trace,
        )
        beside = self.render_beside.get(model)
        if beside is not None:  # rendered, admitted and queued for an owner in process
            await beside.submit(who, request)
            return
        try:
            await enqueue(
                self.js,
                "render",
                bus.render_subject(model),
                _encoder.encode(request),
                who.headers(),
                self.bus_retry,
            )
        except MaxPayloadError as exc:
            raise self._over_the_bus(body) from exc
        except NatsError as exc:
            raise StageUnavailable(f"could not queue the request: {exc!r}") from exc

    async def _abort(self, body: bytes, tenant: str) -> Reply:
        """`POST /inference/v1/abort_requests`: the tenant's generate requests the ids name
        end with their output so far, finished "abort"; as vLLM's, answered at once with an
        empty 200, unknown and finished ids ignored."""
        assert self.aborts is not None
        try:
            ids = requested(body)
        except InvalidRequest as exc:
            return Reply.error(exc.info())
        await self.aborts.abort(tenant, ids)
        return Reply(200)

    async def _count_tokens(self, body: bytes, rid: str) -> Reply:
        """`POST /v1/messages/count_tokens`: the prompt its chat request renders to, counted
        by a render worker (`/tokenize`'s way)."""
        try:
            chat = anthropic.to_chat(decoded(anthropic.CountDecoder, body))
        except InvalidRequest as exc:
            return Reply.error(exc.info())
        tokenize = {
            "model": chat.model,
            "messages": chat.messages,
            "tools": chat.tools,
            "chat_template_kwargs": chat.chat_template_kwargs,
        }
        counted = await self._tokenize("tokenize", msgspec.json.encode(tokenize), rid)
        if counted.status != 200:
            return counted
        count = msgspec.json.decode(counted.body)["count"]
        return Reply(200, msgspec.json.encode({"input_tokens": count}))

    async def _tokenize(
        self, route: TokenizeRoute, body: bytes, rid: str, client_id: str = ""
    ) -> Reply:
        """A render worker's answer: core request/reply, nothing queued or kept (`rid`: the
        id the answer goes out under; `client_id`: the client's X-Request-Id)."""
        try:
            model = self.catalog.resolve(named_model(body))
        except ModelNotFound as exc:
            return Reply.error(exc.info())
        call = _encoder.encode(TokenizeCall(route=route, body=body, rid=rid, client_id=client_id))
        try:
            answer = await self._ask_render(model, call, body)
        except TokenwayError as exc:
            return Reply.error(exc.info())
        if answer.status != 200:
            return Reply.failed(answer.status, answer.body)
        return Reply(200, answer.body)

    async def _ask_render(self, model: str, call: bytes, body: bytes) -> TokenizeAnswer:
        """The render stage beside, or a render worker over the bus, answers `call`."""
        if (beside := self.render_beside.get(model)) is not None:
            return await beside.tokenize(call)
        try:
            msg = await self.nc.request(
                bus.tokenize_subject(model), call, timeout=self.request_timeout
            )
        except NoRespondersError:
            raise Unavailable(f"no render worker serves {model} now") from None
        except TimeoutError:
            raise DeadlineExceeded(f"no answer within {self.request_timeout:.0f}s") from None
        except MaxPayloadError:
            raise self._over_the_bus(body) from None
        except NatsError as exc:
            raise StageUnavailable(f"could not ask render: {exc!r}") from exc
        return _answers.decode(msg.data)

    def _over_the_bus(self, body: bytes) -> InvalidRequest:
        return InvalidRequest(
            f"request body of {len(body)} bytes exceeds the bus limit "
            f"of {self.nc.max_payload} bytes"
        )

    async def _first(self, slot: Slot) -> Event | None:
        """The request's first output event, or None when the client left before it."""
        try:
            async with asyncio.timeout(self.request_timeout):
                return await slot.take_one()
        except TimeoutError:
            raise DeadlineExceeded(f"no answer within {self.request_timeout:.0f}s") from None

    async def _stream(self, stream: Stream, send: Send, echo: tuple[bytes, bytes]) -> None:
        start = [*_SSE_HEADERS, echo, (STREAM_ID_HEADER, stream.rid.encode())]
        await send({"type": "http.response.start", "status": 200, "headers": start})
        self.metrics.active.inc()
        events, done = [stream.first], False
        try:
            while events:  # none: the client left
                payload, done = stream.writer.write(events)
                if done and stream.talk is not None:  # kept before its client hears the end
                    if (final := final_response(events[-1].payload)) is not None:
                        await stream.talk.keep(await self.responses(), final)
                began = time.perf_counter()
                await send({"type": "http.response.body", "body": payload, "more_body": not done})
                SSE_WRITE.observe(time.perf_counter() - began)
                if done:
                    return
                events = await stream.slot.take()
        finally:
            self.metrics.active.dec()
            self.router.close(stream.rid)
            if not done:
                self.router.cancel(stream.rid)
