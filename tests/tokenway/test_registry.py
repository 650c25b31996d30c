"""The engine registry follows the `tw-engines` bucket through a NATS outage on a real
nats-server: its watch is renewed, never lost, and the task never dies of it."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import msgspec
import pytest

from tests.conftest import Logged, make_settings, nats_server
from tests.test_cli import free_port
from tokenway import bus
from tokenway.registry import EngineRegistry
from tokenway.wire import EngineInfo

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def _until(registry: EngineRegistry, task: asyncio.Task[None], key: str) -> None:
    """Until the registry lists `key`; fails as soon as the registry's task ends."""
    while True:
        changed = registry.changed.waiter()
        if key in registry.engines:
            return
        waiting = asyncio.ensure_future(changed.wait())
        await asyncio.wait({waiting, task}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        assert not task.done(), f"the registry stopped: {task.exception()!r}"


def _engine(engine_id: str) -> bytes:
    info = EngineInfo(id=engine_id, model="m", updated=time.time())
    return msgspec.msgpack.encode(info)


async def test_the_watch_outlives_an_outage_longer_than_the_ttl(tmp_path: Path) -> None:
    """The server is away for several TTLs, so renewing the watch fails: the engines known
    stay known meanwhile, and once it is back the registry sees new engines again (it used
    to die on the stopped watch it kept) and forgets those whose entries expired."""
    renewal_failed = Logged("registry watch not renewed")
    logging.getLogger("tokenway.registry").addHandler(renewal_failed)
    settings = make_settings(tmp_path / "data", engine_ttl=1.0)  # the bucket's TTL
    try:
        # An open bus: the registry's own reading of the bucket is what is tested, with a
        # connection that also plays the engines (which `up`'s roles split).
        async with nats_server(tmp_path / "nats", port=free_port()) as server:
            nc = await bus.connect(server.url, "test-registry")
            kv = await bus.engines_kv(nc.jetstream(), settings)
            registry = EngineRegistry(kv, None, ttl=0.5)
            stop = asyncio.Event()
            task = asyncio.create_task(registry.run(stop))
            await kv.put("before", _engine("before"))
            await _until(registry, task, "before")

            await asyncio.to_thread(server.stop)
            await renewal_failed.event.wait()
            # Not hearing from the bucket is no news of the engines: they stay.
            assert [e.id for e in registry.alive()] == ["before"]
            await server.start()

            await kv.put("after", _engine("after"))
            await asyncio.wait_for(_until(registry, task, "after"), 30)
            assert "before" not in registry.engines  # its entry expired while we were away
            stop.set()
            await task
            await nc.close()
    finally:
        logging.getLogger("tokenway.registry").removeHandler(renewal_failed)
