"""The committed ledger (`TW_OUT`) and the dead letters (`TW_DLQ`): their records and headers.

A request's committed output lives in two kinds of record, both msgpack `Delivery`:

- **Round records**, on `bus.round_subject(reply, owner)`: each holds every event an owner
  committed for that reply in one round, fenced on the subject's last sequence, so each
  owner writes one record per reply and engine step whatever the number of requests. Once
  stored, the same bytes go to the reply's live readers (`tw.sse.<reply>`): a client never
  sees what is not stored.
- **Index records**, on `bus.out_subject(reply, rid)`, fenced on that subject's last
  sequence: the request's first event, a segment of its events every `SEGMENT_TOKENS`
  tokens, a change of owner, and its end with every event not indexed before. Each names
  the round subject where the events after it are (`Tw-Owner`, after `Tw-Owner-Seq`). So
  one request's output is read at a cost bounded by its own length: its index, then its
  owner's rounds since, which hold at most a segment's worth of its events.

An owner taking requests over first stores a `Takeover` on the old owner's round subject:
the old owner's next round record is refused by the server, and it lets those requests go.
"""

from __future__ import annotations

import hashlib
import logging
import time
from array import array
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import PubAck, RawStreamMsg
from nats.js.errors import APIError, NotFoundError

from tokenway import bus
from tokenway import headers as h
from tokenway.errors import error_body
from tokenway.metrics import DEAD_LETTERS
from tokenway.tenancy import Limits
from tokenway.wire import (
    OUTPUTS,
    Chunk,
    DeadLetter,
    Delivered,
    Delivery,
    ErrorInfo,
    Failed,
    Takeover,
)

log = logging.getLogger(__name__)

_json = msgspec.json.Encoder()
_msgpack = msgspec.msgpack.Encoder()
_records = msgspec.msgpack.Decoder(Delivery)
_takeover = msgspec.msgpack.Decoder(Takeover)

PUBLISH_WITHIN = 10.0  # seconds a ledger publish keeps trying (a server restart takes ~1)
# A request's events go into its index once this many of its tokens are not indexed (and
# at its end): what a takeover or a resume reads of its owner's rounds holds at most these.
SEGMENT_TOKENS = 32


def encode(events: Sequence[Delivered]) -> bytes:
    """A record's payload, or a live delivery: the same bytes."""
    return _msgpack.encode(Delivery(events=list(events)))


def fence(after: int | None, msg_id: str) -> dict[str, str]:
    """`after`: the subject's last sequence as its writer knows it; a publish from a writer
    that lost the subject (another wrote since) is refused. Without it, `msg_id` names
    the record for JetStream's de-duplication.

    A fenced record carries no `Nats-Msg-Id`: the fence already refuses it sent twice (a
    retry is told stored by `already_stored`), and the server would keep every id of the
    hot path in memory for the window. Without it, nats-server spends 13-25% less CPU per
    record at 16-64 records a round (docs/design-notes.md)."""
    if after is not None:
        return {h.EXPECTED_LAST_SUBJECT_SEQ: str(after)}
    return {h.MSG_ID: msg_id}


def round_headers(after: int) -> dict[str, str]:
    return {h.KIND: h.KIND_ROUND, h.EXPECTED_LAST_SUBJECT_SEQ: str(after)}


@dataclass(frozen=True, slots=True)
class Pointer:
    """Where a request's events after an index record are: its owner's round subject,
    after that stream sequence."""

    subject: str
    after: int


def index_headers(
    events: Sequence[Delivered],
    *,
    reply: str,
    after: int | None = None,
    tenant: str = "",
    owner: Pointer | None = None,
    seq: int = 0,
) -> dict[str, str]:
    """An index record's headers: its last event's `Tw-Seq` and kind (what a reader of the
    last record per subject needs), how many events it holds, whose request it is, and
    where its owner's rounds go on. `after`: as in `fence`; `seq`: the request's last
    `Tw-Seq` where the record holds no event (a change of owner)."""
    last = events[-1] if events else None
    seq = last.seq if last is not None else seq
    hdrs = fence(after, f"{reply}.{last.rid if last else ''}:{seq}")
    hdrs[h.SEQ] = str(seq)
    hdrs[h.EVENTS] = str(len(events))
    if last is not None and last.kind != h.KIND_CHUNK:
        hdrs[h.KIND] = last.kind
    if isinstance(last, Failed):
        hdrs[h.STATUS] = str(last.status)
        if last.retry_after:
            hdrs[h.RETRY_AFTER] = str(last.retry_after)
    if tenant:
        hdrs[h.TENANT] = tenant
    if owner is not None:
        hdrs[h.OWNER] = owner.subject
        hdrs[h.OWNER_SEQ] = str(owner.after)
    return hdrs


def error_event(rid: str, seq: int, info: ErrorInfo) -> Failed:
    return Failed(
        rid=rid, seq=seq, payload=error_body(info), status=info.status, retry_after=info.retry_after
    )


async def publish_error(
    nc: NATS,
    reply: str,
    rid: str,
    info: ErrorInfo,
    *,
    before: Sequence[Delivered] = (),
    seq: int = 1,
    after: int | None = None,
    tenant: str = "",
) -> PubAck:
    """An error event for the client; the stream (or response) ends with it. `before`: the
    events it follows that the request's index does not hold yet (an owner's), `seq` its
    `Tw-Seq` when there are none."""
    event = error_event(rid, before[-1].seq + 1 if before else seq, info)
    return await commit(nc, reply, rid, [*before, event], after=after, tenant=tenant)


async def commit(
    nc: NATS,
    reply: str,
    rid: str,
    events: Sequence[Delivered],
    *,
    after: int | None = None,
    tenant: str = "",
) -> PubAck:
    """Events stored on the request's index (retried while NATS comes back), then delivered
    live: a writer of one request at a time (not an owner's round)."""
    ack = await index(nc.jetstream(), reply, rid, events, after=after, tenant=tenant)
    await deliver(nc, reply, encode(events))
    return ack


async def index(
    js: JetStreamContext,
    reply: str,
    rid: str,
    events: Sequence[Delivered],
    *,
    after: int | None = None,
    tenant: str = "",
    owner: Pointer | None = None,
    seq: int = 0,
    within: float = PUBLISH_WITHIN,
) -> PubAck:
    """An index record of the request stored (`index_headers` says what each argument
    is), retried while NATS comes back for `within` seconds."""
    headers = index_headers(events, reply=reply, after=after, tenant=tenant, owner=owner, seq=seq)
    return await publish(js, bus.out_subject(reply, rid), encode(events), headers, within)


async def deliver(nc: NATS, reply: str, payload: bytes) -> None:
    """What was just stored for `reply` (`encode`d events), to whoever streams it live (core
    NATS: a lost delivery shows as a gap in `Tw-Seq`, or as nothing at a stream's end, and
    the reader reads the ledger back)."""
    await nc.publish(bus.sse_subject(reply), payload)


async def publish(
    js: JetStreamContext, subject: str, payload: bytes, headers: dict[str, str], within: float
) -> PubAck:
    """Store one ledger record, retrying while NATS or the stream comes back (a restart).

    Safe to retry: the server checks the fence (the expected last subject sequence) before
    the message id, so a publish that was stored but not answered is refused as superseded
    when sent again; it is told apart from another writer's by being the subject's last
    message, byte for byte (`already_stored`).
    """
    try:
        return await bus.publish_stored(js, subject, payload, headers, within)
    except APIError as exc:
        if superseded(exc) and (seq := await already_stored(js, subject, payload, headers)):
            return PubAck(stream=bus.OUT_STREAM, seq=seq, duplicate=True)
        raise


async def already_stored(
    js: JetStreamContext, subject: str, payload: bytes, headers: dict[str, str]
) -> int | None:
    """The stream sequence of this very publish (same payload, headers and fence) when it
    is the subject's last message: an earlier try was stored, its answer lost."""
    try:
        last = await js.get_last_msg(bus.OUT_STREAM, subject)
    except nats.errors.Error:  # nothing stored (NotFoundError), or NATS away
        return None
    stored_headers = last.headers or {}
    same = last.data == payload and all(stored_headers.get(k) == v for k, v in headers.items())
    return last.seq if same and last.seq else None


def superseded(exc: APIError) -> bool:
    """The publish was refused because another writer has written the subject since."""
    return exc.err_code == h.WRONG_LAST_SEQUENCE


async def take_over(js: JetStreamContext, old: str, rids: list[str], new: str) -> int:
    """Store a `Takeover` of `rids` on the old owner's round subject `old`: its sequence.
    Not fenced: wherever it lands, what the old owner stored before it is read, and its
    next round record (fenced on the sequence before) is refused."""
    payload = _msgpack.encode(Takeover(rids=rids, owner=new))
    headers = {h.KIND: h.KIND_TAKEOVER}
    ack = await bus.publish_stored(js, old, payload, headers, PUBLISH_WITHIN)
    return ack.seq


async def taken(js: JetStreamContext, subject: str, after: int) -> tuple[set[str], int]:
    """The requests taken over from the owner of round subject `subject` after `after`,
    and the sequence of the last record read (what the owner's next record is fenced on:
    a takeover stored since refuses it again)."""
    rids: set[str] = set()
    last = after
    async for msg in stored(js, subject, after):
        last = msg.seq or last
        rids.update(taken_rids(msg))
    return rids, last


def taken_rids(msg: Msg | RawStreamMsg) -> list[str]:
    """The requests a `Takeover` record names (none, for any other record)."""
    if (msg.headers or {}).get(h.KIND) != h.KIND_TAKEOVER:
        return []
    return _takeover.decode(msg.data or b"").rids


async def stored(
    js: JetStreamContext, subject: str, after: int = 0, before: int | None = None
) -> AsyncIterator[RawStreamMsg]:
    """A subject's records after stream sequence `after` (and before `before`), in order,
    by direct gets: rare reads (a takeover, a lost delivery) leave no consumer."""
    seq = after + 1
    while before is None or seq < before:
        try:
            msg = await js.get_msg(bus.OUT_STREAM, seq=seq, subject=subject, next=True)
        except NotFoundError:
            return
        assert msg.seq is not None  # a stored message has its sequence
        if before is not None and msg.seq >= before:
            return
        yield msg
        seq = msg.seq + 1


@dataclass
class Read:
    """A request's committed events, as its index and its owner's rounds hold them."""

    events: list[Delivered]  # every one, in `Tw-Seq` order from 1
    index_seq: int  # the index's last record's sequence (what its next record expects)
    indexed: int  # the last `Tw-Seq` the index holds
    owner: Pointer | None  # where the events after the index are
    tenant: str

    @property
    def ended(self) -> bool:
        return bool(self.events) and self.events[-1].terminal

    def add(self, events: Sequence[Delivered], rid: str) -> None:
        for event in events:
            if event.rid != rid or event.seq <= len(self.events):
                continue  # another request's, or held already (a segment repeats a round)
            if event.seq != len(self.events) + 1:
                log.error("ledger of %s: event %d after %d", rid, event.seq, len(self.events))
                continue
            self.events.append(event)


def events_of(rid: str, msg: Msg | RawStreamMsg) -> list[Delivered]:
    """A stored record's events (a round record's are many requests'; a takeover holds
    none); ValueError (or KeyError) when it is unreadable. An index record of the version
    before round records (no `Tw-Events`) holds one event, its payload as is and the rest
    in headers."""
    hdrs = msg.headers or {}
    kind = hdrs.get(h.KIND)
    if kind == h.KIND_TAKEOVER:
        return []
    if h.EVENTS in hdrs or kind == h.KIND_ROUND:
        try:
            return _records.decode(msg.data or b"").events
        except msgspec.DecodeError as exc:
            raise ValueError(f"unreadable ledger record: {exc}") from exc
    return [_legacy(rid, msg.data or b"", hdrs)]


def _legacy(rid: str, payload: bytes, hdrs: dict[str, str]) -> Delivered:
    kind, seq = hdrs.get(h.KIND, h.KIND_CHUNK), int(hdrs[h.SEQ])
    attempt = int(hdrs.get(h.ATTEMPT, 0))
    if kind == h.KIND_ERROR:
        status, after = int(hdrs.get(h.STATUS, 500)), int(hdrs.get(h.RETRY_AFTER, 0))
        return Failed(rid=rid, seq=seq, payload=payload, status=status, retry_after=after)
    ids = h.decode_tokens(hdrs.get(h.TOKENS, ""))
    state = h.decode_state(hdrs[h.STREAM_STATE]) if h.STREAM_STATE in hdrs else None
    variant = OUTPUTS.get(kind, Chunk)
    count = len(ids) or int(hdrs.get(h.TOKEN_COUNT, 0))
    return variant(
        rid=rid, seq=seq, payload=payload, attempt=attempt, tokens=count, ids=ids, state=state
    )


async def read(js: JetStreamContext, reply: str, rid: str) -> Read | None:
    """The request's committed events (None: nothing is stored)."""
    found = await read_index(js, reply, rid)
    if found is not None:
        await read_rounds(js, found, rid)
    return found


async def read_index(js: JetStreamContext, reply: str, rid: str) -> Read | None:
    """What the request's index holds (None: nothing), and where its owner goes on."""
    found = Read([], 0, 0, None, "")
    async for msg in stored(js, bus.out_subject(reply, rid)):
        hdrs = msg.headers or {}
        try:
            found.add(events_of(rid, msg), rid)
        except (KeyError, ValueError) as exc:
            log.error("ledger record %d of %s unreadable: %r", msg.seq, rid, exc)
        assert msg.seq is not None  # a stored message has its sequence
        found.index_seq, found.indexed = msg.seq, len(found.events)
        found.tenant = found.tenant or hdrs.get(h.TENANT, "")
        owner = hdrs.get(h.OWNER)
        found.owner = Pointer(owner, int(hdrs.get(h.OWNER_SEQ, 0))) if owner else None
    return found if found.index_seq else None


async def read_rounds(
    js: JetStreamContext, found: Read, rid: str, before: int | None = None
) -> None:
    """Add the request's events in its owner's round records after its index's last
    record, up to a takeover of it (or the round subject's sequence `before`)."""
    if found.owner is None or found.ended:
        return
    async for msg in stored(js, found.owner.subject, found.owner.after, before):
        if rid in taken_rids(msg):
            return  # nothing of it after this is its owner's to write
        found.add(events_of(rid, msg), rid)


@dataclass
class Committed:
    """What a request's ledger holds: where a new owner picks it up."""

    seq: int  # the last Tw-Seq
    index_seq: int  # the index's last record's sequence (what its next record expects)
    attempt: int  # the highest attempt
    ended: bool  # an end, a whole response or an error is stored: nothing is left to do
    state: bytes | None  # the last stream_state
    tokens: array  # every committed output token ID, in order
    last: Delivered | None  # the last event (None: from a hand-over)
    unindexed: list[Delivered]  # the events after the index's last record

    @classmethod
    def of(cls, found: Read) -> Committed:
        tokens, state, attempt = array("i"), None, 0
        for event in found.events:
            attempt = max(attempt, event.attempt)
            if not isinstance(event, Failed):
                tokens.extend(event.ids)
                state = event.state if event.state is not None else state
        return cls(
            seq=len(found.events),
            index_seq=found.index_seq,
            attempt=attempt,
            ended=found.ended,
            state=state,
            tokens=tokens,
            last=found.events[-1] if found.events else None,
            unindexed=found.events[found.indexed :],
        )


# The word a dead letter's reason starts with (`decode: ...`), what `tokenway dlq ls --reason`
# filters on: the message could not be read, or its deliveries ran out.
DEAD_REASONS = ("decode", "exhausted")
DeadReason = Literal["decode", "exhausted"]


def what_is_wrong(exc: Exception) -> str:
    """A failure to read a message, in words: `Identity.of`'s KeyError names a header."""
    if isinstance(exc, KeyError) and exc.args:
        return f"the {exc.args[0]} header is missing"
    return str(exc)


async def dead_letter(
    js: JetStreamContext, stage: str, msg: Msg, category: DeadReason, reason: str
) -> None:
    """Copy a message that cannot be processed to `TW_DLQ`, then terminate it."""
    letter = DeadLetter(
        stage=stage,
        subject=msg.subject,
        reason=f"{category}: {reason}",
        delivered=msg.metadata.num_delivered,
        headers=dict(msg.headers or {}),
        payload=msg.data,
        time=time.time(),
    )
    DEAD_LETTERS.labels(stage).inc()  # before its publish: a reader of TW_DLQ sees it counted
    await js.publish(bus.dlq_subject(stage), _json.encode(letter))
    log.warning("dead-lettered %s from %s: %s", msg.subject, stage, letter.reason)
    await msg.term()


def request_key(reply: str, rid: str) -> str:
    """A request's name where one name must do for its reply and its id together: the
    owner's table and the engines' work (a subject token, also in `tw.orphan.<key>` and in
    the request id vLLM runs it under). Whoever chose the id, no other request has the key:
    each job, each tenant's, picks its ids, and one reply is one job's."""
    return hashlib.blake2b(f"{reply} {rid}".encode(), digest_size=12).hexdigest()


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a request is, as the headers of its messages on `tw.render.*` / `tw.sched.*`
    say: its id, where its output goes, its deadline, and its API key's tenant."""

    rid: str
    reply: str
    deadline: float | None = None
    tenant: str = ""  # "" where the ingress asks for no key
    limits: Limits | None = None  # the tenant's, where it has any
    trace: str = ""  # its W3C `traceparent`, passed on to the engine
    # a batch job's: a full queue downstream is waited out (not its 429), and an owner's
    # line puts it behind interactive requests
    batch: bool = False

    @property
    def key(self) -> str:
        return request_key(self.reply, self.rid)

    def headers(self) -> dict[str, str]:
        # JetStream drops a message id it saw within its window, whatever the subject: the
        # id is the request's reply and rid, since each job (each tenant's) picks its rids.
        hdrs = {h.MSG_ID: f"{self.reply}.{self.rid}", h.RID: self.rid, h.REPLY: self.reply}
        if self.batch:
            hdrs[h.BATCH] = "1"
        if self.trace:
            hdrs[h.TRACEPARENT] = self.trace
        if self.deadline is not None:
            hdrs[h.DEADLINE] = f"{self.deadline:.3f}"
        if self.tenant:
            hdrs[h.TENANT] = self.tenant
        if self.limits:
            hdrs[h.LIMITS] = self.limits.header()
        return hdrs

    @classmethod
    def of(cls, msg: Msg) -> Identity:
        """KeyError when a header is missing, ValueError when the deadline or the limits
        are malformed, or when a tenant's client names a reply that is not the tenant's.

        On a tenant's batch lane (`bus.lane_tenant`) the subject says whose request it is,
        whatever the headers say: the tenant is the lane's, and there are no limits (those
        are the ingress's word for an API key's requests)."""
        hdrs = msg.headers or {}
        deadline, limits = hdrs.get(h.DEADLINE), hdrs.get(h.LIMITS)
        who = cls(
            hdrs[h.RID],
            hdrs[h.REPLY],
            float(deadline) if deadline else None,
            hdrs.get(h.TENANT, ""),
            Limits.parse(limits) if limits else None,
            hdrs.get(h.TRACEPARENT, ""),
            hdrs.get(h.BATCH) == "1",
        )
        tenant = bus.lane_tenant(msg.subject)
        if tenant is None:
            return who
        if not bus.owns_reply(tenant, who.reply):
            raise ValueError(
                f"tenant {tenant}'s client named the reply {who.reply!r}, not one "
                f"of its own ({bus.tenant_replies(tenant)})"
            )
        return replace(who, tenant=tenant, limits=None, batch=True)
