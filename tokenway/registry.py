"""The engine registry: bridges heartbeat their engines into KV `tw-engines`; owners watch it.

Entries expire one TTL after the last heartbeat; the bucket's limit markers turn expiry
into a delete that watchers see, so nobody polls. A bridge that stops on purpose writes a
last entry marked `leaving` before its delete, so that owners tell a stop from a loss.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any

import msgspec
import nats.errors
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from tokenway import bus
from tokenway.aio import Signal, cancel_and_wait, wait_any
from tokenway.wire import EngineInfo

log = logging.getLogger(__name__)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EngineInfo)
_told: set[tuple[float, float]] = set()  # (bucket's, configured) TTLs warned of
# Why an engine left the registry, as owners say it ("engine X left (stopped)").
STOPPED = "left (stopped)"
SILENT = "stopped heartbeating"


class EngineRegistry:
    """A live view of the engines serving some models (None: any)."""

    def __init__(self, kv: KeyValue, models: Collection[str] | None, ttl: float) -> None:
        self._kv = kv
        self.models = None if models is None else frozenset(models)
        self.ttl = ttl
        self.engines: dict[str, EngineInfo] = {}
        self.changed = Signal()
        self.on_removed: list[Callable[[str, str], None]] = []  # (engine id, STOPPED|SILENT)
        # When the bucket last answered (an update, a watch made). Heartbeats age against
        # it, not the clock: while NATS is away or elects a leader, nothing is heard from
        # any engine, which says nothing about the engines.
        self.heard = time.time()
        self._snapshot: set[str] | None = None  # keys a fresh watch's snapshot has shown

    def _horizon(self) -> float:
        return self.heard - self.ttl

    def alive(self) -> list[EngineInfo]:
        """Engines whose last heartbeat is within a TTL (a safety net under the markers)."""
        horizon = self._horizon()
        return [e for e in self.engines.values() if e.updated >= horizon]

    def _remove(self, key: str, why: str = SILENT) -> None:
        if self.engines.pop(key, None) is not None:
            log.info("engine %s %s: out of the registry", key, why)
            for callback in self.on_removed:
                callback(key, why)

    def _prune(self) -> None:
        """Drop engines past their TTL: the delete that says so may have been lost."""
        horizon = self._horizon()
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
                    await cancel_and_wait(update)
                    break
                if not done:
                    await cancel_and_wait(update)
                    self._prune()
                    watcher = await self._rewatch(watcher)
                    continue
                try:
                    entry = update.result()
                except nats.errors.Error as exc:
                    log.warning("registry watch failed (%r); watching anew", exc)
                    watcher = await self._rewatch(watcher)
                    continue
                self.heard = time.time()
                if entry is None:  # the end of a watch's snapshot: what it left out is gone
                    for key in set(self.engines) - (self._snapshot or set()):
                        self._remove(key)
                    self._snapshot = None
                    self.changed.fire()
                    continue
                if self._snapshot is not None:
                    self._snapshot.add(entry.key)
                if entry.operation in (KV_DEL, KV_PURGE) or not entry.value:
                    self._remove(entry.key)
                else:
                    info = _decoder.decode(entry.value)
                    if info.leaving:
                        self._remove(entry.key, STOPPED)
                    elif self.models is None or info.model in self.models:
                        self.engines[entry.key] = info
                self.changed.fire()
        finally:
            await cancel_and_wait(stopping)
            if watcher is not None:
                await self._stop(watcher)

    async def _watch(self) -> Any:
        """A watch of the whole bucket (its snapshot refreshes every entry), or None."""
        try:
            watcher = await self._kv.watchall()
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("registry watch not renewed (%r); trying again in a TTL", exc)
            return None
        self.heard = time.time()
        self._snapshot = set()
        return watcher

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


async def bucket_ttl(kv: KeyValue, configured: float) -> float:
    """How long an entry of `tw-engines` lives: the bucket's TTL, as whoever provisioned it
    chose. A process configured with another one follows the bucket's, and says so: beating
    by a longer TTL, an engine's entry expired between beats and its requests failed."""
    ttl = (await kv.status()).ttl
    if not ttl:
        return configured
    if ttl != configured and (ttl, configured) not in _told:
        _told.add((ttl, configured))  # once a process, not once a stage
        log.warning(
            "the engine registry bucket %s keeps entries %ss (as provisioned), not the %ss "
            "configured here: following it (delete the bucket to provision it anew)",
            bus.ENGINES_BUCKET,
            f"{ttl:g}",
            f"{configured:g}",
        )
    return ttl


async def heartbeat(
    kv: KeyValue,
    info: Callable[[], EngineInfo],
    healthy: Callable[[], Awaitable[str | None]],
    ttl: float,
    stop: asyncio.Event,
    soon: asyncio.Event | None = None,
) -> None:
    """Refresh an engine's entry three times per TTL while `healthy()` finds nothing wrong;
    while it does, the entry is gone (owners send nothing there). Removed at `stop`.

    `soon` beats before the third of a TTL is up: the engine freed room that owners would
    otherwise see only then (a full engine's aborted sequences, which a relay waits for)."""
    key = bus.token(info().id)
    was_healthy: bool | None = None  # at the last check; None before the first
    while not stop.is_set():
        problem = await healthy()
        if (problem is None) != was_healthy:
            if problem is None:
                log.info("engine %s is healthy: in the registry", key)
            else:
                log.warning("engine %s is not healthy, out of the registry: %s", key, problem)
        try:
            if problem is None:
                beat = info()
                beat.updated = time.time()
                await kv.put(key, _encoder.encode(beat))
            elif was_healthy:
                await kv.delete(key)
        except nats.errors.Error as exc:  # NATS away for a moment: the next beat may land
            log.warning("heartbeat of %s not stored: %r", key, exc)
        was_healthy = problem is None
        await wait_any(stop, *([soon] if soon is not None else []), timeout=ttl / 3)
        if soon is not None:
            soon.clear()  # what sets it again from here on is in the next beat
    with contextlib.suppress(nats.errors.Error):
        if was_healthy:  # in the registry: say it leaves on purpose, then leave
            last = info()
            last.updated, last.leaving = time.time(), True
            await kv.put(key, _encoder.encode(last))
        await kv.delete(key)
