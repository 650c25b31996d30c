"""Reading ledgers on `TW_OUT` through a consumer of one's own, as a direct client does.

The consumer is named, so JetStream's create call carries the subject it reads
(`$JS.API.CONSUMER.CREATE.TW_OUT.<name>.<subject>`): a tenant's client is allowed to make
one on its own ledgers only (`tokenway.roles`). It is pulled without acks, in memory, one
replica, and the server removes it once nobody pulls from it; one whose server forgot it
(a restart, a long disconnect) is made again from the message after the last one read.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncGenerator

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

from tokenway import bus

IDLE = 30.0  # seconds the server keeps a consumer nobody pulls from
_WAIT = 5.0  # seconds one pull waits for messages
_BATCH = 256
_AGAIN = 0.5  # seconds between tries to make the consumer again while JetStream cannot
# A pull's answers for a consumer the server does not have (or cannot answer for now).
_FORGOTTEN = (NotFoundError, ServiceUnavailableError, nats.errors.NoRespondersError)


class Reader:
    """The messages of `TW_OUT` under `subject` (a wildcard reads many ledgers), in stream
    order, from where `policy` starts."""

    def __init__(self, js: JetStreamContext, subject: str, policy: DeliverPolicy) -> None:
        self.js = js
        self.subject = subject
        self.policy = policy
        self.name = ""
        self.last = 0  # the stream sequence of the last message read
        self._sub: JetStreamContext.PullSubscription | None = None

    async def open(self) -> int:
        """Make the consumer; how many messages it holds for us already."""
        config = ConsumerConfig(
            name=f"read{secrets.token_hex(8)}",
            filter_subject=self.subject,
            ack_policy=AckPolicy.NONE,
            inactive_threshold=IDLE,
            num_replicas=1,
            mem_storage=True,
            **(
                {"deliver_policy": DeliverPolicy.BY_START_SEQUENCE, "opt_start_seq": self.last + 1}
                if self.last
                else {"deliver_policy": self.policy}
            ),
        )
        info = await self.js.add_consumer(bus.OUT_STREAM, config)
        self.name = info.name
        self._sub = await self.js.pull_subscribe_bind(self.name, bus.OUT_STREAM)
        return info.num_pending or 0  # (nats-py's field is optional)

    async def close(self) -> None:
        if self._sub is None:
            return
        sub, self._sub = self._sub, None
        try:
            await sub.unsubscribe()
            await self.js.delete_consumer(bus.OUT_STREAM, self.name)
        except (nats.errors.Error, APIError):
            pass  # gone already, or NATS away: the server removes it once idle

    async def _reopen(self) -> None:
        """The consumer made again from the message after the last one read, tried again
        while JetStream cannot answer (a leader elected, a server back)."""
        await self.close()
        while True:
            try:
                await self.open()
                return
            except (nats.errors.Error, APIError):
                await asyncio.sleep(_AGAIN)

    async def messages(self) -> AsyncGenerator[Msg, None]:
        """Every message from the start, then each one as it is stored, for as long as the
        caller reads (open first)."""
        while True:
            assert self._sub is not None, "open the reader first"
            try:
                batch = await bus.fetch(self._sub, _BATCH, _WAIT)  # [] when nothing is new
            except _FORGOTTEN:
                await self._reopen()
                continue
            for msg in batch:
                self.last = msg.metadata.sequence.stream
                yield msg
