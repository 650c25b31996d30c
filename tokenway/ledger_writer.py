"""Many fenced `TW_OUT` publishes at once, at a fraction of nats-py's per-publish cost.

`js.publish` makes every publish a request of its own: a reply token, a future, a timer, the
ack parsed into a dataclass. An owner commits one message per request on every engine step,
so that cost is paid per token. Here a round of publishes shares one wildcard ack
subscription, one wait and one timeout, and each ack is decoded by msgspec. Measured on this
machine for 64 fenced publishes at a time: 35 µs of client CPU per message against 100 with
`js.publish` (the server's share, about 25 µs, is the same).

What is not answered within the round's wait (NATS away, a stream leader moving) is tried
again one by one with `ledger.publish` and its back-off: a publish that was stored but not
answered is then a duplicate by its `Nats-Msg-Id`, which the server checks before the fence.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import APIError

from tokenway import ledger

log = logging.getLogger(__name__)

# One ledger message: its subject, payload and headers.
Entry = tuple[str, bytes, dict[str, str]]
# Per entry: its sequence in TW_OUT, or why it was not stored.
Outcome = int | BaseException


class _Ack(msgspec.Struct):
    seq: int = 0
    error: dict[str, object] | None = None


_ack_decoder = msgspec.json.Decoder(_Ack)


def _refusal(error: dict[str, object]) -> APIError:
    try:
        APIError.from_error(error)  # raises the subclass for the code
    except APIError as exc:
        return exc
    raise AssertionError("unreachable: from_error always raises")


class LedgerWriter:
    def __init__(self, nc: NATS, js: JetStreamContext) -> None:
        self.nc = nc
        self.js = js
        self._prefix = ""
        self._next = 0
        self._waiting: dict[int, asyncio.Future[Outcome]] = {}

    async def start(self) -> None:
        self._prefix = self.nc.new_inbox() + "."
        await self.nc.subscribe(self._prefix + "*", cb=self._on_ack)

    async def _on_ack(self, msg: Msg) -> None:
        waiter = self._waiting.pop(int(msg.subject[len(self._prefix) :]), None)
        if waiter is None or waiter.done():
            return  # answered after its round gave up on it
        if not msg.data:  # a status message: no stream took the subject (yet)
            waiter.set_result(nats.errors.NoRespondersError())
            return
        try:
            ack = _ack_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            waiter.set_result(nats.errors.Error(f"unreadable publish ack: {exc}"))
            return
        waiter.set_result(_refusal(ack.error) if ack.error is not None else ack.seq)

    async def store(self, entries: Sequence[Entry]) -> list[Outcome]:
        """Publish every entry, side by side, and wait for their acks together."""
        loop = asyncio.get_running_loop()
        ids = []
        for subject, payload, headers in entries:
            self._next += 1
            self._waiting[self._next] = loop.create_future()
            ids.append(self._next)
            await self.nc.publish(
                subject, payload, reply=f"{self._prefix}{self._next}", headers=headers
            )
        waiters = [self._waiting[i] for i in ids]
        await asyncio.wait(waiters, timeout=ledger.PUBLISH_TRY)
        outcomes: list[Outcome] = []
        for i, waiter, entry in zip(ids, waiters, entries, strict=True):
            self._waiting.pop(i, None)
            outcome = waiter.result() if waiter.done() else None
            if outcome is None or ledger.transient(outcome):
                waiter.cancel()
                outcome = await self._again(entry, outcome)
            outcomes.append(outcome)
        return outcomes

    async def _again(self, entry: Entry, why: Outcome | None) -> Outcome:
        subject, payload, headers = entry
        log.warning("ledger publish on %s not answered (%r); retrying", subject, why)
        try:
            ack = await ledger.publish(self.js, subject, payload, headers, ledger.PUBLISH_WITHIN)
        except (APIError, nats.errors.Error) as exc:
            return exc
        return ack.seq
