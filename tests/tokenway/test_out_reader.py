"""A direct client's ledger reader (`tokenway.out_reader`) on a real `TW_OUT`."""

from __future__ import annotations

import uuid
from pathlib import Path

import nats
import pytest
from nats.js.api import DeliverPolicy

from tests.conftest import make_settings
from tokenway import bus
from tokenway.out_reader import Reader

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_a_reader_whose_consumer_the_server_forgot_goes_on_where_it_was(
    nats_url: str, tmp_path: Path
) -> None:
    """The consumer is gone (a restart, a disconnect past its idle time): the reader makes
    it again from the message after the last one it read, and misses none. It once failed
    on the server's 503 instead (its read, and whoever waited on it, ended there)."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await bus.provision_streams(js, make_settings(tmp_path))
    reply = f"job{uuid.uuid4().hex[:8]}"
    await js.publish(bus.out_subject(reply, "a"), b"1")
    reader = Reader(js, bus.out_subject(reply, "*"), DeliverPolicy.ALL)
    try:
        assert await reader.open() == 1
        messages = reader.messages()
        assert (await anext(messages)).data == b"1"
        forgotten = reader.name
        await js.delete_consumer(bus.OUT_STREAM, forgotten)
        await js.publish(bus.out_subject(reply, "b"), b"2")
        await js.publish(bus.out_subject(reply, "c"), b"3")
        assert [(await anext(messages)).data for _ in range(2)] == [b"2", b"3"]
        assert reader.name != forgotten
        await messages.aclose()
    finally:
        await reader.close()
        await nc.close()
