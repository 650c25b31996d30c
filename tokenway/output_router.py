"""Output reassembly: one subscription per process, committed chunks routed to requests by id.

Every writer of the `TW_OUT` ledger delivers what it just stored for this reader (an ingress,
or a schedule worker's fan-out reading its children's output) as one `Delivery` message on
`tw.sse.<ingress>` (a round of commits: many requests' chunks at once); this process
subscribes to it once and drops each event into its request's slot. A slot is a small queue
plus an event; a writer that fell behind takes everything queued at once. Deliveries are core
NATS: what a reconnect (or a writer's death) loses shows as a gap in `Tw-Seq` (or, at a
stream's tail, as nothing), and is read back from the ledger (`ledger.read`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from tokenway import bus, ledger
from tokenway.errors import error_body
from tokenway.wire import Delivered, Delivery, ErrorInfo, Failed

log = logging.getLogger(__name__)

# One committed ledger message of a request, as its readers get it.
Event = Delivered
_delivery = msgspec.msgpack.Decoder(Delivery)
_REFILL_RETRY = 0.2  # seconds between reads of a spilled stream's ledger while NATS is away


class _Rid(msgspec.Struct):
    rid: str


class _Rids(msgspec.Struct):
    """Whose events a delivery this process cannot read holds (a writer of another version,
    during an upgrade): those requests read their ledgers back instead."""

    events: list[_Rid]


_rids = msgspec.msgpack.Decoder(_Rids)


class Slot:
    """`limit`: payload bytes it queues for a reader that fell behind. Past it, the slot
    spills: it drops what is delivered live and, once its reader has taken what it holds,
    reads the next events back from the ledger (`refill`), a limit's worth at a time, until
    it has caught up. A slow client costs the ingress its limit, not its whole stream."""

    def __init__(self, limit: int | None = None) -> None:
        self.events: deque[Event] = deque()
        self.arrived = asyncio.Event()
        self.last_seq = 0
        self.abandoned = False  # its client left: waiting for more ends
        self.limit = limit
        self.queued = 0  # payload bytes in `events`
        self.spilled = False  # over the limit: what follows is read back, not kept live
        self.refill: Callable[[], Awaitable[None]] | None = None

    def put(self, event: Event) -> None:
        if event.seq <= self.last_seq or self.spilled:
            return  # a duplicate delivery of something already queued, or read back later
        self.keep(event)

    def keep(self, event: Event) -> None:
        """Queue the event, spilled or not (a read-back, or the ingress's own last word)."""
        if event.seq != self.last_seq + 1:
            log.warning("gap in output: seq %d after %d", event.seq, self.last_seq)
        self.last_seq = event.seq
        self.events.append(event)
        self.queued += len(event.payload)
        if self.limit is not None and self.queued > self.limit:
            self.spilled = True
        self.arrived.set()

    def cut(self, error: bytes) -> None:
        """Ends the stream here with `error` (an error body): its writer is going away."""
        event = Failed(rid="", seq=self.last_seq + 1, payload=error, status=503)
        self.keep(event)

    def abandon(self) -> None:
        self.abandoned = True
        self.arrived.set()

    async def _wait(self) -> None:
        while not self.events and not self.abandoned:
            if self.spilled and self.refill is not None:
                await self.refill()
                continue
            self.arrived.clear()
            await self.arrived.wait()

    async def take_one(self) -> Event | None:
        """The next event; None once the slot is abandoned."""
        await self._wait()
        if self.abandoned:
            return None
        event = self.events.popleft()
        self.queued -= len(event.payload)
        return event

    async def take(self) -> list[Event]:
        """Everything queued, waiting for at least one; nothing once abandoned."""
        await self._wait()
        if self.abandoned:
            return []
        batch = list(self.events)
        self.events.clear()
        self.queued = 0
        return batch


class OutputRouter:
    """`slot_limit`: the byte limit of the slots it makes (`Slot`); None: unbounded."""

    def __init__(self, nc: NATS, ingress_id: str, slot_limit: int | None = None) -> None:
        self.nc = nc
        self.ingress_id = ingress_id
        self.slot_limit = slot_limit
        self.js = nc.jetstream()
        self.slots: dict[str, Slot] = {}
        self.idle = asyncio.Event()  # set while no request is open
        self.idle.set()
        self._sub: Subscription | None = None
        self._background: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(bus.sse_subject(self.ingress_id), cb=self._on_msg)
        # A subscription is only surely known to the server after a round trip; one made
        # while NATS is away is made again when it is back.
        if self.nc.is_connected:
            with contextlib.suppress(nats.errors.Error):
                await self.nc.flush()
                await self.nc.flush()

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    def open(self, rid: str, slot: Slot | None = None) -> Slot:
        if slot is None:
            slot = Slot(self.slot_limit)
            slot.refill = lambda: self._refill(rid, slot)
        self.slots[rid] = slot
        self.idle.clear()
        return slot

    def close(self, rid: str) -> None:
        self.slots.pop(rid, None)
        if not self.slots:
            self.idle.set()

    def cut(self, error: Callable[[str], ErrorInfo]) -> None:
        """End every open stream with its own error event (the ingress is going away)."""
        for rid, slot in self.slots.items():
            slot.cut(error_body(error(rid)))

    def cancel(self, rid: str) -> None:
        """Tell the request's owner the client left (safe to call from a finalizer)."""
        cancel = self.nc.publish(bus.cancel_subject(self.ingress_id, rid), b"")
        task = asyncio.get_running_loop().create_task(cancel)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _on_msg(self, msg: Msg) -> None:
        try:
            delivery = _delivery.decode(msg.data)
        except msgspec.DecodeError as exc:
            await self._unreadable(msg, exc)
            return
        for event in delivery.events:
            slot = self.slots.get(event.rid)
            if slot is None or slot.spilled:
                continue  # the client already left, or it is read back when taken
            if event.seq > slot.last_seq + 1:  # delivered while we were away, or lost
                await self._read_back(event.rid, slot, before=event.seq)
            slot.put(event)

    async def _unreadable(self, msg: Msg, exc: msgspec.DecodeError) -> None:
        """A delivery not in this version's shape: what it held is stored, so each of its
        requests reads its ledger back (to its end: at least up to what was delivered)."""
        try:
            rids = {e.rid for e in _rids.decode(msg.data).events}
        except msgspec.DecodeError:
            log.error("undecodable delivery on %s: %s", msg.subject, exc)
            return
        log.warning(
            "delivery on %s in another shape (%s): reading back %d request(s)",
            msg.subject,
            exc,
            len(rids),
        )
        for rid in rids:
            slot = self.slots.get(rid)
            if slot is not None and not slot.spilled:
                await self._read_back(rid, slot)

    async def reconnected(self) -> None:
        """After a reconnect, what every open request missed, including its end."""
        for rid, slot in list(self.slots.items()):
            await self._read_back(rid, slot)

    async def _read_back(self, rid: str, slot: Slot, before: int | None = None) -> None:
        """The request's committed events after the slot's last, up to `before` (a
        `Tw-Seq`) or the end."""
        try:
            async for event in self._stored(rid, slot.last_seq, before):
                slot.put(event)
                if slot.spilled:
                    return  # the rest when its reader takes what it holds
        except nats.errors.Error as exc:  # NATS away again: the next reconnect retries
            log.warning("could not read %s back from the ledger: %r", rid, exc)

    async def _stored(
        self, rid: str, after: int, before: int | None = None
    ) -> AsyncIterator[Event]:
        """The request's committed events after `Tw-Seq` `after` (and before `before`)."""
        found = await ledger.read(self.js, self.ingress_id, rid)
        for event in found.events[after : before and before - 1] if found else ():
            yield event

    async def _refill(self, rid: str, slot: Slot) -> None:
        """A spilled slot's reader took all it held: the next events from the ledger, up to
        its limit. At the ledger's end the slot takes live events again, and reads once
        more what was stored (and dropped) while it read."""
        try:
            async for event in self._stored(rid, slot.last_seq):
                slot.keep(event)
                if slot.queued > (slot.limit or 0):
                    return  # still spilled: the next part when this one is taken
        except nats.errors.Error as exc:
            log.warning("could not read %s back from the ledger: %r; trying again", rid, exc)
            await asyncio.sleep(_REFILL_RETRY)
            return
        slot.spilled = False
        await self._read_back(rid, slot)
