"""The shared shell of pull-consumer stages: fetch while running, hand each message over."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import nats.errors
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.errors import APIError

from tokenway import bus
from tokenway.aio import Signal, wait_any
from tokenway.errors import Overloaded, Unavailable

log = logging.getLogger(__name__)

# How long to wait for messages the consumer reported pending (they are normally there).
_DRAIN_WAIT = 0.05


def overloaded(stage: str) -> Overloaded:
    return Overloaded(f"the {stage} queue is full; retry later", code="queue_full")


async def enqueue(
    js: JetStreamContext,
    stage: str,
    subject: str,
    payload: bytes,
    headers: dict[str, str],
    within: float,
) -> None:
    """A request stored in `stage`'s queue (`bus.publish_stored`): a full queue is the
    client's 429, one that did not answer within `within` seconds a 503; anything else
    (a payload over the bus limit, another refusal) as it was raised."""
    try:
        await bus.publish_stored(js, subject, payload, headers, within)
    except nats.errors.Error as exc:
        if isinstance(exc, APIError) and bus.is_stream_full(exc):
            raise overloaded(stage) from exc
        if bus.transient(exc):
            raise Unavailable(f"the {stage} queue did not answer ({exc!r})") from exc
        raise


async def consume(
    js: JetStreamContext,
    spec: bus.ConsumerSpec,
    handle: Callable[[Msg], Awaitable[None]],
    stop: asyncio.Event,
    batch: Callable[[], int] = lambda: 32,
    freed: Signal | None = None,
    idle_timeout: float = 0.5,
) -> None:
    """Fetch from the stage's shared durable consumer until `stop`; a fetch timeout is idle.

    `batch()` is asked before every fetch: a stage with no capacity returns 0 and the
    loop waits for `freed` instead of pulling work it cannot start (pull-based backpressure).
    Messages are handled side by side, as tasks: one message's publish round trips overlap
    the next one's work, and a slow one (a huge prompt to tokenize) holds up nothing fetched
    after it. At most `batch()` are in hand at once; `stop` waits for them.
    """
    sub = await _subscribe(js, spec, stop, idle_timeout)
    if sub is None:
        return  # stopped before NATS let us subscribe
    failing = False  # logged once when fetching starts to fail, once when it works again
    handling: set[asyncio.Task[None]] = set()
    settled = Signal()  # a message was handled: there may be room to fetch

    def settle(task: asyncio.Task[None]) -> None:
        handling.discard(task)
        settled.fire()

    async with asyncio.TaskGroup() as group:  # on the way out, waits for what is in hand
        while not stop.is_set():
            waits = [settled.waiter(), *([freed.waiter()] if freed else [])]
            want = batch() - len(handling)
            if want <= 0:
                await wait_any(stop, *waits, timeout=idle_timeout)
                continue
            try:
                msgs = await _fetch(sub, want, idle_timeout)
            except nats.errors.Error as exc:  # NATS away, or the consumer has no leader or is gone
                if not failing:
                    log.warning("%s cannot fetch (%r); subscribing anew until it can",
                                spec.handler, exc)  # fmt: skip
                failing = True
                await wait_any(stop, timeout=idle_timeout)
                sub = await _resubscribe(js, spec, sub)
                continue
            if failing:
                log.warning("%s fetches again", spec.handler)
                failing = False
            for msg in msgs:
                task = group.create_task(_guarded(handle, msg, spec.handler))
                handling.add(task)
                task.add_done_callback(settle)
    with contextlib.suppress(nats.errors.Error):
        await sub.unsubscribe()


async def _subscribe(
    js: JetStreamContext, spec: bus.ConsumerSpec, stop: asyncio.Event, wait: float
) -> JetStreamContext.PullSubscription | None:
    """The stage's durable consumer and a subscription to it, tried again every `wait`
    while NATS or JetStream cannot answer; None if `stop` comes first."""
    while True:
        try:
            return await bus.pull(js, spec)
        except nats.errors.Error as exc:
            log.warning("%s cannot subscribe (%r); trying again", spec.handler, exc)
        await wait_any(stop, timeout=wait)
        if stop.is_set():
            return None


async def _resubscribe(
    js: JetStreamContext, spec: bus.ConsumerSpec, sub: JetStreamContext.PullSubscription
) -> JetStreamContext.PullSubscription:
    """The durable consumer made again if the server dropped it, and a new subscription to
    it; the old subscription while that cannot be done yet."""
    try:
        fresh = await bus.pull(js, spec)
    except nats.errors.Error:
        return sub
    with contextlib.suppress(nats.errors.Error):
        await sub.unsubscribe()
    return fresh


async def _guarded(handle: Callable[[Msg], Awaitable[None]], msg: Msg, stage: str) -> None:
    """A handler that fails (say, NATS went away mid-publish) costs one message, not the
    stage: the message stays un-acked, JetStream redelivers it, and max_deliver bounds the
    retries (the server's max-deliveries advisory lands in TW_ADVISORIES)."""
    try:
        await handle(msg)
    except Exception:
        log.exception("%s could not handle %s; it will be redelivered", stage, msg.subject)


async def _fetch(sub: JetStreamContext.PullSubscription, want: int, wait: float) -> list[Msg]:
    """The first message as soon as it is there, then whatever else is already waiting.

    nats.py's batch fetch holds a lone message until the batch fills or the pull expires;
    fetching one first, then exactly as many as the consumer says are pending, never does.
    """
    try:
        msgs = await sub.fetch(1, timeout=wait)
    except (TimeoutError, NatsTimeout):
        return []
    pending = msgs[0].metadata.num_pending
    if want > 1 and pending:
        try:
            msgs += await sub.fetch(min(want - 1, pending), timeout=_DRAIN_WAIT)
        except (TimeoutError, NatsTimeout, nats.errors.Error):
            pass  # another worker took them, or NATS went away: the next fetch tells
    return msgs
