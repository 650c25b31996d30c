"""Derender shell: a stateless request-reply service in a queue group on `tw.derender.<model>`."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import msgspec
from nats.aio.msg import Msg

from tokenway import bus
from tokenway.config import Settings
from tokenway.derendering import Derenderer, is_large
from tokenway.errors import too_big_for_the_bus
from tokenway.wire import DerenderCall, DerenderFailed, DerenderReply, DerenderResult, ErrorInfo
from workers.derender.backend import derender_backend

log = logging.getLogger(__name__)

_decoder = msgspec.msgpack.Decoder(DerenderCall)
_encoder = msgspec.msgpack.Encoder()


def decode(payload: bytes) -> DerenderCall | bytes:
    """The call, or the error reply to a call that is not one."""
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        return _encoder.encode(DerenderReply(error=ErrorInfo(message=f"bad derender call: {exc}")))


async def handle(backend: Derenderer, call: DerenderCall, limit: int) -> bytes:
    """One call: every entry derendered on its own, so one bad entry fails only itself; a
    reply over the bus's `limit` drops its largest results for errors until it fits."""
    results = await backend.derender(call.entries)
    for result in results:
        if isinstance(result, DerenderFailed) and result.error.status >= 500:
            log.error("derender failed: %s", result.error.message)
    reply = _encoder.encode(DerenderReply(results=results))
    if len(reply) > limit:
        reply = _encoder.encode(DerenderReply(results=_shed(results, limit)))
    return reply


_REPLY_ROOM = 4096  # what a reply holds besides its results, and then some


def _shed(results: list[DerenderResult], limit: int) -> list[DerenderResult]:
    """The results with the largest ones made errors (the client asked for more than one
    message carries) until the rest fit in `limit` bytes: no retry could answer them."""
    sizes = [len(_encoder.encode(r)) for r in results]
    total = sum(sizes) + _REPLY_ROOM
    shed = list(results)
    for i in sorted(range(len(results)), key=sizes.__getitem__, reverse=True):
        if total <= limit:
            break
        shed[i] = DerenderFailed(error=too_big_for_the_bus(sizes[i], limit).info())
        total -= sizes[i]
    return shed


class DerenderService:
    name = "derender"

    def __init__(self, settings: Settings, model_dir: Path, model: str) -> None:
        self.settings = settings
        self.started = asyncio.Event()  # it answers calls
        self.model = model
        self.backend = derender_backend(settings, model_dir)

    async def run(self, nats_url: str, stop: asyncio.Event) -> None:
        nc = await bus.connect(
            nats_url, f"tokenway-derender-{self.model}", self.settings, stop=stop
        )

        async def answer(msg: Msg, call: DerenderCall) -> None:
            await msg.respond(await handle(self.backend, call, nc.max_payload))

        async with asyncio.TaskGroup() as calls:
            # nats-py runs a subscription's callbacks one at a time: a call that waits (on a
            # server, or on a thread for a large call) runs as a task of its own, so it does
            # not hold the calls behind it.
            async def on_call(msg: Msg) -> None:
                call = decode(msg.data)
                if isinstance(call, bytes):
                    await msg.respond(call)
                elif self.backend.awaits_io or is_large(call.entries):
                    calls.create_task(answer(msg, call))
                else:
                    await answer(msg, call)

            subject = bus.derender_subject(self.model)
            sub = await nc.subscribe(subject, queue=bus.DERENDER_QUEUE, cb=on_call)
            log.info("derender serving %s (%s backend)", self.model, self.settings.derender_backend)
            self.started.set()
            await stop.wait()
            await sub.drain()  # takes what was received; the task group awaits the answers
        await bus.drain(nc)
        await self.backend.aclose()
