"""The shared shell of pull-consumer stages: fetch while running, hand each message over."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import APIError

from tokenway import bus
from tokenway.aio import Signal, wait_any
from tokenway.errors import Overloaded, Unavailable

log = logging.getLogger(__name__)


# How long to wait for messages the consumer reported pending (they are normally there).
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


@dataclass(frozen=True)
class Behind:
    """A stage's second queue (the batch lane): fetched from only while the first has
    nothing waiting, at most `most()` of its messages in hand at once."""

    spec: bus.ConsumerSpec
    most: Callable[[], int]


async def consume(
    js: JetStreamContext,
    spec: bus.ConsumerSpec,
    handle: Callable[[Msg], Awaitable[None]],
    stop: asyncio.Event,
    batch: Callable[[], int] = lambda: 32,
    freed: Signal | None = None,
    idle_timeout: float = 0.5,
    behind: Behind | None = None,
) -> None:
    """Fetch from the stage's shared durable consumer until `stop`; a fetch timeout is idle.

    `batch()` is asked before every fetch: a stage with no capacity returns 0 and the
    loop waits for `freed` instead of pulling work it cannot start (pull-based backpressure).
    Messages are handled side by side, as tasks: one message's publish round trips overlap
    the next one's work, and a slow one (a huge prompt to tokenize) holds up nothing fetched
    after it. At most `batch()` are in hand at once; `stop` waits for them.

    A `behind` queue shares that capacity: its messages are fetched only while the first
    queue has none waiting, so they never delay the first one's by more than what is in hand.
    """
    first = _Queue(spec)
    queues = [first] if behind is None else [first, _Queue(behind.spec, behind.most)]
    async with asyncio.TaskGroup() as group:  # on the way out, waits for what is in hand
        stage = _Stage(group, handle, batch, freed, idle_timeout, first)
        async with asyncio.TaskGroup() as drains:
            for queue in queues:
                drains.create_task(stage.drain(js, queue, stop))


@dataclass
class _Queue:
    spec: bus.ConsumerSpec
    most: Callable[[], int] | None = None  # a queue behind: at most this many in hand
    in_hand: int = 0
    waiting: int = 0  # messages it had waiting after its last fetch


class _Stage:
    """What a stage's queues share: its capacity, the handlers in hand, when one settled."""

    def __init__(
        self,
        group: asyncio.TaskGroup,
        handle: Callable[[Msg], Awaitable[None]],
        batch: Callable[[], int],
        freed: Signal | None,
        idle: float,
        first: _Queue,
    ) -> None:
        self.group = group
        self.handle = handle
        self.batch = batch
        self.freed = freed
        self.idle = idle
        self.first = first
        self.handling: set[asyncio.Task[None]] = set()
        self.settled = Signal()  # a message was handled, or the first queue's backlog changed

    def want(self, queue: _Queue) -> int:
        room = self.batch() - len(self.handling)
        if queue.most is None:
            return room
        return 0 if self.first.waiting else min(room, queue.most() - queue.in_hand)

    async def drain(self, js: JetStreamContext, queue: _Queue, stop: asyncio.Event) -> None:
        spec = queue.spec
        sub = await _subscribe(js, spec, stop, self.idle)
        if sub is None:
            return  # stopped before NATS let us subscribe
        failing = False  # logged once when fetching starts to fail, once when it works again
        while not stop.is_set():
            waits = [self.settled.waiter(), *([self.freed.waiter()] if self.freed else [])]
            want = self.want(queue)
            if want <= 0:
                await wait_any(stop, *waits, timeout=self.idle)
                continue
            try:
                msgs = await bus.fetch(sub, want, self.idle)
            except nats.errors.Error as exc:  # NATS away, or the consumer has no leader or is gone
                if not failing:
                    log.warning(
                        "%s cannot fetch (%r); subscribing anew until it can", spec.handler, exc
                    )
                failing = True
                await wait_any(stop, timeout=self.idle)
                sub = await _resubscribe(js, spec, sub)
                continue
            if failing:
                log.warning("%s fetches again", spec.handler)
                failing = False
            waiting = msgs[-1].metadata.num_pending if msgs else 0
            if waiting != queue.waiting:
                queue.waiting = waiting
                self.settled.fire()
            for msg in msgs:
                self._start(queue, msg)
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()

    def _start(self, queue: _Queue, msg: Msg) -> None:
        task = self.group.create_task(_guarded(self.handle, msg, queue.spec.handler))
        self.handling.add(task)
        queue.in_hand += 1

        def settle(task: asyncio.Task[None]) -> None:
            self.handling.discard(task)
            queue.in_hand -= 1
            self.settled.fire()

        task.add_done_callback(settle)


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
