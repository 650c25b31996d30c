"""The engine registry: bridges heartbeat their engines into KV `tw-engines`; owners watch it.

Entries expire one TTL after the last heartbeat; the bucket's limit markers turn expiry
into a delete that watchers see, so nobody polls.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from tokenway import bus
from tokenway.aio import Signal
from tokenway.wire import EngineInfo

log = logging.getLogger(__name__)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EngineInfo)


class EngineRegistry:
    """A live view of the engines serving one model."""

    def __init__(self, kv: KeyValue, model: str | None, ttl: float) -> None:
        self._kv = kv
        self.model = model
        self.ttl = ttl
        self.engines: dict[str, EngineInfo] = {}
        self.changed = Signal()
        self.on_removed: list[Callable[[str], None]] = []

    def alive(self) -> list[EngineInfo]:
        """Engines whose last heartbeat is within a TTL (a safety net under the markers)."""
        horizon = time.time() - self.ttl
        return [e for e in self.engines.values() if e.updated >= horizon]

    def _remove(self, key: str) -> None:
        if self.engines.pop(key, None) is not None:
            log.info("engine %s left the registry", key)
            for callback in self.on_removed:
                callback(key)

    async def run(self, stop: asyncio.Event) -> None:
        watcher = await self._kv.watchall()
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                update = asyncio.ensure_future(watcher.updates(timeout=None))
                await asyncio.wait({update, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if not update.done():
                    update.cancel()
                    break
                entry = update.result()
                if entry is None:  # the end of the initial snapshot
                    continue
                if entry.operation in (KV_DEL, KV_PURGE) or not entry.value:
                    self._remove(entry.key)
                else:
                    info = _decoder.decode(entry.value)
                    if self.model is None or info.model == self.model:
                        self.engines[entry.key] = info
                self.changed.fire()
        finally:
            stopping.cancel()
            await watcher.stop()


async def heartbeat(
    kv: KeyValue, info: Callable[[], EngineInfo], ttl: float, stop: asyncio.Event
) -> None:
    """Refresh an engine's entry three times per TTL until `stop`, then remove it."""
    key = bus.token(info().id)
    while not stop.is_set():
        beat = info()
        beat.updated = time.time()
        await kv.put(key, _encoder.encode(beat))
        try:
            await asyncio.wait_for(stop.wait(), ttl / 3)
        except TimeoutError:
            pass
    await kv.delete(key)
