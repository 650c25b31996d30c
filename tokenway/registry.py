"""The engine registry: bridges heartbeat their engines into KV `tw-engines`; owners watch it.

Entries expire one TTL after the last heartbeat; the bucket's limit markers turn expiry
into a delete that watchers see, so nobody polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import nats.errors
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from tokenway import bus
from tokenway.aio import Signal, wait_any
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

    def _prune(self) -> None:
        """Drop engines past their TTL: the delete that says so may have been lost."""
        horizon = time.time() - self.ttl
        for key in [k for k, e in self.engines.items() if e.updated < horizon]:
            self._remove(key)
        self.changed.fire()

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the bucket. Heartbeats arrive three times per TTL; a TTL of silence means
        the watch may have died with a server restart, so it is made anew. While NATS is
        away (or JetStream elects leaders), the watch is retried every TTL."""
        watcher = await self._watch()
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                if watcher is None:
                    await wait_any(stop, timeout=self.ttl)
                    self._prune()
                    watcher = await self._watch()
                    continue
                update = asyncio.ensure_future(watcher.updates(timeout=None))
                done, _ = await asyncio.wait(
                    {update, stopping}, timeout=self.ttl, return_when=asyncio.FIRST_COMPLETED
                )
                if stopping in done:
                    update.cancel()
                    break
                if not done:
                    update.cancel()
                    self._prune()
                    watcher = await self._rewatch(watcher)
                    continue
                try:
                    entry = update.result()
                except nats.errors.Error as exc:
                    log.warning("registry watch failed (%r); watching anew", exc)
                    watcher = await self._rewatch(watcher)
                    continue
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
            if watcher is not None:
                await self._stop(watcher)

    async def _watch(self) -> Any:
        """A watch of the whole bucket (its snapshot refreshes every entry), or None."""
        try:
            return await self._kv.watchall()
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("registry watch not renewed (%r); trying again in a TTL", exc)
            return None

    async def _rewatch(self, watcher: Any) -> Any:
        """A fresh watch in place of `watcher`, which is stopped only once the new one
        exists: a stopped watch yields nothing but its end marker. Without a new one,
        the old is kept (the next TTL tries again)."""
        fresh = await self._watch()
        if fresh is None:
            return watcher
        await self._stop(watcher)
        return fresh

    @staticmethod
    async def _stop(watcher: Any) -> None:
        with contextlib.suppress(nats.errors.Error):
            await watcher.stop()


async def heartbeat(
    kv: KeyValue, info: Callable[[], EngineInfo], ttl: float, stop: asyncio.Event
) -> None:
    """Refresh an engine's entry three times per TTL until `stop`, then remove it."""
    key = bus.token(info().id)
    while not stop.is_set():
        beat = info()
        beat.updated = time.time()
        try:
            await kv.put(key, _encoder.encode(beat))
        except nats.errors.Error as exc:  # NATS away for a moment: the next beat may land
            log.warning("heartbeat of %s not stored: %r", key, exc)
        await wait_any(stop, timeout=ttl / 3)
    with contextlib.suppress(nats.errors.Error):
        await kv.delete(key)
