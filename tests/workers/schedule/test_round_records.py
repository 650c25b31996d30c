"""An owner's round records on a real nats-server: one record per reply and round, the
requests' indexes where due, a takeover refused by the server's fence, and what a reader
of one request reads back, whatever its owner's traffic."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client as NATS
from nats.js.api import RawStreamMsg

from tests.conftest import make_settings
from tokenway import bus, ledger
from tokenway import headers as h
from tokenway.ledger_writer import LedgerWriter
from tokenway.wire import Chunk, Delivered, Delivery, End, GenerateRequest, OutputContext
from workers.schedule.owned import Owned
from workers.schedule.rounds import Rounds, Staged, TakenOver

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest_asyncio.fixture(loop_scope="session")
async def conn(nats_url: str, tmp_path: Path) -> AsyncIterator[NATS]:
    nc = await nats.connect(nats_url)
    await bus.provision_streams(nc.jetstream(), make_settings(tmp_path))
    yield nc
    await nc.close()


async def owner(nc: NATS, limit: int = 1 << 20) -> Rounds:
    writer = LedgerWriter(nc, nc.jetstream())
    await writer.start()
    return Rounds(writer, nc.jetstream(), f"s{uuid.uuid4().hex[:8]}", limit)


def request(reply: str) -> Owned:
    rid = uuid.uuid4().hex[:12]
    ctx = OutputContext(api="completion", response_id="cmpl-1", model="m", stream=True)
    req = GenerateRequest(request_id=rid, token_ids=[1], context=ctx)
    return Owned(rid=rid, reply=reply, request=req, deadline=1e12, msg=None)  # type: ignore[arg-type]


def chunk(r: Owned, end: bool = False, size: int = 8) -> Delivered:
    """The request's next event, one token."""
    seq = r.out_seq + 1
    variant = End if end else Chunk
    payload = f"data: {seq:0{size}d}\n\n".encode()
    return variant(rid=r.rid, seq=seq, payload=payload, tokens=1, ids=[seq], state=b"s%d" % seq)


async def step(rounds: Rounds, *rs: Owned, end: bool = False) -> dict[str, bytes]:
    """One round of one event each; the stored ones advance (as the service does)."""
    staged = [Staged(r, [chunk(r, end)]) for r in rs]
    delivered = await rounds.commit(staged)
    for s in staged:
        if s.stored:
            s.r.out_seq += len(s.events)
    return delivered


async def records(nc: NATS, subject: str) -> list[RawStreamMsg]:
    return [msg async for msg in ledger.stored(nc.jetstream(), subject)]


async def test_a_round_stores_one_record_per_reply_and_indexes_each_first_event(
    conn: NATS,
) -> None:
    rounds = await owner(conn)
    a = [request("ra") for _ in range(3)]
    b = request("rb")
    first = await step(rounds, *a, b)
    assert set(first) == {"ra", "rb"}  # one delivery per reply
    for r in [*a, b]:  # the first event is on the request's own subject
        assert r.index_seq and not r.unindexed
        assert await records(conn, rounds.subject(r.reply)) == []
    delivered = await step(rounds, *a, b)
    [round_a] = await records(conn, rounds.subject("ra"))
    assert round_a.headers and round_a.headers[h.KIND] == h.KIND_ROUND
    stored = msgspec.msgpack.decode(round_a.data, type=Delivery).events
    assert [(e.rid, e.seq) for e in stored] == [(r.rid, 2) for r in a]
    assert delivered["ra"] == round_a.data  # delivered as stored, not encoded again
    for r in a:
        assert [e.seq for e in r.unindexed] == [2]
        found = await ledger.read(conn.jetstream(), "ra", r.rid)
        assert found is not None and [e.seq for e in found.events] == [1, 2]


async def test_an_index_segment_every_segment_tokens_keeps_a_read_within_its_own_output(
    conn: NATS,
) -> None:
    """A request among 64 others on a busy owner: reading it back takes its index and at
    most a segment's worth of the owner's rounds, not every round of the owner."""
    rounds = await owner(conn)
    busy = [request("rc") for _ in range(64)]
    mine = request("rc")
    tokens = 5 * ledger.SEGMENT_TOKENS + 7
    for _ in range(tokens):
        await step(rounds, mine, *busy)
    index = await records(conn, bus.out_subject("rc", mine.rid))
    assert len(index) <= tokens // ledger.SEGMENT_TOKENS + 2
    found = await ledger.read_index(conn.jetstream(), "rc", mine.rid)
    assert found is not None and found.owner is not None
    tail = await records(conn, found.owner.subject)
    after = [m for m in tail if (m.seq or 0) > found.owner.after]
    assert len(after) < ledger.SEGMENT_TOKENS  # the rounds a reader of it still reads
    await ledger.read_rounds(conn.jetstream(), found, mine.rid)
    assert [e.seq for e in found.events] == list(range(1, tokens + 1))
    assert ledger.Committed.of(found).tokens.tolist() == list(range(1, tokens + 1))
    assert ledger.Committed.of(found).state == b"s%d" % tokens


async def test_a_takeover_makes_the_server_refuse_the_old_owners_next_round(
    conn: NATS,
) -> None:
    """The new owner stores a takeover on the old owner's round subject: the server refuses
    the old owner's next round record (its fence), the old owner lets the request go and
    stores the round again for the others; the ledger holds each event once, and nothing
    of the taken request after the takeover."""
    old, new = await owner(conn), await owner(conn)
    taken, kept = request("rd"), request("rd")
    for _ in range(3):
        await step(old, taken, kept)
    found = await ledger.read_index(conn.jetstream(), "rd", taken.rid)
    assert found is not None and found.owner is not None
    assert found.owner.subject == old.subject("rd")
    at = await ledger.take_over(
        conn.jetstream(), found.owner.subject, [taken.rid], new.subject("rd")
    )
    staged = [Staged(taken, [chunk(taken)]), Staged(kept, [chunk(kept)])]
    delivered = await old.commit(staged)
    assert isinstance(staged[0].outcome, TakenOver)  # refused by the server, not judged
    assert staged[1].stored
    shown = msgspec.msgpack.decode(delivered["rd"], type=Delivery).events
    assert [e.rid for e in shown] == [kept.rid]  # nothing of the taken one reaches a client
    await ledger.read_rounds(conn.jetstream(), found, taken.rid, before=at)
    assert [e.seq for e in found.events] == [1, 2, 3]
    again = await ledger.read(conn.jetstream(), "rd", taken.rid)
    assert again is not None and [e.seq for e in again.events] == [1, 2, 3]
    later = await ledger.read(conn.jetstream(), "rd", kept.rid)
    assert later is not None and [e.seq for e in later.events] == [1, 2, 3, 4]


async def test_an_end_indexes_every_event_not_indexed_yet(conn: NATS) -> None:
    rounds = await owner(conn)
    r = request("re")
    for _ in range(4):
        await step(rounds, r)
    await step(rounds, r, end=True)
    last = await conn.jetstream().get_last_msg(bus.OUT_STREAM, bus.out_subject("re", r.rid))
    assert last.headers and last.headers[h.KIND] == h.KIND_END
    assert [e.seq for e in ledger.events_of(r.rid, last)] == [2, 3, 4, 5]
    found = await ledger.read_index(conn.jetstream(), "re", r.rid)
    assert found is not None and found.ended  # nothing of it is left in the rounds


async def test_a_request_too_big_for_the_round_goes_alone_into_its_index(conn: NATS) -> None:
    """One request's size never moves another's commit: what would not fit the round
    record goes into that request's own index record."""
    rounds = await owner(conn, limit=4096)
    small, big = request("rf"), request("rf")
    await step(rounds, small, big)  # (first events: indexed)
    staged = [Staged(small, [chunk(small)]), Staged(big, [chunk(big, size=8192)])]
    await rounds.commit(staged)
    assert all(s.stored for s in staged)
    assert not staged[0].indexed and staged[1].indexed


async def test_a_change_of_owner_makes_the_server_refuse_the_old_owners_next_index_record(
    conn: NATS,
) -> None:
    """The new owner's change of owner, fenced where it read the index: the old owner's
    next index record of the request (its end here) is refused by the server, and nothing
    of it reaches a client or the request's index."""
    old, new = await owner(conn), await owner(conn)
    r = request("rg")
    for _ in range(3):
        await step(old, r)
    found = await ledger.read_index(conn.jetstream(), "rg", r.rid)
    assert found is not None
    await ledger.take_over(conn.jetstream(), old.subject("rg"), [r.rid], new.subject("rg"))
    await ledger.read_rounds(conn.jetstream(), found, r.rid)
    moved = ledger.Committed.of(found)
    headers = ledger.index_headers(moved.unindexed, reply="rg", after=found.index_seq,
                                   owner=new.pointer("rg"), seq=moved.seq)  # fmt: skip
    subject = bus.out_subject("rg", r.rid)
    await ledger.publish(conn.jetstream(), subject, ledger.encode(moved.unindexed), headers, 5)
    staged = [Staged(r, [chunk(r, end=True)])]
    delivered = await old.commit(staged)
    assert staged[0].indexed and isinstance(staged[0].outcome, TakenOver)
    assert delivered == {}
    again = await ledger.read(conn.jetstream(), "rg", r.rid)
    assert again is not None and not again.ended and [e.seq for e in again.events] == [1, 2, 3]
