"""The output router (an ingress's) on a real bus: what its subscription misses is read back.

Deliveries are core NATS, so a reconnect can lose some of them. The loss is caused for real
here: the router's subscription is removed while the owner's chunks are stored.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client as NATS

from tests.conftest import make_settings
from tokenway import bus, ledger
from tokenway import headers as h
from tokenway.output_router import OutputRouter
from tokenway.wire import OUTPUTS

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest_asyncio.fixture(loop_scope="session")
async def routed(nats_url: str, tmp_path: Path) -> AsyncIterator[tuple[NATS, str, OutputRouter]]:
    """A connection, an ingress id of its own and its router, started (stopped after)."""
    nc = await nats.connect(nats_url)
    await bus.provision_streams(nc.jetstream(), make_settings(tmp_path))
    ingress = f"i{uuid.uuid4().hex[:8]}"
    router = OutputRouter(nc, ingress)
    await router.start()
    try:
        yield nc, ingress, router
    finally:
        await router.stop()
        await nc.close()


async def test_output_missed_while_unsubscribed_is_read_back_in_order(
    routed: tuple[NATS, str, OutputRouter],
) -> None:
    nc, ingress, router = routed
    rid = uuid.uuid4().hex
    slot = router.open(rid)

    async def commit(seq: int, kind: str = h.KIND_CHUNK) -> None:
        event = OUTPUTS[kind](rid=rid, seq=seq, payload=f"chunk {seq}".encode())
        await ledger.commit(nc, ingress, rid, [event])

    async def taken(count: int) -> list[int]:
        seqs: list[int] = []
        async with asyncio.timeout(10):
            while len(seqs) < count:
                seqs += [e.seq for e in await slot.take()]
        return seqs

    try:
        await commit(1)
        assert await taken(1) == [1]
        assert router._sub is not None
        await router._sub.unsubscribe()  # NATS away for this process: 2 and 3 never arrive
        await commit(2)
        await commit(3)
        await router.start()
        await commit(4)  # the gap before it is read back from the ledger first
        assert await taken(3) == [2, 3, 4]
        await router._sub.unsubscribe()
        await commit(5, h.KIND_END)  # the end, lost: no later message will show the gap
        await router.start()
        await router.reconnected()
        async with asyncio.timeout(10):
            [end] = await slot.take()
        assert (end.seq, end.kind, end.payload) == (5, h.KIND_END, b"chunk 5")
    finally:
        router.close(rid)


async def test_a_slow_readers_slot_holds_its_limit_and_reads_the_rest_back(
    nats_url: str, tmp_path: Path
) -> None:
    """A reader that fell behind: its slot keeps a limit's worth of output, drops the rest
    of what is delivered live, and hands all of it over in order from the ledger."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await bus.provision_streams(js, make_settings(tmp_path))
    ingress, rid, marker = f"i{uuid.uuid4().hex[:8]}", uuid.uuid4().hex, uuid.uuid4().hex
    chunk, limit = 100, 300
    router = OutputRouter(nc, ingress, slot_limit=limit)
    await router.start()
    slot, other = router.open(rid), router.open(marker)

    async def commit(req: str, seq: int, kind: str = h.KIND_CHUNK) -> None:
        event = OUTPUTS[kind](rid=req, seq=seq, payload=f"{seq:<{chunk}}".encode())
        await ledger.commit(nc, ingress, req, [event])

    try:
        for seq in range(1, 50):
            await commit(rid, seq)
        await commit(rid, 50, h.KIND_END)
        await commit(marker, 1)  # one subscription: once this is in, all of the above were
        async with asyncio.timeout(10):
            assert (await other.take_one()) is not None
        seqs: list[int] = []
        async with asyncio.timeout(10):
            while not seqs or seqs[-1] != 50:
                batch = await slot.take()
                assert sum(len(e.payload) for e in batch) <= limit + chunk
                seqs += [e.seq for e in batch]
        assert seqs == list(range(1, 51))
        assert not slot.spilled  # caught up: live again
    finally:
        router.close(rid)
        router.close(marker)
        await router.stop()
        await nc.close()


async def test_a_delivery_in_an_older_shape_is_read_back_from_the_ledger(
    routed: tuple[NATS, str, OutputRouter],
) -> None:
    """During an upgrade, a schedule worker of the version before the variants delivers
    chunks without their kind, which this router cannot decode, and stores them as that
    version did (one record each, the rest in headers): the requests it names read their
    ledgers back, so the client still gets every event, in order, with its end."""
    nc, ingress, router = routed
    js, rid = nc.jetstream(), uuid.uuid4().hex
    slot = router.open(rid)
    try:
        old_events: list[dict[str, object]] = []
        for seq, kind in ((1, h.KIND_CHUNK), (2, h.KIND_CHUNK), (3, h.KIND_END)):
            payload = f"chunk {seq}".encode()
            hdrs = {h.SEQ: str(seq), h.MSG_ID: f"{ingress}.{rid}:{seq}"}
            if kind != h.KIND_CHUNK:
                hdrs[h.KIND] = kind
            ack = await ledger.publish(js, bus.out_subject(ingress, rid), payload, hdrs, 10)
            # the old `Delivered`: a bag of fields whose kind, "chunk", was a default left out
            old = {"rid": rid, "seq": seq, "stream_seq": ack.seq, "payload": payload, "tokens": 1}
            if kind != h.KIND_CHUNK:
                old["kind"] = kind
            old_events.append(old)
        await nc.publish(bus.sse_subject(ingress), msgspec.msgpack.encode({"events": old_events}))
        got: list[tuple[int, str, bytes]] = []
        async with asyncio.timeout(10):
            while not got or got[-1][1] != h.KIND_END:
                got += [(e.seq, e.kind, e.payload) for e in await slot.take()]
        assert got == [
            (1, h.KIND_CHUNK, b"chunk 1"),
            (2, h.KIND_CHUNK, b"chunk 2"),
            (3, h.KIND_END, b"chunk 3"),
        ]
    finally:
        router.close(rid)
