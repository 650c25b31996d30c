"""Publishing to `TW_OUT` (the committed ledger) and `TW_DLQ`, with the headers they carry.

Whoever stores a ledger message delivers it, once its publish is acknowledged, to the live
readers of its reply subject (`Delivery` on `tw.sse.<reply>`): the client never sees what is
not stored, and a reader gets one message per round of commits instead of one per chunk.
"""

from __future__ import annotations

import hashlib
import logging
import time
from array import array
from collections.abc import AsyncIterator
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
from tokenway.wire import OUTPUTS, DeadLetter, Delivered, Delivery, ErrorInfo, Failed

log = logging.getLogger(__name__)

_json = msgspec.json.Encoder()
_delivery = msgspec.msgpack.Encoder()

PUBLISH_WITHIN = 10.0  # seconds a ledger publish keeps trying (a server restart takes ~1)


def out_headers(
    rid: str,
    seq: int,
    kind: str,
    *,
    attempt: int | None = None,
    state: bytes | None = None,
    tokens: list[int] | None = None,
    status: int | None = None,
    retry_after: int = 0,
    after: int | None = None,
    tenant: str = "",
    reply: str = "",
) -> dict[str, str]:
    """`after`: the stream sequence of the request's last ledger message as its owner knows
    it; a publish from an owner that lost the request (another one published since) fails.
    `tenant`: whose request it is, for whoever reads the ledger back for a client. `reply`:
    where its output goes, which with the rid names an unfenced message for JetStream's
    de-duplication (a direct publisher picks its rids: another job's may be the same).

    A fenced message carries no `Nats-Msg-Id`: the fence already refuses it sent twice (a
    retry is told stored by `already_stored`), and the server would keep every id of the
    hot path in memory for the window. Without it, nats-server spends 13-25% less CPU per
    record at 16-64 records a round (docs/design-notes.md)."""
    # Lean: every header costs the ingress parsing time, and the subject names the rid.
    hdrs = {h.SEQ: str(seq)}
    if after is not None:
        hdrs[h.EXPECTED_LAST_SUBJECT_SEQ] = str(after)
    else:
        hdrs[h.MSG_ID] = f"{reply}.{rid}:{seq}"
    if kind != h.KIND_CHUNK:
        hdrs[h.KIND] = kind
    if attempt is not None:
        hdrs[h.ATTEMPT] = str(attempt)
    if state is not None:
        hdrs[h.STREAM_STATE] = h.encode_state(state)
    if tokens and kind == h.KIND_RESPONSE:
        # Terminal: nothing resumes from its IDs, and JetStream holds no more than 64 KiB
        # of headers (~10k IDs); the count is what readers use.
        hdrs[h.TOKEN_COUNT] = str(len(tokens))
    elif tokens:
        hdrs[h.TOKENS] = h.encode_tokens(tokens)
    if status is not None:
        hdrs[h.STATUS] = str(status)
    if retry_after:
        hdrs[h.RETRY_AFTER] = str(retry_after)
    if tenant:
        hdrs[h.TENANT] = tenant
    return hdrs


async def publish_error(
    nc: NATS,
    reply: str,
    rid: str,
    seq: int,
    info: ErrorInfo,
    after: int | None = None,
    tenant: str = "",
) -> None:
    """An error event for the client; the stream (or response) ends with it."""
    hdrs = out_headers(
        rid,
        seq,
        h.KIND_ERROR,
        status=info.status,
        retry_after=info.retry_after,
        after=after,
        tenant=tenant,
        reply=reply,
    )
    await commit(
        nc,
        reply,
        rid,
        seq,
        h.KIND_ERROR,
        error_body(info),
        hdrs,
        status=info.status,
        retry_after=info.retry_after,
    )


async def commit(
    nc: NATS,
    reply: str,
    rid: str,
    seq: int,
    kind: str,
    payload: bytes,
    headers: dict[str, str],
    *,
    status: int = 200,
    retry_after: int = 0,
    tokens: int = 0,
) -> PubAck:
    """One ledger message stored (retried while NATS comes back), then delivered live."""
    ack = await publish(
        nc.jetstream(), bus.out_subject(reply, rid), payload, headers, within=PUBLISH_WITHIN
    )
    event = _event(kind, rid, seq, ack.seq, payload, status, retry_after, tokens)
    await deliver(nc, reply, [event])
    return ack


def _event(
    kind: str,
    rid: str,
    seq: int,
    stream_seq: int,
    payload: bytes,
    status: int,
    retry_after: int,
    tokens: int,
) -> Delivered:
    """A message stored with `Tw-Kind` `kind` as its variant (an unknown kind, which no
    writer stores, passes as a chunk)."""
    if kind == h.KIND_ERROR:
        return Failed(
            rid=rid,
            seq=seq,
            stream_seq=stream_seq,
            payload=payload,
            status=status,
            retry_after=retry_after,
        )
    variant = OUTPUTS.get(kind, OUTPUTS[h.KIND_CHUNK])
    return variant(rid=rid, seq=seq, stream_seq=stream_seq, payload=payload, tokens=tokens)


async def deliver(nc: NATS, reply: str, events: list[Delivered]) -> None:
    """What was just stored for `reply`, to whoever streams it live (core NATS: a lost
    delivery shows as a gap in `Tw-Seq`, or as nothing at a stream's end, and the reader
    reads the ledger back)."""
    await nc.publish(bus.sse_subject(reply), _delivery.encode(Delivery(events=events)))


async def publish(
    js: JetStreamContext, subject: str, payload: bytes, headers: dict[str, str], within: float
) -> PubAck:
    """Store one ledger message, retrying while NATS or the stream comes back (a restart).

    Safe to retry: the server checks the fence (the expected last subject sequence) before
    the message id, so a publish that was stored but not answered is refused as superseded
    when sent again; it is told apart from another owner's by being the subject's last
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
    """The publish was refused because another owner has written the request's ledger."""
    return exc.err_code == h.WRONG_LAST_SEQUENCE


@dataclass
class Committed:
    """What a request's ledger holds: where a new owner picks it up."""

    seq: int  # the last Tw-Seq
    stream_seq: int  # the last message's sequence in TW_OUT (what the next publish expects)
    attempt: int  # the highest Tw-Attempt
    ended: bool  # an end, a whole response or an error is stored: nothing is left to do
    state: bytes | None  # the last stream_state
    tokens: array  # every committed output token ID, in order
    last: Delivered | None  # the last message, as delivered (None: from a hand-over)


async def stored(
    js: JetStreamContext, subject: str, after: int = 0, before: int | None = None
) -> AsyncIterator[RawStreamMsg]:
    """A request's ledger messages after stream sequence `after` (and before `before`), in
    order, by direct gets: rare reads (a takeover, a lost delivery) leave no consumer."""
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


async def read_back(js: JetStreamContext, reply: str, rid: str) -> Committed | None:
    """The request's committed output, or None when nothing of it is stored."""
    found = None
    async for msg in stored(js, bus.out_subject(reply, rid)):
        hdrs = msg.headers or {}
        try:
            last = delivered(rid, msg)
        except (KeyError, ValueError):
            log.error("ledger message %d of %s has no valid %s header", msg.seq, rid, h.SEQ)
            continue
        assert msg.seq is not None  # a stored message has its sequence
        found = found or Committed(0, 0, 0, ended=False, state=None, tokens=array("i"), last=last)
        found.stream_seq, found.seq, found.last = msg.seq, last.seq, last
        found.attempt = max(found.attempt, int(hdrs.get(h.ATTEMPT, 0)))
        found.ended = last.terminal
        if h.STREAM_STATE in hdrs:
            found.state = h.decode_state(hdrs[h.STREAM_STATE])
        found.tokens.extend(h.decode_tokens(hdrs.get(h.TOKENS, "")))
    return found


def delivered(rid: str, msg: Msg | RawStreamMsg) -> Delivered:
    """A stored ledger message (read back by a direct get, or from a consumer) as delivered
    live; KeyError or ValueError when its `Tw-Seq` is missing or not a number."""
    hdrs = msg.headers or {}
    if isinstance(msg, RawStreamMsg):
        stream_seq = msg.seq or 0
    else:
        stream_seq = msg.metadata.sequence.stream
    return _event(
        hdrs.get(h.KIND, h.KIND_CHUNK),
        rid,
        int(hdrs[h.SEQ]),
        stream_seq,
        msg.data or b"",
        status=int(hdrs.get(h.STATUS, 200)),
        retry_after=int(hdrs.get(h.RETRY_AFTER, 0)),
        tokens=h.count_tokens(hdrs.get(h.TOKENS, "")) or int(hdrs.get(h.TOKEN_COUNT, 0)),
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
