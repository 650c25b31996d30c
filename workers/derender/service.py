"""Derender shell: a stateless request-reply service in a queue group on `tw.derender.<model>`."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import msgspec
from nats.aio.msg import Msg
from tokenizers import Tokenizer

from tokenway import bus
from tokenway.config import Settings
from tokenway.wire import DerenderCall, DerenderReply, ErrorInfo
from workers.derender.core import derender_call
from workers.derender.detok import Detokenizer

log = logging.getLogger(__name__)

_decoder = msgspec.msgpack.Decoder(DerenderCall)
_encoder = msgspec.msgpack.Encoder()


def handle(detok: Detokenizer, payload: bytes) -> bytes:
    """One call: every entry derendered on its own, so one bad entry fails only itself."""
    try:
        call = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        return _encoder.encode(DerenderReply(error=ErrorInfo(message=f"bad derender call: {exc}")))
    results = derender_call(detok, call.entries)
    for result in results:
        if result.error is not None and result.error.status >= 500:
            log.error("derender failed: %s", result.error.message)
    return _encoder.encode(DerenderReply(results=results))


class DerenderService:
    name = "derender"

    def __init__(self, settings: Settings, model_dir: Path, model: str) -> None:
        self.settings = settings
        self.model = model
        self.detok = Detokenizer(Tokenizer.from_file(str(model_dir / "tokenizer.json")))

    async def run(self, nats_url: str, stop: asyncio.Event) -> None:
        nc = await bus.connect(nats_url, f"tokenway-derender-{self.model}")

        async def on_call(msg: Msg) -> None:
            await msg.respond(handle(self.detok, msg.data))

        await nc.subscribe(bus.derender_subject(self.model), queue=bus.DERENDER_QUEUE, cb=on_call)
        log.info("derender serving %s", self.model)
        await stop.wait()
        await nc.drain()
