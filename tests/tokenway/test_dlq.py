"""Dead letters end to end: poison and exhausted messages land in TW_DLQ, operators list, show,
replay (once) and purge them, from the library and from `tokenway dlq`."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path

import msgspec
import nats
import pytest
import pytest_asyncio
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js import api as jsapi
from nats.js.errors import NotFoundError

from program import dlq
from program.cli import _dlq, dlq_parser, main
from tests.conftest import Bus, guarded_bus, make_settings, start_stack
from tokenway import bus, ledger
from tokenway import headers as h
from tokenway.config import Settings
from tokenway.wire import DeadLetter
from workers.dlq import mover

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest_asyncio.fixture(loop_scope="session")
async def server(tmp_path: Path) -> AsyncIterator[Bus]:
    """A bus of this test's own, as `up` guards it, with the streams provisioned: TW_DLQ
    holds only its letters. The commands run as `ops`, the mover as `dlq`."""
    async with guarded_bus(tmp_path / "nats") as own:
        nc = await nats.connect(own.watch)
        await bus.provision_streams(nc.jetstream(), make_settings(tmp_path / "data"))
        await nc.close()
        yield own


@pytest_asyncio.fixture(loop_scope="session")
async def js(server: Bus) -> AsyncIterator[JetStreamContext]:
    nc = await nats.connect(server.watch)  # the test's own: it seeds and reads letters
    yield nc.jetstream()
    await nc.close()


async def wait_letters(
    js: JetStreamContext, count: int, subject: str = bus.dlq_subject("*")
) -> list:
    """The first `count` messages on `subject` in TW_DLQ, waiting on the server for each."""
    config = jsapi.ConsumerConfig(ack_policy=jsapi.AckPolicy.NONE, inactive_threshold=10.0)
    sub = await js.pull_subscribe(subject, stream=bus.DLQ_STREAM, config=config)
    msgs: list = []
    while len(msgs) < count:
        msgs += await sub.fetch(count - len(msgs), timeout=10)
    await sub.unsubscribe()
    return msgs


async def seed(js: JetStreamContext, dead: DeadLetter) -> int:
    return (await js.publish(bus.dlq_subject(dead.stage), msgspec.json.encode(dead))).seq


async def test_undecodable_render_requests_are_dead_lettered_with_a_reason(
    server: Bus, js: JetStreamContext, tmp_path: Path
) -> None:
    stack = await start_stack(server.url, make_settings(tmp_path / "data"), ["render"])
    try:
        subject = bus.render_subject(stack.by_name["render"][0].model)
        headers = ledger.Identity("r1", "i1").headers()
        await js.publish(subject, b"\xc1 not msgpack", headers=headers)
        await js.publish(subject, b"no headers at all")
        await wait_letters(js, 2)
    finally:
        await stack.close()

    letters = await dlq.list_letters(js, stage="render")
    by_payload = {x.dead.payload: x.dead for x in letters}
    assert by_payload[b"\xc1 not msgpack"].reason.startswith("decode: undecodable render request")
    assert by_payload[b"\xc1 not msgpack"].headers[h.RID] == "r1"
    assert by_payload[b"\xc1 not msgpack"].subject == subject
    assert by_payload[b"no headers at all"].reason.startswith("decode: no valid request headers")
    # Terminated, not left in the work queue.
    assert (await js.stream_info(bus.RENDER_STREAM)).state.messages == 0


async def test_exhausted_deliveries_are_moved_to_the_dlq_and_off_the_work_queue(
    server: Bus, js: JetStreamContext, tmp_path: Path
) -> None:
    settings = server.role(make_settings(tmp_path / "data"), "dlq")
    spec = bus.ConsumerSpec(
        stream=bus.RENDER_STREAM,
        durable="render-poison",
        filter_subject=bus.render_subject("poison"),
        handler="this test",
        ack_wait=1.0,
        max_deliver=2,
        max_ack_pending=8,
    )
    sub = await bus.pull(js, spec)
    hdrs = ledger.Identity("rid-1", "i1").headers()
    sent = await js.publish(bus.render_subject("poison"), b"crashes the worker", headers=hdrs)
    for _ in range(spec.max_deliver):
        (msg,) = await sub.fetch(1, timeout=5)
        await msg.nak()
    # The server notices the exhaustion (and advises) on its next delivery attempt.
    with pytest.raises(NatsTimeout):
        await sub.fetch(1, timeout=0.3)

    stop = asyncio.Event()
    moving = asyncio.create_task(mover.DlqMover(settings).run(server.url, stop))
    (moved,) = await wait_letters(js, 1)
    stop.set()
    await moving  # finishes the advisory in hand: the delete and the ack

    dead = msgspec.json.decode(moved.data, type=DeadLetter)
    assert moved.subject == bus.dlq_subject("render")
    assert dead.reason == "exhausted: max deliveries (2) exhausted"
    assert (dead.stage, dead.delivered, dead.subject) == ("render", 2, bus.render_subject("poison"))
    assert dead.payload == b"crashes the worker"
    assert dead.headers[h.RID] == "rid-1"
    with pytest.raises(NotFoundError):
        await js.get_msg(bus.RENDER_STREAM, sent.seq)
    info = await js.consumer_info(bus.ADVISORY_STREAM, mover.MOVER)
    assert (info.num_pending, info.num_ack_pending) == (0, 0)

    # A redelivered advisory moves nothing twice.
    advisory = mover.MaxDeliveries(bus.RENDER_STREAM, "render-poison", sent.seq, 2)
    assert await mover.move(js, advisory) is None
    assert len(await dlq.list_letters(js)) == 1


async def test_moving_twice_stores_one_letter_and_leaves_non_work_queues_alone(
    js: JetStreamContext,
) -> None:
    sent = await js.publish(bus.out_subject("i1", "r9"), b"ledger entry")
    advisory = mover.MaxDeliveries(bus.OUT_STREAM, "audit-x", sent.seq, 3)
    first = await mover.move(js, advisory)
    assert await mover.move(js, advisory) == first  # the DLQ dropped the duplicate
    (letter,) = await dlq.list_letters(js)
    assert (letter.id, letter.dead.stage, letter.dead.delivered) == (first, "audit", 3)
    assert (await js.get_msg(bus.OUT_STREAM, sent.seq)).data == b"ledger entry"


def letters_fixture(now: float) -> list[DeadLetter]:
    old_hdrs = {h.MSG_ID: "r1", h.RID: "r1", h.REPLY: "i1", h.DEADLINE: f"{now - 3000:.3f}"}
    return [
        DeadLetter(
            stage="render",
            subject=bus.render_subject("m"),
            reason="undecodable render request: " + "x" * 100,
            headers=old_hdrs,
            payload=b"p1",
            time=now - 3 * 3600,
        ),
        DeadLetter(
            stage="schedule",
            subject=bus.sched_subject("m"),
            reason="max deliveries (5) exhausted",
            delivered=5,
            headers={h.RID: "r2", h.REPLY: "i1"},
            payload=b"p2",
            time=now - 600,
        ),
        DeadLetter(
            stage="render",
            subject=bus.render_subject("m"),
            reason="max deliveries (5) exhausted",
            delivered=5,
            headers={h.MSG_ID: "r3", h.RID: "r3", h.REPLY: "i1"},
            payload=b"p3",
            time=now,
        ),
    ]


async def test_ls_filters_by_stage_reason_and_since(js: JetStreamContext) -> None:
    now = time.time()
    a, b, c = [await seed(js, x) for x in letters_fixture(now)]

    async def ids(**filters: object) -> list[int]:
        return [x.id for x in await dlq.list_letters(js, **filters)]  # type: ignore[arg-type]

    assert await ids() == [a, b, c]
    assert await ids(stage="render") == [a, c]
    assert await ids(reason="MAX DELIVERIES") == [b, c]
    assert await ids(since=dlq.parse_since("1h", now)) == [b, c]
    two_hours_ago = datetime.fromtimestamp(now - 7200).isoformat()
    assert await ids(stage="render", since=dlq.parse_since(two_hours_ago, now)) == [c]
    with pytest.raises(ValueError, match="--since"):
        dlq.parse_since("yesterday", now)

    table = dlq.format_table(await dlq.list_letters(js))
    assert table.splitlines()[0].split() == [
        *["ID", "TIME", "STAGE", "SUBJECT", "DELIVERIES", "REPLAYED", "REASON"]
    ]
    assert bus.sched_subject("m") in table and "…" in table  # the long reason is cut


async def test_show_replay_once_and_purge(js: JetStreamContext) -> None:
    now = time.time()
    a, _, c = [await seed(js, x) for x in letters_fixture(now)]

    shown = await dlq.get_letter(js, a)
    assert (shown.dead.payload, shown.replayed) == (b"p1", None)
    assert "payload     2 bytes\np1" in dlq.format_letter(shown)
    with pytest.raises(dlq.LetterNotFound):
        await dlq.get_letter(js, 999)

    (done,) = await dlq.replay(js, [a])
    assert done.ok, done.detail
    again = await js.get_last_msg(bus.RENDER_STREAM, bus.render_subject("m"))
    assert again.data == b"p1"
    assert again.headers[h.MSG_ID] == f"r1:replay:{a}"  # fresh: "r1" would be a duplicate
    assert again.headers[h.RID] == "r1" and h.DEADLINE not in again.headers  # passed deadline

    (refused,) = await dlq.replay(js, [a])
    assert not refused.ok and "already replayed" in refused.detail
    assert (await dlq.get_letter(js, a)).replayed.msg_id == f"r1:replay:{a}"
    marker = (await js.stream_info(bus.DLQ_STREAM)).state.last_seq
    (not_a_letter,) = await dlq.replay(js, [marker])
    assert not not_a_letter.ok and "not a dead letter" in not_a_letter.detail

    # Two replays racing past the marker check: the work queue's duplicate window keeps one.
    results = await asyncio.gather(dlq.replay(js, [c]), dlq.replay(js, [c]))
    assert sorted(r[0].ok for r in results) == [False, True]
    assert (await js.stream_info(bus.RENDER_STREAM)).state.messages == 2

    assert await dlq.purge(js, "schedule") == 1
    assert [x.id for x in await dlq.list_letters(js)] == [a, c]
    assert await dlq.purge(js) == 2
    assert await dlq.list_letters(js) == []


async def test_cli_prints_tables_and_json_and_refuses_a_second_replay(
    server: Bus, js: JetStreamContext, capsys: pytest.CaptureFixture[str]
) -> None:
    a, _, _ = [await seed(js, x) for x in letters_fixture(time.time())]

    async def run(*argv: str) -> tuple[int, str]:
        args = dlq_parser().parse_args([*argv, "--nats", server.url])
        try:
            rc = await _dlq(args, server.role(Settings(), "ops"))
        except SystemExit as exc:
            rc = str(exc)  # type: ignore[assignment]
        return rc, capsys.readouterr().out

    rc, out = await run("ls", "--stage", "render")
    assert rc == 0 and out.splitlines()[0].startswith("ID") and len(out.splitlines()) == 4
    assert out.splitlines()[-1] == dlq.IDS_NOTE  # what the ids are, under the table
    rc, out = await run("show", str(a), "--json")
    assert json.loads(out)["headers"][h.RID] == "r1"
    assert (await run("replay", str(a)))[0] == 0
    rc, out = await run("replay", str(a))
    assert rc == 1 and out.startswith(f"refused {a}: already replayed")
    rc, _ = await run("purge")
    assert "without --yes" in str(rc)
    assert (await run("purge", "--yes", "--json")) == (0, '{"purged": 3}\n')


async def test_cli_subprocess_lists_letters_as_json_lines(
    server: Bus, js: JetStreamContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = [await seed(js, x) for x in letters_fixture(time.time())]
    proc = await asyncio.create_subprocess_exec(  # as the README says: with `ops.env` loaded
        *[sys.executable, "-m", "program.cli", "dlq", "ls", "--json"],
        env={**os.environ, **server.env("ops")},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    assert [json.loads(line)["id"] for line in out.decode().splitlines()] == ids

    monkeypatch.delenv("TOKENWAY_NATS", raising=False)
    with pytest.raises(SystemExit, match="need --nats"):
        main(["dlq", "ls"])
