"""Reading a request's output back from the TW_OUT ledger (SSE resume after a lost ingress).

The only per-request reader the ingress ever makes, and only for a client that comes back:
a `ledger_follow.Follow` on `tw.out.*.<rid>` that replays what is stored, then keeps giving
what the owner still commits, until the stream's last event.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from nats.js import JetStreamContext

from tokenway import bus
from tokenway.ledger_follow import Follow
from tokenway.output_router import Event


class LedgerRead:
    def __init__(self, follow: Follow, idle_timeout: float) -> None:
        self._follow = follow
        self._idle = idle_timeout

    async def batches(self) -> AsyncIterator[list[Event]]:
        """Events in ledger order; ends when no more come within the idle timeout."""
        events = self._follow.events()
        try:
            while True:
                try:
                    async with asyncio.timeout(self._idle):
                        batch = await anext(events)
                except (TimeoutError, StopAsyncIteration):
                    return
                yield batch
        finally:
            await events.aclose()

    async def close(self) -> None:
        """Its consumers go (the server would keep them a while otherwise)."""
        await self._follow.close()


class LedgerReader:
    def __init__(self, js: JetStreamContext, idle_timeout: float) -> None:
        self.js = js
        self.idle_timeout = idle_timeout

    async def read_from(self, rid: str, tenant: str) -> LedgerRead | None:
        """A reader of the request's ledger, or None when nothing of it is stored for
        `tenant` (its records name the tenant whose key made the request)."""
        follow = Follow(self.js, bus.out_subject("*", rid), rid)
        try:
            found = await follow.open()
            if found:
                await follow.first()
        except BaseException:
            await follow.close()
            raise
        if not found or follow.tenant != tenant:
            await follow.close()
            return None
        return LedgerRead(follow, self.idle_timeout)
