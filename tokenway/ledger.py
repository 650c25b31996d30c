"""Publishing to `TW_OUT` (the committed ledger) and `TW_DLQ`, with the headers they carry."""

from __future__ import annotations

import logging
import time

import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from tokenway import bus
from tokenway import headers as h
from tokenway.errors import error_body
from tokenway.wire import DeadLetter, ErrorInfo

log = logging.getLogger(__name__)

_json = msgspec.json.Encoder()


def out_headers(
    rid: str,
    seq: int,
    kind: str,
    *,
    attempt: int | None = None,
    state: bytes | None = None,
    tokens: list[int] | None = None,
    status: int | None = None,
) -> dict[str, str]:
    # Lean: every header costs the ingress parsing time, and the subject names the rid.
    hdrs = {h.MSG_ID: f"{rid}:{seq}", h.SEQ: str(seq)}
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
    js: JetStreamContext, reply: str, rid: str, seq: int, info: ErrorInfo
) -> None:
    """An error event for the client; the stream (or response) ends with it."""
    await js.publish(
        bus.out_subject(reply, rid),
        error_body(info),
        headers=out_headers(rid, seq, h.KIND_ERROR, status=info.status),
    )


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
