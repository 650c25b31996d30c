"""The OpenAI API: FastAPI routes that publish requests and stream their committed output."""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.errors import MaxPayloadError
from nats.js.errors import APIError
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)

from ingress.ledger_read import LedgerRead, LedgerReader
from ingress.router import Event, OutputRouter, Slot, SseWriter
from tokenway import bus, ledger
from tokenway.errors import (
    DeadlineExceeded,
    InvalidRequest,
    ModelNotFound,
    StageUnavailable,
    TokenwayError,
    error_body,
)
from tokenway.protocol import ChatDecoder, CompletionDecoder
from tokenway.registry import EngineRegistry
from tokenway.wire import Api, RenderRequest
from tokenway.worker import is_stream_full, overloaded

_encoder = msgspec.msgpack.Encoder()
CLIENT_CLOSED = 499  # nginx's "client closed request"
_RID = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass
class IngressContext:
    nc: NATS
    router: OutputRouter
    registry: EngineRegistry
    ledger: LedgerReader
    model: str
    model_root: str
    context_length: int
    request_timeout: float


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tokenway_requests", "Requests by API and HTTP status", ["api", "status"],
            registry=self.registry,
        )  # fmt: skip
        self.active = Gauge("tokenway_active_streams", "Open SSE streams", registry=self.registry)


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (its body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


EVENT_IDS_HEADER = "x-tokenway-event-ids"
_YES, _NO = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


def event_ids(request: Request) -> bool:
    """Whether the client asked for `id:` lines in its stream (`X-Tokenway-Event-Ids: 1`)."""
    value = request.headers.get(EVENT_IDS_HEADER, "").strip().lower()
    if value not in _YES | _NO:
        raise InvalidRequest(
            f"X-Tokenway-Event-Ids must be 1/true/yes/on or 0/false/no/off, got {value!r}"
        )
    return value in _YES


def _error(exc: TokenwayError, headers: dict[str, str] | None = None) -> Response:
    return Response(
        error_body(exc.info()),
        status_code=exc.status,
        media_type="application/json",
        headers=headers,
    )


def create_app(ctx: IngressContext) -> FastAPI:
    app = FastAPI(title="tokenway", docs_url=None, redoc_url=None)
    metrics = Metrics()
    js = ctx.nc.jetstream()

    async def submit(api: Api, body: bytes, rid: str) -> None:
        request = RenderRequest(api=api, request_id=rid, body=body, created=int(time.time()))
        deadline = time.time() + ctx.request_timeout
        try:
            await js.publish(
                bus.render_subject(ctx.model), _encoder.encode(request),
                headers=ledger.request_headers(rid, ctx.router.ingress_id, deadline),
            )  # fmt: skip
        except APIError as exc:
            if is_stream_full(exc):
                raise overloaded("render") from exc
            raise StageUnavailable(f"could not queue the request: {exc.description}") from exc
        except MaxPayloadError as exc:
            raise InvalidRequest(
                f"request body of {len(body)} bytes exceeds the bus limit "
                f"of {ctx.nc.max_payload} bytes"
            ) from exc

    async def streams_present() -> bool:
        try:
            for name in (bus.RENDER_STREAM, bus.OUT_STREAM):
                await js.stream_info(name)
        except (TimeoutError, NatsError):
            return False
        return True

    async def first_event(slot: Slot, request: Request) -> Event | None:
        """The request's first output event, or None when the client left before it."""
        answer = asyncio.ensure_future(slot.take_one())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait(
                {answer, gone}, timeout=ctx.request_timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            answer.cancel()
            gone.cancel()
        if answer.done() and not answer.cancelled():
            return answer.result()
        if gone.done() and not gone.cancelled():
            return None
        raise DeadlineExceeded(f"no answer within {ctx.request_timeout:.0f}s")

    async def handle(api: Api, request: Request) -> Response:
        body = await request.body()
        try:
            ids = event_ids(request)
        except InvalidRequest as exc:
            return _error(exc)
        try:
            req = (ChatDecoder if api == "chat" else CompletionDecoder).decode(body)
        except msgspec.ValidationError as exc:
            return _error(InvalidRequest(f"invalid request: {exc}"))
        except msgspec.DecodeError as exc:
            return _error(InvalidRequest(f"request body is not valid JSON: {exc}"))
        if req.model is not None and req.model != ctx.model:
            return _error(
                ModelNotFound(
                    f"The model `{req.model}` does not exist.",
                    param="model",
                    code="model_not_found",
                )
            )
        rid = secrets.token_hex(12)
        slot = ctx.router.open(rid)
        streaming = False
        first: Event | None = None
        try:
            await submit(api, body, rid)
            first = await first_event(slot, request)
            if first is None:
                return Response(status_code=CLIENT_CLOSED)  # nobody reads it; the cancel matters
            if first.kind == "error":
                metrics.requests.labels(api, first.status).inc()
                return Response(
                    first.payload, status_code=first.status, media_type="application/json"
                )
            if not req.stream:
                metrics.requests.labels(api, 200).inc()
                return Response(first.payload, media_type="application/json")
            streaming = True
            metrics.requests.labels(api, 200).inc()
            return StreamingResponse(
                stream(rid, slot, first, SseWriter(ids)), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": rid},
            )  # fmt: skip
        except TokenwayError as exc:
            metrics.requests.labels(api, exc.status).inc()
            headers = {"Retry-After": "1"} if exc.status == 429 else None
            return _error(exc, headers)
        finally:
            if not streaming:
                ctx.router.close(rid)
                if first is None or not first.terminal:
                    ctx.router.cancel(rid)

    async def stream(rid: str, slot: Slot, first: Event, writer: SseWriter) -> AsyncIterator[bytes]:
        metrics.active.inc()
        events, done = [first], False
        try:
            while True:
                payload, done = writer.write(events)
                yield payload
                if done:
                    return
                events = await slot.take()
        finally:
            metrics.active.dec()
            ctx.router.close(rid)
            if not done:
                ctx.router.cancel(rid)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle("chat", request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle("completion", request)

    @app.get("/v1/streams/{rid}")
    async def resume(rid: str, request: Request) -> Response:
        """The rest of a stream after `Last-Event-ID`, read back from the ledger: for a client
        whose ingress went away. Any ingress serves it, within TW_OUT's retention."""
        try:
            after = int(request.headers.get("last-event-id", "0"))
        except ValueError:
            return _error(InvalidRequest(
                "Last-Event-ID must be the number of `data:` events received"
            ))  # fmt: skip
        try:
            ids = event_ids(request)
        except InvalidRequest as exc:
            return _error(exc)
        if not _RID.fullmatch(rid):
            return _error(InvalidRequest(f"{rid!r} is not a request id", param="rid"))
        ledger_read = await ctx.ledger.read_from(rid)
        if ledger_read is None:
            return _error(ModelNotFound(f"no stream {rid} within the output retention",
                                        code="stream_not_found"))  # fmt: skip
        return StreamingResponse(
            resumed(ledger_read, SseWriter(ids, after)), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Request-Id": rid},
        )  # fmt: skip

    async def resumed(source: LedgerRead, writer: SseWriter) -> AsyncIterator[bytes]:
        metrics.active.inc()
        try:
            async for events in source.batches():
                payload, done = writer.write(events)
                if payload:
                    yield payload
                if done:
                    return
        finally:
            metrics.active.dec()
            await source.close()

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = {"id": ctx.model, "object": "model", "created": 0, "owned_by": "tokenway",
                "root": ctx.model_root, "max_model_len": ctx.context_length}  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        checks = {
            "nats": ctx.nc.is_connected,
            "streams": await streams_present(),
            "engines": len(ctx.registry.alive()),
        }
        ok = checks["nats"] and checks["streams"] and checks["engines"] > 0
        return JSONResponse({"ready": ok, **checks}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_page() -> Response:
        # This app's metrics, then the process's (stages running in this process, e.g. the
        # schedule worker's queue-wait histogram under `tokenway up`).
        page = generate_latest(metrics.registry) + generate_latest(REGISTRY)
        return Response(page, media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception) -> Response:
        return _error(TokenwayError(f"internal error: {type(exc).__name__}: {exc}"))

    return app
