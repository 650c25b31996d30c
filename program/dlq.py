"""Dead letters: the operations behind `tokenway dlq` (list, show, replay, purge); the mover
stage that fills `TW_DLQ` is `workers.dlq.mover`.

A letter's id is its `TW_DLQ` stream sequence (so ids skip: a marker takes one, below, and a
purge leaves gaps). A replayed letter gets a marker on
`tw.dlq.replayed.<id>` in the same stream (so it lives and is purged with the letters); the
replay itself carries a fresh, deterministic `Nats-Msg-Id`, so two racing replays inside the
work queue's duplicate window still run the request once, and the marker refuses later ones.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import msgspec
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js import api as jsapi
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError

from tokenway import bus
from tokenway import headers as h
from tokenway.wire import DeadLetter

log = logging.getLogger(__name__)

_REPLAYED = "replayed"
_ALL_LETTERS = bus.dlq_subject("*")  # markers have one token more and stay out
IDS_NOTE = "ID: the letter's TW_DLQ sequence; a replay's marker takes one too, so ids skip"


class ReplayMark(msgspec.Struct, kw_only=True):
    """What `tw.dlq.replayed.<id>` holds: where the letter went, under which id, when."""

    subject: str
    msg_id: str
    time: float


@dataclass(frozen=True)
class Letter:
    id: int  # the TW_DLQ stream sequence
    dead: DeadLetter
    replayed: ReplayMark | None = None


@dataclass(frozen=True)
class Replay:
    id: int
    ok: bool
    detail: str


class LetterNotFound(LookupError):
    pass


_json = msgspec.json.Encoder()
_letter = msgspec.json.Decoder(DeadLetter)
_mark = msgspec.json.Decoder(ReplayMark)

# -- pure core --------------------------------------------------------------------------------


def marker_subject(letter_id: int | str) -> str:
    return bus.dlq_subject(f"{_REPLAYED}.{letter_id}")


def replay_msg_id(dead: DeadLetter, letter_id: int) -> str:
    """Fresh (the original id would be dropped inside the duplicate window), deterministic
    (so a second replay is dropped there)."""
    base = dead.headers.get(h.MSG_ID) or dead.headers.get(h.RID) or "dlq"
    return f"{base}:replay:{letter_id}"


def replay_headers(dead: DeadLetter, msg_id: str, now: float) -> dict[str, str]:
    """The original headers minus server-facing `Nats-*` ones and a deadline already passed
    (it would fail the request on arrival), plus the replay's own message id."""
    hdrs = {k: v for k, v in dead.headers.items() if not k.lower().startswith("nats-")}
    deadline = hdrs.get(h.DEADLINE)
    if deadline is not None and _float(deadline) <= now:
        del hdrs[h.DEADLINE]
    hdrs[h.MSG_ID] = msg_id
    return hdrs


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text: str, now: float) -> float:
    """`30m`, `2h`, `7d` (ago) or an ISO time (local unless it names a zone) → epoch seconds."""
    if m := _DURATION.match(text.strip()):
        return now - float(m[1]) * _UNITS[m[2]]
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ValueError(
            f"--since takes a duration such as 30m, 2h, 7d or an ISO time, not {text!r}"
        ) from None


def matches(dead: DeadLetter, since: float | None, reason: str | None) -> bool:
    if since is not None and dead.time < since:
        return False
    return reason is None or reason.lower() in dead.reason.lower()


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds")


def to_json(letter: Letter, full: bool = False) -> str:
    """One line for scripts; `full` adds headers and the payload (base64, as stored)."""
    d = letter.dead
    obj: dict[str, object] = {
        "id": letter.id,
        "time": _iso(d.time),
        "stage": d.stage,
        "subject": d.subject,
        "reason": d.reason,
        "delivered": d.delivered,
        "replayed": letter.replayed.msg_id if letter.replayed else None,
    }
    if full:
        obj["headers"] = d.headers
        obj["payload"] = d.payload
    return _json.encode(obj).decode()


def format_table(letters: list[Letter], reason_width: int = 60) -> str:
    rows = [["ID", "TIME", "STAGE", "SUBJECT", "DELIVERIES", "REPLAYED", "REASON"]]
    for letter in letters:
        d = letter.dead
        local = datetime.fromtimestamp(d.time).strftime("%Y-%m-%d %H:%M:%S")
        why = d.reason if len(d.reason) <= reason_width else d.reason[: reason_width - 1] + "…"
        replayed = "yes" if letter.replayed else ""
        rows.append([str(letter.id), local, d.stage, d.subject, str(d.delivered), replayed, why])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    table = [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1] for r in rows
    ]
    return "\n".join([*table, IDS_NOTE] if letters else table)


def format_letter(letter: Letter) -> str:
    d = letter.dead
    mark = letter.replayed
    lines = [
        f"id          {letter.id}",
        f"time        {_iso(d.time)}",
        f"stage       {d.stage}",
        f"subject     {d.subject}",
        f"deliveries  {d.delivered}",
        f"reason      {d.reason}",
        f"replayed    {f'as {mark.msg_id} at {_iso(mark.time)}' if mark else 'no'}",
        "headers     " + "\n            ".join(f"{k}: {v}" for k, v in d.headers.items()),
        *payload_lines(d.payload),
    ]
    return "\n".join(lines)


def payload_lines(payload: bytes) -> list[str]:
    """Its size, then the payload: text as text; else (a terminal would act on a NUL or an
    escape) on one line with each byte that is not printable ASCII written as `\\xNN`."""
    try:
        text = payload.decode()
    except UnicodeDecodeError:
        text = None
    if text is not None and all(c.isprintable() or c in "\n\t" for c in text):
        return [f"payload     {len(payload)} bytes", text]
    shown = "".join(chr(b) if 0x20 <= b < 0x7F and b != 0x5C else f"\\x{b:02x}" for b in payload)
    return [f"payload     {len(payload)} bytes, binary (non-printable bytes as \\xNN)", shown]


# -- operations behind `tokenway dlq` ---------------------------------------------------------


async def _read(js: JetStreamContext, subject: str) -> list[Msg]:
    """Every message stored on `subject` in TW_DLQ now, through a short-lived consumer."""
    config = jsapi.ConsumerConfig(
        ack_policy=jsapi.AckPolicy.NONE, inactive_threshold=10.0, mem_storage=True
    )
    sub = await js.pull_subscribe(subject, stream=bus.DLQ_STREAM, config=config)
    msgs: list[Msg] = []
    try:
        left = (await sub.consumer_info()).num_pending or 0  # (nats-py's field is optional)
        while left > 0:
            try:
                batch = await sub.fetch(min(left, 256), timeout=5)
            except (TimeoutError, NatsTimeout):
                break  # purged meanwhile
            msgs += batch
            left -= len(batch)
    finally:
        await sub.unsubscribe()
    return msgs


def _decode_letter(data: bytes, subject: str, stored: float) -> DeadLetter:
    try:
        return _letter.decode(data)
    except msgspec.DecodeError as exc:
        return DeadLetter(
            stage=bus.rid_of(subject),
            subject=subject,
            reason=f"decode: undecodable dead letter: {exc}",
            payload=data,
            time=stored,
        )


def _decode_mark(data: bytes) -> ReplayMark:
    try:
        return _mark.decode(data)
    except msgspec.DecodeError:
        return ReplayMark(subject="?", msg_id="?", time=0.0)


async def list_letters(
    js: JetStreamContext,
    stage: str | None = None,
    since: float | None = None,
    reason: str | None = None,
) -> list[Letter]:
    """Letters, oldest first, of one stage (or all), dead-lettered at or after `since`, whose
    reason contains `reason` (case-insensitive)."""
    marks = {
        int(bus.rid_of(m.subject)): _decode_mark(m.data)
        for m in await _read(js, marker_subject("*"))
    }
    subject = bus.dlq_subject(bus.token(stage)) if stage else _ALL_LETTERS
    letters = []
    for m in await _read(js, subject):
        seq = m.metadata.sequence.stream
        dead = _decode_letter(m.data, m.subject, m.metadata.timestamp.timestamp())
        if matches(dead, since, reason):
            letters.append(Letter(seq, dead, marks.get(seq)))
    return letters


async def get_letter(js: JetStreamContext, letter_id: int) -> Letter:
    if letter_id < 1:
        raise LetterNotFound(f"no dead letter with id {letter_id}")
    try:
        raw = await js.get_msg(bus.DLQ_STREAM, letter_id)
    except NotFoundError:
        raise LetterNotFound(f"no dead letter with id {letter_id}") from None
    subject = raw.subject or ""
    if not subject.startswith("tw.dlq.") or subject.count(".") != 2:
        raise LetterNotFound(f"{letter_id} is not a dead letter but a record on {subject}")
    stored = raw.time.timestamp() if raw.time else 0.0
    dead = _decode_letter(raw.data or b"", subject, stored)
    try:
        mark = await js.get_last_msg(bus.DLQ_STREAM, marker_subject(letter_id))
    except NotFoundError:
        return Letter(letter_id, dead)
    return Letter(letter_id, dead, _decode_mark(mark.data or b""))


async def replay(js: JetStreamContext, ids: list[int]) -> list[Replay]:
    """Republish each letter's payload and headers to its original subject, at most once."""
    return [await _replay_one(js, i) for i in ids]


async def _replay_one(js: JetStreamContext, letter_id: int) -> Replay:
    try:
        letter = await get_letter(js, letter_id)
    except LetterNotFound as exc:
        return Replay(letter_id, False, str(exc))
    if mark := letter.replayed:
        when = _iso(mark.time)
        return Replay(letter_id, False, f"already replayed as {mark.msg_id} at {when}")
    dead, now = letter.dead, time.time()
    msg_id = replay_msg_id(dead, letter_id)
    try:
        ack = await js.publish(
            dead.subject, dead.payload, headers=replay_headers(dead, msg_id, now)
        )
    except (APIError, NoStreamResponseError) as exc:
        return Replay(letter_id, False, f"could not publish to {dead.subject}: {exc!r}")
    mark = ReplayMark(subject=dead.subject, msg_id=msg_id, time=now)
    await js.publish(
        marker_subject(letter_id), _json.encode(mark), headers={h.MSG_ID: f"replayed:{letter_id}"}
    )
    if ack.duplicate:
        return Replay(letter_id, False, f"already replayed as {msg_id} (a duplicate, dropped)")
    return Replay(letter_id, True, f"replayed to {dead.subject} as {msg_id}")


async def count_letters(js: JetStreamContext, stage: str | None = None) -> int:
    subject = bus.dlq_subject(bus.token(stage)) if stage else _ALL_LETTERS
    info = await js.stream_info(bus.DLQ_STREAM, subjects_filter=subject)
    return sum((info.state.subjects or {}).values())


async def purge(js: JetStreamContext, stage: str | None = None) -> int:
    """Remove the letters of one stage and their replay markers (or every letter and marker);
    how many letters went."""
    if not stage:
        count = await count_letters(js)
        await js.purge_stream(bus.DLQ_STREAM, subject=bus.dlq_subject(">"))
        return count
    letters = await list_letters(js, stage)
    await js.purge_stream(bus.DLQ_STREAM, subject=bus.dlq_subject(bus.token(stage)))
    for letter in letters:
        if letter.replayed is not None:
            await js.purge_stream(bus.DLQ_STREAM, subject=marker_subject(letter.id))
    return len(letters)
