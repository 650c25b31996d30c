"""The OpenAI API: the completion routes (plain ASGI, `ingress.completions`) in front of a
FastAPI app for everything else (resume, models, health, readiness, metrics)."""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ingress.aborts import Aborts
from ingress.auth import ApiKeys, Unauthorized
from ingress.batches import add_routes as batch_routes
from ingress.body_rate import BodyRate
from ingress.completions import (
    ANTHROPIC,
    CLIENT_REQUEST_ID,
    EVENT_IDS_HEADER,
    REQUEST_ID_HEADER,
    ROUTES,
    STREAM_ID_HEADER,
    Completions,
    Receive,
    RenderBeside,
    Scope,
    Send,
    event_ids,
    header,
)
from ingress.cors import Cors
from ingress.ledger_read import LedgerRead, LedgerReader
from ingress.metrics import OTHER, Metrics
from ingress.models import Catalog
from ingress.openapi import with_completions
from ingress.responses import add_routes as response_routes
from ingress.sse_writer import SseWriter
from tokenway import bus
from tokenway.batch_store import BatchStore
from tokenway.errors import (
    InvalidRequest,
    MethodNotAllowed,
    ModelNotFound,
    TokenwayError,
    error_body,
    internal,
)
from tokenway.ledger_room import LedgerRoom
from tokenway.limits import DEFAULT_LIMITS, RequestLimits
from tokenway.output_router import OutputRouter
from tokenway.response_store import ResponseStore
from tokenway.wire import ErrorInfo

log = logging.getLogger(__name__)

_RID = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass
class IngressContext:
    nc: NATS
    router: OutputRouter
    ledger: LedgerReader
    catalog: Catalog
    request_timeout: float
    bus_retry: float
    draining: asyncio.Event
    max_request_bytes: int
    body_timeout: float
    keys: ApiKeys
    batch_store: Callable[[], Awaitable[BatchStore]]
    response_store: Callable[[], Awaitable[ResponseStore]]
    file_max_bytes: int
    cors: Cors | None = None
    request_limits: RequestLimits = DEFAULT_LIMITS  # what one request may make us build
    ledger_room: LedgerRoom | None = None  # admits new requests while TW_OUT has room
    body_rate: BodyRate = field(default_factory=lambda: BodyRate(0, 0))  # each client's pace
    # model → the render stage in this process, where the program put one beside
    render_beside: Mapping[str, RenderBeside] = field(default_factory=dict)
    aborts: Aborts | None = None  # vLLM's abort_requests


def _error(exc: TokenwayError) -> Response:
    return Response(error_body(exc.info()), status_code=exc.status, media_type="application/json")


def _answering(send: Send, metrics: Metrics, echo: tuple[bytes, bytes] | None) -> Send:
    """`send` of a route the FastAPI app serves: its answer counted (as `other`), and the
    client's X-Request-Id on it in place of any other."""

    async def answering(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            metrics.requests.labels(OTHER, message["status"]).inc()
            if echo is not None:
                kept = [(k, v) for k, v in message.get("headers", ()) if k.lower() != echo[0]]
                message["headers"] = [*kept, echo]
        await send(message)

    return answering


def create_app(ctx: IngressContext) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    metrics = Metrics(ctx.body_rate)
    completions = Completions(
        ctx.nc,
        ctx.router,
        metrics,
        ctx.catalog,
        ctx.request_timeout,
        ctx.bus_retry,
        ctx.draining,
        ctx.max_request_bytes,
        ctx.body_timeout,
        ctx.keys.limits,
        ctx.response_store,
        request_limits=ctx.request_limits,
        quota=ctx.keys.quota,
        ledger_room=ctx.ledger_room,
        body_rate=ctx.body_rate,
        render_beside=ctx.render_beside,
        aborts=ctx.aborts,
    )
    app = FastAPI(title="tokenway", version=version("tokenway"), docs_url=None, redoc_url=None)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            routes = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = with_completions(routes, _RID.pattern)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    js = ctx.nc.jetstream()

    async def streams_present() -> bool:
        try:
            for name in (bus.RENDER_STREAM, bus.OUT_STREAM):
                await js.stream_info(name)
        except (TimeoutError, NatsError):
            return False
        return True

    @app.get("/v1/streams/{rid}")
    async def resume(rid: str, request: Request) -> Response:
        """The rest of a stream after `Last-Event-ID`, read back from the ledger: for a client
        whose ingress went away. Any ingress serves it, within TW_OUT's retention."""
        try:
            after = int(request.headers.get("last-event-id", "0"))
        except ValueError:
            return _error(
                InvalidRequest("Last-Event-ID must be the number of `data:` events received")
            )
        try:
            ids = event_ids(request.headers.get(EVENT_IDS_HEADER, ""))
        except InvalidRequest as exc:
            return _error(exc)
        if not _RID.fullmatch(rid):
            return _error(InvalidRequest(f"{rid!r} is not a request id", param="rid"))
        # Another tenant's stream is as absent as one that never was.
        ledger_read = await ctx.ledger.read_from(rid, request.scope["state"]["tenant"])
        if ledger_read is None:
            return _error(
                ModelNotFound(
                    f"no stream {rid} within the output retention", code="stream_not_found"
                )
            )
        return StreamingResponse(
            resumed(ledger_read, SseWriter(ids, after)),
            media_type="text/event-stream",
            headers={
                "Cache-Control": "no-cache",
                REQUEST_ID_HEADER.decode(): rid,
                STREAM_ID_HEADER.decode(): rid,
            },
        )

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

    batch_routes(app, ctx.batch_store, ctx.file_max_bytes, ctx.keys.quota)
    response_routes(app, ctx.response_store)

    @app.get("/v1/models")
    async def models() -> Response:
        listed = {"object": "list", "data": ctx.catalog.listed()}
        return Response(msgspec.json.encode(listed), media_type="application/json")

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        try:
            card = ctx.catalog.cards[ctx.catalog.resolve(model_id)]
        except ModelNotFound as exc:
            return _error(exc)
        return Response(msgspec.json.encode(card), media_type="application/json")

    @app.get("/version")
    async def served_version() -> JSONResponse:
        return JSONResponse({"version": app.version})

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        checks = {
            "draining": ctx.draining.is_set(),
            "nats": ctx.nc.is_connected,
            "streams": await streams_present(),
            "engines": len(ctx.catalog.registry.alive()),
        }
        live = checks["nats"] and checks["streams"] and checks["engines"] > 0
        ok = live and not checks["draining"]
        return JSONResponse({"ready": ok, **checks}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_page() -> Response:
        # The process's registry, as on --metrics-port: this ingress's counts and those of
        # every stage in this process (e.g. the schedule worker's under `tokenway up`).
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """FastAPI's own 404 and 405 (no such route, a wrong method) as OpenAI error bodies."""
        what = f"{request.method} {request.url.path}"
        if exc.status_code == 405:
            info = MethodNotAllowed(f"{what} is not allowed").info()
        elif exc.status_code == 404:
            info = ModelNotFound(f"{what}: no such route", code="not_found").info()
        else:
            info = ErrorInfo(
                message=str(exc.detail), type="BadRequestError", status=exc.status_code
            )
        return Response(
            error_body(info),
            status_code=info.status,
            media_type="application/json",
            headers=exc.headers,
        )

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception) -> Response:
        """A bug: logged under the request's id, which is all its client hears of it."""
        rid = request.headers.get(REQUEST_ID_HEADER.decode()) or secrets.token_hex(12)
        log.error("%s %s failed (request %s)", request.method, request.url.path, rid, exc_info=exc)
        info = internal(rid)
        return Response(
            error_body(info),
            status_code=info.status,
            media_type="application/json",
            headers={REQUEST_ID_HEADER.decode(): rid},
        )

    async def serve(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        api = ROUTES.get(scope["path"])
        client_id = header(scope, REQUEST_ID_HEADER).decode("latin-1")
        if client_id and not CLIENT_REQUEST_ID.fullmatch(client_id):
            bad = InvalidRequest(
                f"X-Request-Id must be 1 to 128 of A-Z a-z 0-9 . _ : -, got {client_id[:160]!r}",
                param="X-Request-Id",
            )
            await completions.refuse(api, bad, send)
            return
        echo = (REQUEST_ID_HEADER, client_id.encode()) if client_id else None
        authorization = header(scope, b"authorization")
        if api in ANTHROPIC and not authorization and (key := header(scope, b"x-api-key")):
            authorization = b"Bearer " + key  # Anthropic's clients send their key so
        try:
            tenant = ctx.keys.tenant(scope["path"], authorization)
        except Unauthorized as exc:
            auth = (b"www-authenticate", b"Bearer")
            await completions.refuse(api, exc, send, *filter(None, (auth, echo)))
            return
        if api is not None:
            await completions(api, scope, receive, send, tenant, client_id)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await app(scope, receive, _answering(send, metrics, echo))

    return serve if ctx.cors is None else ctx.cors.wrap(serve)
