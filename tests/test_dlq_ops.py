"""Dead letters as an operator meets them: `status` counts them by the stage that failed them,
reasons start with the category word the docs filter on, ids say what they are, `show`
prints binary payloads safely, and `ls --json` says it prints JSON lines."""

from __future__ import annotations

import re
import time
from pathlib import Path

import msgspec
import nats
import pytest
from nats.js import JetStreamContext

from program import dlq
from program.cli import dlq_parser
from program.status import read_status
from tests.conftest import Bus, make_settings, start_stack
from tests.tokenway.test_dlq import js, letters_fixture, seed, server, wait_letters
from tokenway import bus, ledger
from tokenway import headers as h
from tokenway.wire import DeadLetter
from workers.dlq import mover

ON_THE_SESSION_LOOP = pytest.mark.asyncio(loop_scope="session")

__all__ = ["js", "server"]  # fixtures of tests.tokenway.test_dlq, used here by name

OBSERVABILITY = Path(__file__).parent.parent / "docs" / "observability.md"


async def dead_letters_in_status(server: Bus, tmp_path: Path) -> dict[str, int]:
    nc = await nats.connect(server.watch)
    try:
        return (await read_status(nc, make_settings(tmp_path / "data"))).dead_letters
    finally:
        await nc.close()


@ON_THE_SESSION_LOOP
async def test_status_counts_letters_by_stage_not_replay_markers_and_purge_clears_them(
    server: Bus, js: JetStreamContext, tmp_path: Path
) -> None:
    first, schedule, _ = [await seed(js, x) for x in letters_fixture(time.time())]
    (replayed,) = await dlq.replay(js, [first])
    assert replayed.ok, replayed.detail
    assert await dead_letters_in_status(server, tmp_path) == {"render": 2, "schedule": 1}

    assert await dlq.purge(js, "render") == 2
    assert await dead_letters_in_status(server, tmp_path) == {"schedule": 1}
    # The purged letter's replay marker went with it: the stream holds the one letter left.
    assert (await js.stream_info(bus.DLQ_STREAM)).state.messages == 1
    assert [x.id for x in await dlq.list_letters(js)] == [schedule]
    assert await dlq.purge(js, "schedule") == 1
    assert await dead_letters_in_status(server, tmp_path) == {}
    assert (await js.stream_info(bus.DLQ_STREAM)).state.messages == 0


def readme_reason_filters() -> list[str]:
    """Every `--reason WORD` docs/observability.md shows."""
    return re.findall(r"--reason (\w+)", OBSERVABILITY.read_text())


@ON_THE_SESSION_LOOP
async def test_every_reason_starts_with_a_category_the_readme_filters_on(
    server: Bus, js: JetStreamContext, tmp_path: Path
) -> None:
    stack = await start_stack(server.url, make_settings(tmp_path / "data"), ["render", "schedule"])
    try:
        model = stack.by_name["render"][0].model
        await js.publish(bus.render_subject(model), b"no headers at all")
        who = ledger.Identity("r1", "i1").headers()
        await js.publish(bus.render_subject(model), b"\xc1 not msgpack", headers=who)
        await js.publish(bus.sched_subject(model), b"\xc1 not msgpack", headers=who)
        await js.publish(bus.sched_subject(model), b"no headers either")
        await wait_letters(js, 4)
    finally:
        await stack.close()
    advisory = mover.MaxDeliveries(bus.RENDER_STREAM, "render-x", 1, 5)
    exhausted = mover.exhausted_letter(advisory, bus.render_subject(model), {}, b"", time.time())
    await seed(js, exhausted)

    reasons = {(x.dead.stage, x.dead.payload): x.dead.reason for x in await dlq.list_letters(js)}
    assert reasons[("render", b"no headers at all")] == (
        "decode: no valid request headers: the Tw-Rid header is missing"
    )
    assert reasons[("schedule", b"no headers either")] == (
        "decode: no valid request headers: the Tw-Rid header is missing"
    )
    assert reasons[("render", b"\xc1 not msgpack")].startswith("decode: undecodable render request")
    assert reasons[("schedule", b"\xc1 not msgpack")].startswith("decode: undecodable request")
    assert reasons[("render", b"")] == "exhausted: max deliveries (5) exhausted"
    for reason in reasons.values():
        assert reason.split(":", 1)[0] in ledger.DEAD_REASONS, reason
        assert "Error(" not in reason, reason  # says what is wrong, not an exception's repr

    # The docs' filters find the letters of the case they describe.
    filters = readme_reason_filters()
    assert filters and set(filters) <= set(ledger.DEAD_REASONS)
    decoded = await dlq.list_letters(js, reason="decode")
    assert len(decoded) == 4 and all("decode" in x.dead.reason for x in decoded)
    (out_of_deliveries,) = await dlq.list_letters(js, reason="exhausted")
    assert out_of_deliveries.dead.delivered == 5
    await dlq.purge(js)


@ON_THE_SESSION_LOOP
async def test_ls_says_ids_are_stream_sequences_where_a_replay_marker_takes_one(
    js: JetStreamContext,
) -> None:
    letters = letters_fixture(time.time())
    first = await seed(js, letters[0])
    assert (await dlq.replay(js, [first]))[0].ok
    second = await seed(js, letters[1])
    assert second == first + 2  # the marker between them

    table = dlq.format_table(await dlq.list_letters(js))
    assert "ID" in table.splitlines()[0]
    assert "TW_DLQ sequence" in table and "replay" in table
    await dlq.purge(js)


def test_show_prints_a_binary_payload_escaped_and_text_as_text() -> None:
    binary = DeadLetter(stage="render", subject="tw.render.m", reason="decode: x",
                        payload=b"\x00\x01ab\xc1\n", time=0.0)  # fmt: skip
    shown = dlq.format_letter(dlq.Letter(1, binary))
    assert "\x00" not in shown and "\x01" not in shown
    assert "payload     6 bytes, binary (non-printable bytes as \\xNN)" in shown
    assert shown.endswith("\\x00\\x01ab\\xc1\\x0a")

    text = DeadLetter(stage="render", subject="tw.render.m", reason="decode: x",
                      payload="héllo\nworld\t!".encode(), time=0.0)  # fmt: skip
    shown = dlq.format_letter(dlq.Letter(2, text))
    assert shown.endswith("payload     14 bytes\nhéllo\nworld\t!")


def test_ls_json_is_documented_as_json_lines(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        dlq_parser().parse_args(["ls", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "JSON lines" in text and "not an array" in text


def test_decode_reasons_name_a_missing_header_in_words() -> None:
    assert ledger.what_is_wrong(KeyError(h.RID)) == "the Tw-Rid header is missing"
    try:
        msgspec.msgpack.decode(b"\xc1")
    except msgspec.DecodeError as exc:
        assert ledger.what_is_wrong(exc) == str(exc)
