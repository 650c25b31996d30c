"""Render shell: drains `tw.render.<model>` (and, while that is empty, the batch lanes
`tw.render.<model>.batch.<lane>`), publishes tokenized requests to `tw.sched.<model>` (a
batch job's to the shared batch lane, with its tenant); answers `/tokenize` calls on
`tw.tokenize.<model>`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import MaxPayloadError
from nats.js import JetStreamContext

from tokenway import bus, ledger, metrics, spans
from tokenway.config import Settings
from tokenway.derendering import Derenderer
from tokenway.errors import (
    DeadlineExceeded,
    InvalidRequest,
    Overloaded,
    RateLimited,
    TokenwayError,
    internal,
    too_big_for_the_bus,
)
from tokenway.model import ModelInfo
from tokenway.parsers import ParserFlags
from tokenway.tenant_book import TenantBook
from tokenway.wire import ErrorInfo, GenerateRequest, RenderRequest, TokenizeAnswer
from tokenway.worker import Behind, consume, enqueue
from workers.render import tokenize
from workers.render.backend import render_backend
from workers.render.sampling import least_response_bytes, tokens_charged

log = logging.getLogger(__name__)

_decoder = msgspec.msgpack.Decoder(RenderRequest)
_encoder = msgspec.msgpack.Encoder()
_ROOM_BACKOFF, _MAX_ROOM_BACKOFF = 0.05, 2.0  # seconds between tries at a full queue
# APIs whose output only tokenway's own derender shapes (as a chat's, run apart)
_OWN_SHAPES = ("messages", "responses")
_BATCH_SLOTS = 24  # of the 32 requests a worker has in hand


class RenderService:
    name = "render"

    def __init__(
        self,
        settings: Settings,
        model: ModelInfo,
        served_model_name: str,
        flags: ParserFlags,
        derenderer: Callable[[], Derenderer] | None = None,
    ) -> None:
        """`derenderer`: makes what answers vLLM's derender routes (tokenway's own core, made
        on the first such call: it loads a tokenizer of its own)."""
        self.settings = settings
        self.started = asyncio.Event()  # it takes requests
        self.model = served_model_name
        self.backend = render_backend(settings, model, served_model_name, flags)
        self.max_payload = 0  # the server's, known once connected
        self.nc: NATS | None = None
        self.js: JetStreamContext | None = None
        self.book: TenantBook | None = None
        self._make_derenderer = derenderer
        self._derenderer: Derenderer | None = None
        self._making = asyncio.Lock()  # two first calls make one

    async def run(self, nats_url: str, stop: asyncio.Event) -> None:
        nc = self.nc = await bus.connect(
            nats_url, f"tokenway-render-{self.model}", self.settings, stop=stop
        )
        self.max_payload = nc.max_payload
        js = self.js = nc.jetstream()
        self.book = TenantBook(await bus.tenants_kv(js, self.settings))
        spec = bus.render_consumer(self.settings, self.model)
        # A batch job's requests (which may wait out a full schedule queue in hand) take
        # at most this many of the worker's slots: interactive ones always find some.
        batch = Behind(
            bus.render_consumer(self.settings, self.model, batch=True), lambda: _BATCH_SLOTS
        )
        log.info("render serving %s (%s backend)", self.model, self.settings.render_backend)
        try:
            async with asyncio.TaskGroup() as calls:

                async def on_call(msg: Msg) -> None:
                    # a task each: nats-py runs a subscription's callbacks one at a time
                    calls.create_task(self._tokenize(msg))

                subject = bus.tokenize_subject(self.model)
                sub = await nc.subscribe(subject, queue=bus.RENDER_QUEUE, cb=on_call)
                self.started.set()
                try:
                    await consume(js, spec, lambda msg: self.handle(js, msg), stop, behind=batch)
                finally:
                    await sub.drain()  # takes what was received; the group awaits its answers
        finally:
            await self.backend.aclose()
            if self._derenderer is not None:
                await self._derenderer.aclose()
        await bus.drain(nc)

    async def _tokenize(self, msg: Msg) -> None:
        answered = await self.tokenize(msg.data)
        try:
            await msg.respond(_encoder.encode(answered))
        except NatsError as exc:  # no reply subject, or the connection went: nobody to tell
            log.warning("a tokenize answer could not be sent: %r", exc)

    async def handle(self, js: JetStreamContext, msg: Msg) -> None:
        try:
            who = ledger.Identity.of(msg)
        except (KeyError, ValueError) as exc:
            why = f"no valid request headers: {ledger.what_is_wrong(exc)}"
            await ledger.dead_letter(js, "render", msg, "decode", why)
            return
        try:
            request = _decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            reason = f"undecodable render request: {exc}"
            await self._fail(who, InvalidRequest(reason).info())
            await ledger.dead_letter(js, "render", msg, "decode", reason)
            return
        try:
            await self.submit(who, request, msg)
        except TokenwayError as exc:
            await self._fail(who, exc.info())
        except Exception:  # a bug: the client still hears about it
            log.exception("render failed for %s", who.rid)
            await self._fail(who, internal(who.rid))
        await msg.ack()

    async def submit(
        self, who: ledger.Identity, request: RenderRequest, msg: Msg | None = None
    ) -> None:
        """Render one request, admit it under its tenant's limits and queue it for an owner:
        for a message on `tw.render.*` (`msg`, held while a batch job waits for room) and for
        an ingress that renders beside itself (`--render-placement ingress`), which answers
        its client with the TokenwayError this raises."""
        await self.started.wait()  # connected: the ingress beside may take a request first
        assert self.js is not None
        began = time.perf_counter()
        span = spans.start("render", who.trace or None, request_id=who.rid, model=self.model)
        try:
            if who.deadline is not None and time.time() > who.deadline:
                raise DeadlineExceeded("the request's deadline passed before it was rendered")
            if self.settings.derender_backend == "vllm" and request.api in _OWN_SHAPES:
                raise InvalidRequest(
                    f"the {request.api} API is derendered by tokenway itself: "
                    "run derender with --derender-backend local"
                )
            generate = await self.backend.render(request)
            if self.settings.derender_backend == "vllm" and request.api != "generate":
                generate.context = msgspec.structs.replace(
                    generate.context, request_body=request.body
                )
            if who.limits:
                await self._admit(who, generate)
            try:
                await self._forward_when_room(self.js, msg, who, generate)
            except BaseException:
                if who.limits:  # it never ran: its slot is free again
                    await self._tenants().release(who.tenant, who.rid)
                raise
        except BaseException as exc:
            span.end(exc.message if isinstance(exc, TokenwayError) else repr(exc))
            raise
        metrics.RENDER.observe(time.perf_counter() - began)
        span.set(prompt_tokens=len(generate.token_ids))
        span.end()

    async def tokenize(self, data: bytes) -> TokenizeAnswer:
        """A `TokenizeCall`'s answer (`/tokenize`, `/detokenize`, vLLM's render and derender
        routes), errors included."""
        renderer = await self.backend.local()
        derenderer = self._derenderer_made if self._make_derenderer is not None else None
        return await tokenize.answer(renderer, data, self.max_payload, derenderer)

    async def _derenderer_made(self) -> Derenderer:
        """Made on the first derender call, off the event loop (it loads a tokenizer)."""
        assert self._make_derenderer is not None
        async with self._making:
            if self._derenderer is None:
                self._derenderer = await asyncio.to_thread(self._make_derenderer)
        return self._derenderer

    def _tenants(self) -> TenantBook:
        assert self.book is not None
        return self.book

    async def _admit(self, who: ledger.Identity, generate: GenerateRequest) -> None:
        """The tenant's limits, on what the request really costs: a 429 (or a 400 for a
        request its limits never allow) before it is queued for an engine."""
        assert who.limits
        until = who.deadline or time.time() + self.settings.request_timeout
        refused = await self._tenants().admit(
            who.tenant, who.limits, who.rid, tokens_charged(generate), until
        )
        if refused is None:
            return
        if not refused.retry_after:
            raise InvalidRequest(refused.why, param="max_tokens")
        raise RateLimited(refused.why, refused.retry_after)

    async def _fail(self, who: ledger.Identity, info: ErrorInfo) -> None:
        assert self.nc is not None  # requests fail once they come, after the connect
        await ledger.publish_error(self.nc, who.reply, who.rid, info, tenant=who.tenant)

    async def _forward_when_room(
        self,
        js: JetStreamContext,
        msg: Msg | None,
        who: ledger.Identity,
        generate: GenerateRequest,
    ) -> None:
        """Forward; a batch job's request (`Tw-Batch`, on the bus: `msg`) waits out a full
        schedule queue, holding its render message (and this worker's slot) meanwhile, so
        the pressure reaches the render queue and the job's own publishes."""
        wait = _ROOM_BACKOFF
        while True:
            try:
                return await self._forward(js, who, generate)
            except Overloaded:
                late = who.deadline is not None and time.time() > who.deadline
                if msg is None or not who.batch or late:
                    raise
            if wait == _ROOM_BACKOFF:
                log.info("request %s waits for room in the schedule queue", who.rid)
            await msg.in_progress()
            await asyncio.sleep(wait)  # the schedulers drain their queue meanwhile
            wait = min(wait * 2, _MAX_ROOM_BACKOFF)

    async def _forward(
        self,
        js: JetStreamContext,
        who: ledger.Identity,
        generate: GenerateRequest,
    ) -> None:
        if not generate.context.stream:  # a whole response travels as one message
            least = least_response_bytes(generate)
            if least > self.max_payload:
                raise too_big_for_the_bus(least, self.max_payload, at_least=True)
        payload = _encoder.encode(generate)
        try:
            await enqueue(
                js,
                "schedule",
                bus.sched_subject(self.model, who.batch),
                payload,
                who.headers(),
                self.settings.bus_retry,
            )
        except MaxPayloadError as exc:
            raise InvalidRequest(
                f"the tokenized request ({len(generate.token_ids)} tokens, {len(payload)} bytes) "
                f"exceeds the bus payload limit of {self.max_payload} bytes"
            ) from exc
