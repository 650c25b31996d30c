"""The owner's ledger writer on a real nats-server: its own HPUB frames are stored exactly,
deduplicated by message id and fenced by the expected last subject sequence."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client as NATS
from nats.js.errors import APIError

from tests.conftest import make_settings
from tokenway import bus, ledger
from tokenway import headers as h
from tokenway.ledger_writer import LedgerWriter, hpub
from tokenway.wire import Chunk


@pytest_asyncio.fixture(loop_scope="session")
async def writer(nats_url: str, tmp_path: Path) -> AsyncIterator[tuple[NATS, LedgerWriter]]:
    nc = await nats.connect(nats_url)
    await bus.provision_streams(nc.jetstream(), make_settings(tmp_path))
    w = LedgerWriter(nc, nc.jetstream())
    await w.start()
    yield nc, w
    await nc.close()


def entry(rid: str, seq: int, after: int | None, **extra: str) -> tuple[str, bytes, dict[str, str]]:
    """One event on the request's index, fenced on `after`."""
    event = Chunk(rid=rid, seq=seq, payload=f"data: chunk {seq}\n\n".encode(), attempt=1,
                  tokens=2, ids=[5, 6], state=b"\x01\xff")  # fmt: skip
    hdrs = ledger.index_headers([event], reply="ingr", after=after) | extra
    return bus.out_subject("ingr", rid), ledger.encode([event]), hdrs


@pytest.mark.asyncio(loop_scope="session")
async def test_a_round_is_stored_with_its_headers_and_payloads(
    writer: tuple[NATS, LedgerWriter],
) -> None:
    nc, w = writer
    rids = [uuid.uuid4().hex for _ in range(3)]
    outcomes = await w.store([entry(rid, 1, 0) for rid in rids])
    assert all(isinstance(o, int) for o in outcomes)
    for rid, seq in zip(rids, outcomes, strict=True):
        assert isinstance(seq, int)
        msg = await nc.jetstream().get_msg("TW_OUT", seq)
        assert msg.subject == bus.out_subject("ingr", rid)
        assert msg.data == entry(rid, 1, 0)[1]
        assert msg.headers == entry(rid, 1, 0)[2]


@pytest.mark.asyncio(loop_scope="session")
async def test_a_stored_publish_sent_again_is_its_duplicate_and_another_owners_is_refused(
    writer: tuple[NATS, LedgerWriter],
) -> None:
    """The server checks the fence before the message id: a retry of a publish that was
    stored but not answered is refused like another owner's, and must be told apart."""
    nc, w = writer
    rid = uuid.uuid4().hex
    [first] = await w.store([entry(rid, 1, 0)])
    subject, payload, hdrs = entry(rid, 1, 0)
    ack = await ledger.publish(nc.jetstream(), subject, payload, hdrs, within=1.0)
    assert (ack.seq, ack.duplicate) == (first, True)
    with pytest.raises(APIError) as refused:  # the same seq and fence, other output
        await ledger.publish(nc.jetstream(), subject, entry(rid, 2, 0)[1], hdrs, within=1.0)
    assert ledger.superseded(refused.value)


@pytest.mark.asyncio(loop_scope="session")
async def test_a_publish_fenced_on_a_stale_sequence_is_refused_as_superseded(
    writer: tuple[NATS, LedgerWriter],
) -> None:
    _, w = writer
    rid = uuid.uuid4().hex
    [first] = await w.store([entry(rid, 1, 0)])
    assert isinstance(first, int)
    [stale, fresh] = await w.store([entry(rid, 2, 0), entry(uuid.uuid4().hex, 1, 0)])
    assert isinstance(stale, APIError) and ledger.superseded(stale)
    assert isinstance(fresh, int)
    [next_] = await w.store([entry(rid, 2, first)])
    assert isinstance(next_, int) and next_ > first


@pytest.mark.asyncio(loop_scope="session")
async def test_a_header_that_would_break_the_frame_fails_its_entry_only(
    writer: tuple[NATS, LedgerWriter],
) -> None:
    nc, w = writer
    bad_rid, good_rid = uuid.uuid4().hex, uuid.uuid4().hex
    bad = entry(bad_rid, 1, 0, **{h.ATTEMPT: "1\r\nNats-Msg-Id: forged"})
    outcomes = await w.store([bad, entry(good_rid, 1, 0)])
    assert isinstance(outcomes[0], ValueError) and isinstance(outcomes[1], int)
    info = await nc.jetstream().stream_info(
        "TW_OUT", subjects_filter=bus.out_subject("ingr", bad_rid)
    )
    assert not info.state.subjects  # nothing of the broken entry reached the stream


@pytest.mark.parametrize(
    ("subject", "reply", "headers"),
    [("tw.out.a b", "", {}), ("tw.out.a", "in\rbox", {}), ("tw.out.a", "", {"Bad Name": "v"}),
     ("", "", {}), ("tw.out.a", "", {"Tw-Seq": "1\n"})],
)  # fmt: skip
def test_hpub_refuses_what_would_break_the_frame(
    subject: str, reply: str, headers: dict[str, str]
) -> None:
    with pytest.raises(ValueError):
        hpub(subject, reply, headers, b"")


def test_hpub_frames_headers_and_payload_with_their_sizes() -> None:
    frame = hpub("tw.out.a.b", "_INBOX.x.1", {"Tw-Seq": "3"}, b"hello")
    head = b"NATS/1.0\r\nTw-Seq: 3\r\n\r\n"
    assert frame == b"HPUB tw.out.a.b _INBOX.x.1 %d %d\r\n%shello\r\n" % (
        len(head), len(head) + 5, head,
    )  # fmt: skip
