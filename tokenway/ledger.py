"""Publishing to `TW_OUT` (the committed ledger) and `TW_DLQ`, with the headers they carry."""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import PubAck, RawStreamMsg
from nats.js.errors import APIError, NotFoundError
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_exponential

from tokenway import bus
from tokenway import headers as h
from tokenway.errors import error_body
from tokenway.wire import DeadLetter, ErrorInfo

log = logging.getLogger(__name__)

_json = msgspec.json.Encoder()

PUBLISH_WITHIN = 10.0  # seconds a ledger publish keeps trying (a server restart takes ~1)
PUBLISH_TRY = 2.0


def out_headers(
    rid: str,
    seq: int,
    kind: str,
    *,
    attempt: int | None = None,
    state: bytes | None = None,
    tokens: list[int] | None = None,
    status: int | None = None,
    after: int | None = None,
) -> dict[str, str]:
    """`after`: the stream sequence of the request's last ledger message as its owner knows
    it; a publish from an owner that lost the request (another one published since) fails."""
    # Lean: every header costs the ingress parsing time, and the subject names the rid.
    hdrs = {h.MSG_ID: f"{rid}:{seq}", h.SEQ: str(seq)}
    if after is not None:
        hdrs[h.EXPECTED_LAST_SUBJECT_SEQ] = str(after)
    if kind != h.KIND_CHUNK:
        hdrs[h.KIND] = kind
    if attempt is not None:
        hdrs[h.ATTEMPT] = str(attempt)
    if state is not None:
        hdrs[h.STREAM_STATE] = h.encode_state(state)
    if tokens:
        hdrs[h.TOKENS] = h.encode_tokens(tokens)
    if status is not None:
        hdrs[h.STATUS] = str(status)
    return hdrs


async def publish_error(
    js: JetStreamContext,
    reply: str,
    rid: str,
    seq: int,
    info: ErrorInfo,
    after: int | None = None,
) -> None:
    """An error event for the client; the stream (or response) ends with it."""
    await publish(
        js,
        bus.out_subject(reply, rid),
        error_body(info),
        out_headers(rid, seq, h.KIND_ERROR, status=info.status, after=after),
        within=PUBLISH_WITHIN,
    )


def transient(exc: BaseException) -> bool:
    """NATS away, or the stream not back yet; a refusal (an API error) is an answer."""
    return isinstance(exc, nats.errors.Error) and not isinstance(exc, APIError)


async def publish(
    js: JetStreamContext, subject: str, payload: bytes, headers: dict[str, str], within: float
) -> PubAck:
    """Store one ledger message, retrying while NATS or the stream comes back (a restart).

    Safe to retry: a publish that was stored but not answered is a duplicate by its message
    id, which the server checks before the fence (the expected last subject sequence).
    """
    try:  # the usual case, without the cost of a retry loop
        return await js.publish(subject, payload, headers=headers, timeout=PUBLISH_TRY)
    except nats.errors.Error as exc:
        if not transient(exc):
            raise
        log.warning("ledger publish on %s failed (%r); retrying", subject, exc)
    retrying = AsyncRetrying(
        stop=stop_after_delay(within),
        wait=wait_exponential(multiplier=0.05, max=1.0),
        retry=retry_if_exception(transient),
        reraise=True,
    )
    async for attempt in retrying:
        with attempt:
            return await js.publish(subject, payload, headers=headers, timeout=PUBLISH_TRY)
    raise AssertionError("unreachable: tenacity reraises")


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


_ENDS = (h.KIND_END, h.KIND_RESPONSE, h.KIND_ERROR)


async def stored(
    js: JetStreamContext, subject: str, after: int = 0, before: int | None = None
) -> AsyncIterator[RawStreamMsg]:
    """A request's ledger messages after stream sequence `after` (and before `before`), in
    order, by direct gets: rare reads (a takeover, a lost republish) leave no consumer."""
    seq = after + 1
    while before is None or seq < before:
        try:
            msg = await js.get_msg(bus.OUT_STREAM, seq=seq, subject=subject, next=True)
        except NotFoundError:
            return
        if before is not None and msg.seq >= before:
            return
        yield msg
        seq = msg.seq + 1


async def read_back(js: JetStreamContext, reply: str, rid: str) -> Committed | None:
    """The request's committed output, or None when nothing of it is stored."""
    found = None
    async for msg in stored(js, bus.out_subject(reply, rid)):
        found = found or Committed(0, 0, 0, ended=False, state=None, tokens=array("i"))
        found.stream_seq = msg.seq
        hdrs = msg.headers or {}
        found.seq = int(hdrs.get(h.SEQ, found.seq))
        found.attempt = max(found.attempt, int(hdrs.get(h.ATTEMPT, 0)))
        found.ended = hdrs.get(h.KIND, h.KIND_CHUNK) in _ENDS
        if h.STREAM_STATE in hdrs:
            found.state = h.decode_state(hdrs[h.STREAM_STATE])
        found.tokens.extend(h.decode_tokens(hdrs.get(h.TOKENS, "")))
    return found


async def dead_letter(js: JetStreamContext, stage: str, msg: Msg, reason: str) -> None:
    """Copy a message that cannot be processed to `TW_DLQ`, then terminate it."""
    letter = DeadLetter(
        stage=stage,
        subject=msg.subject,
        reason=reason,
        delivered=msg.metadata.num_delivered,
        headers=dict(msg.headers or {}),
        payload=msg.data,
        time=time.time(),
    )
    await js.publish(bus.dlq_subject(stage), _json.encode(letter))
    log.warning("dead-lettered %s from %s: %s", msg.subject, stage, reason)
    await msg.term()


def request_headers(
    rid: str, reply: str, deadline: float | None = None, msg_id: str | None = None
) -> dict[str, str]:
    """Headers of a request on `tw.render.*` / `tw.sched.*`."""
    hdrs = {h.MSG_ID: msg_id or rid, h.RID: rid, h.REPLY: reply}
    if deadline is not None:
        hdrs[h.DEADLINE] = f"{deadline:.3f}"
    return hdrs


def request_identity(msg: Msg) -> tuple[str, str, float | None]:
    """(rid, reply, deadline) of a request message; KeyError when a header is missing."""
    hdrs = msg.headers or {}
    deadline = hdrs.get(h.DEADLINE)
    return hdrs[h.RID], hdrs[h.REPLY], float(deadline) if deadline else None
