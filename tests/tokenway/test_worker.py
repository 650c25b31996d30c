"""The pull-consumer shell (`tokenway.worker.consume`) on a real JetStream consumer."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import nats
import pytest
from nats.aio.msg import Msg

from tests.conftest import make_settings
from tokenway import bus
from tokenway.worker import consume

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_a_slow_message_does_not_hold_up_the_ones_behind_it(
    nats_url: str, tmp_path: Path
) -> None:
    """Rendering a huge prompt takes seconds: the requests queued behind it are fetched and
    handled meanwhile, not after it."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    settings = make_settings(tmp_path)
    await bus.provision_streams(js, settings)
    model = f"m{uuid.uuid4().hex[:8]}"
    spec = bus.render_consumer(settings, model)
    slow_started, slow_may_end, fast_done, stop = (asyncio.Event() for _ in range(4))
    ended: list[bytes] = []

    async def handle(msg: Msg) -> None:
        if msg.data == b"slow":
            slow_started.set()
            await slow_may_end.wait()
        else:
            fast_done.set()
        ended.append(msg.data)
        await msg.ack()

    worker = asyncio.create_task(consume(js, spec, handle, stop))
    try:
        await js.publish(bus.render_subject(model), b"slow")
        async with asyncio.timeout(10):
            await slow_started.wait()
        await js.publish(bus.render_subject(model), b"fast")
        async with asyncio.timeout(10):
            await fast_done.wait()
        assert ended == [b"fast"]
        slow_may_end.set()
        stop.set()
        await worker  # stopping waits for what is in hand
        assert ended == [b"fast", b"slow"]
    finally:
        slow_may_end.set()
        stop.set()
        await asyncio.gather(worker, return_exceptions=True)
        await js.delete_consumer(bus.RENDER_STREAM, spec.durable)
        await nc.close()
