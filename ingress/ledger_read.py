"""Reading a request's output back from the TW_OUT ledger (SSE resume after a lost ingress).

The only per-request JetStream consumer the ingress ever makes, and only for a client that
comes back: an ordered consumer on `tw.out.*.<rid>` that replays what is stored, then keeps
delivering what the owner still commits, until the stream's last event.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import nats.errors
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js import api as jsapi

from tokenway import bus
from tokenway import headers as h
from tokenway.output_router import Event, event_of


class LedgerRead:
    def __init__(
        self,
        js: JetStreamContext,
        sub: JetStreamContext.PushSubscription,
        idle_timeout: float,
        rid: str,
        first: Msg | None,
    ) -> None:
        self._js = js
        self._rid = rid
        self._sub = sub
        self._idle = idle_timeout
        self._first = first

    async def batches(self) -> AsyncIterator[list[Event]]:
        """Events in ledger order; ends when no more come within the idle timeout."""
        if self._first is not None and (event := event_of(self._rid, self._first)):
            yield [event]  # read while checking whose stream it is
        while True:
            try:
                msg = await self._sub.next_msg(timeout=self._idle)
            except (NatsTimeout, TimeoutError):
                return
            event = event_of(self._rid, msg)
            if event is not None:
                yield [event]

    async def close(self) -> None:
        """Unsubscribe, then delete the consumer (the server would keep it a while otherwise).

        The unsubscribe comes first because it ends before its first wait: a close cut short
        (a client that leaves cancels it) still leaves no subscription behind, which would
        fill with the ledger and hold the connection's drain at exit for 30 s."""
        with contextlib.suppress(nats.errors.Error):
            await self._sub.unsubscribe()
        with contextlib.suppress(nats.errors.Error):  # gone already, or NATS away: the
            info = await self._sub.consumer_info()  # server drops it without interest
            await self._js.delete_consumer(info.stream_name, info.name)


class LedgerReader:
    def __init__(self, js: JetStreamContext, idle_timeout: float) -> None:
        self.js = js
        self.idle_timeout = idle_timeout

    async def read_from(self, rid: str, tenant: str) -> LedgerRead | None:
        """A reader of the request's ledger, or None when nothing of it is stored for
        `tenant` (its messages name the tenant whose key made the request)."""
        sub = await self.js.subscribe(
            bus.out_subject("*", rid),
            stream=bus.OUT_STREAM,
            ordered_consumer=True,
            deliver_policy=jsapi.DeliverPolicy.ALL,
        )
        try:
            info = await sub.consumer_info()
        except BaseException:
            await sub.unsubscribe()  # (see close)
            raise
        # consumer_seq counts what this consumer delivered (stream_seq may have moved past
        # other requests' messages it skipped): nothing pending, nothing delivered = unknown.
        first = None
        assert info.delivered is not None  # the server reports it on every consumer
        if info.num_pending or info.delivered.consumer_seq or sub.pending_msgs:
            with contextlib.suppress(NatsTimeout, TimeoutError):
                first = await sub.next_msg(timeout=self.idle_timeout)
        reader = LedgerRead(self.js, sub, self.idle_timeout, rid, first)
        if first is None or (first.headers or {}).get(h.TENANT, "") != tenant:
            await reader.close()
            return None
        return reader
