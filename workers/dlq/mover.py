"""The dead-letter mover: the server's max-deliveries advisories name a message no stage
could process; the mover copies it to `tw.dlq.<stage>` with the reason and deletes it from its
work queue. `tokenway dlq` (program.dlq) lists, replays and purges what it moved."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as jsapi
from nats.js.errors import NotFoundError

from tokenway import bus, ledger
from tokenway import headers as h
from tokenway.config import Settings
from tokenway.metrics import DEAD_LETTERS
from tokenway.wire import DeadLetter
from tokenway.worker import consume

log = logging.getLogger(__name__)

MOVER = "dlq-mover"
ADVISORIES = "$JS.EVENT.ADVISORY.CONSUMER.>"
MAX_DELIVERIES = "MAX_DELIVERIES"


class MaxDeliveries(msgspec.Struct):
    """The server's `io.nats.jetstream.advisory.v1.max_deliver` (the fields used here)."""

    stream: str
    consumer: str
    stream_seq: int
    deliveries: int


_json = msgspec.json.Encoder()
_advisory = msgspec.json.Decoder(MaxDeliveries)

# -- pure core --------------------------------------------------------------------------------


def stage_of(consumer: str) -> str:
    """`render-<model>` → `render`, `schedule-<model>` → `schedule`."""
    return bus.token(consumer.split("-", 1)[0])


def exhausted_letter(
    adv: MaxDeliveries, subject: str, headers: dict[str, str], payload: bytes, now: float
) -> DeadLetter:
    return DeadLetter(
        stage=stage_of(adv.consumer),
        subject=subject,
        reason=f"exhausted: max deliveries ({adv.deliveries}) exhausted",
        delivered=adv.deliveries,
        headers=headers,
        payload=payload,
        time=now,
    )


# -- the stage ----------------------------------------------------------------------------------


def mover_consumer(s: Settings) -> bus.ConsumerSpec:
    return bus.ConsumerSpec(
        stream=bus.ADVISORY_STREAM,
        durable=MOVER,
        filter_subject=ADVISORIES,
        handler="workers.dlq.mover.DlqMover",
        ack_wait=s.ack_wait,
        max_deliver=s.max_deliver,
        max_ack_pending=64,
    )


class DlqMover:
    """Copies each message whose deliveries ran out to `tw.dlq.<stage>`, then deletes it from
    its work queue (where it would otherwise stay, undeliverable, until max_age)."""

    name = "dlq"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.started = asyncio.Event()  # it moves dead letters

    async def run(self, nats_url: str, stop: asyncio.Event) -> None:
        nc = await bus.connect(nats_url, "tokenway-dlq", self.settings, stop=stop)
        js = nc.jetstream()
        self.started.set()
        await consume(js, mover_consumer(self.settings), lambda msg: self.handle(js, msg), stop)
        await bus.drain(nc)

    async def handle(self, js: JetStreamContext, msg: Msg) -> None:
        kind = msg.subject.split(".")[4] if msg.subject.count(".") >= 4 else ""
        if kind != MAX_DELIVERIES:  # MSG_TERMINATED: whoever terminated dead-lettered first
            await msg.ack()
            return
        try:
            adv = _advisory.decode(msg.data)
        except msgspec.DecodeError as exc:
            await ledger.dead_letter(js, self.name, msg, "decode", f"undecodable advisory: {exc}")
            return
        await move(js, adv)
        await msg.ack()


async def move(js: JetStreamContext, adv: MaxDeliveries) -> int | None:
    """The letter's id, or None when the original is already gone (moved, acked, expired).
    Safe to repeat: the DLQ publish is deduplicated by stream and sequence."""
    try:
        original = await js.get_msg(adv.stream, adv.stream_seq)
    except NotFoundError:
        log.info("%s #%d is already gone; nothing to move", adv.stream, adv.stream_seq)
        return None
    dead = exhausted_letter(
        adv, original.subject or "", dict(original.headers or {}), original.data or b"", time.time()
    )
    ack = await js.publish(
        bus.dlq_subject(dead.stage),
        _json.encode(dead),
        headers={h.MSG_ID: f"dlq:{adv.stream}:{adv.stream_seq}"},
    )
    info = await js.stream_info(adv.stream)
    if info.config.retention == jsapi.RetentionPolicy.WORK_QUEUE:
        try:
            await js.delete_msg(adv.stream, adv.stream_seq)
        except NotFoundError:
            pass  # deleted by a concurrent mover since we read it
    if not ack.duplicate:  # a repeated move is one letter
        DEAD_LETTERS.labels(dead.stage).inc()
    log.warning("dead-lettered %s from %s: %s", dead.subject, dead.stage, dead.reason)
    return ack.seq
