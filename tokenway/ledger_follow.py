"""Following one request's committed output as it is stored, from owner to owner.

What a reader that was not live needs (an SSE resume, a direct client's `outputs`): the
request's index from its first record, then, past the index's last record, the round
records of the owner it names, each filtered to the request. A change of owner on the index
moves the second reader to the new owner's rounds; a `Takeover` of the request on the old
owner's subject stops it there until then. Events come out once each, in `Tw-Seq` order:
a round record may come before the index record holding the events just before it, and
waits for them. Both readers are `out_reader.Reader`s: a tenant's client may make them on
its own ledgers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy

from tokenway import headers as h
from tokenway import ledger
from tokenway.aio import cancel_and_wait
from tokenway.out_reader import Reader
from tokenway.wire import Delivered

log = logging.getLogger(__name__)

# What its readers read, each marked as a round subject's or not (or why one stopped).
_Queue = asyncio.Queue[tuple[bool, Msg | Exception]]


class Follow:
    """`subject`: the request's index subject (`bus.out_subject`, whose reply may be a
    wildcard: the records say which it is)."""

    def __init__(self, js: JetStreamContext, subject: str, rid: str) -> None:
        self.js = js
        self.rid = rid
        self.tenant = ""  # whose request it is, as its first record says
        self.seen = 0  # the last Tw-Seq given out
        self._index = Reader(js, subject, DeliverPolicy.ALL)
        self._rounds: Reader | None = None
        self._owner = ""  # the round subject `_rounds` reads
        self._early: dict[int, Delivered] = {}  # from rounds, before the index caught up
        self._first: Msg | None = None
        self._index_msgs: AsyncGenerator[Msg, None] | None = None
        self._pumped = False  # a task of `events` read `_index_msgs`

    async def open(self) -> bool:
        """Make its index reader: whether anything of the request is stored already."""
        stored = await self._index.open() > 0
        self._index_msgs = self._index.messages()
        return stored

    async def first(self) -> None:
        """Read its first record now (`tenant` says whose request it is)."""
        assert self._index_msgs is not None, "open the follower first"
        self._first = await anext(self._index_msgs)
        self.tenant = (self._first.headers or {}).get(h.TENANT, "")

    async def close(self) -> None:
        if self._index_msgs is not None and not self._pumped:
            await self._index_msgs.aclose()  # (else its task's end closed it)
        await self._index.close()
        if self._rounds is not None:
            await self._rounds.close()

    async def events(self) -> AsyncGenerator[list[Delivered], None]:
        """What is stored, then each event as it is, until the request's end (open first:
        True)."""
        assert self._index_msgs is not None, "open the follower first"
        queue: _Queue = asyncio.Queue()
        self._pumped = True
        index = asyncio.create_task(self._pump(self._index_msgs, False, queue))
        rounds: asyncio.Task[None] | None = None
        try:
            item = (False, self._first) if self._first is not None else None
            while True:
                is_round, msg = item or await queue.get()
                item = None
                if isinstance(msg, Exception):
                    raise msg
                if not is_round:
                    out = self._from(msg)
                    if self._moved(msg):
                        rounds = await self._follow_owner(msg, queue, rounds)
                elif msg.subject != self._owner:
                    continue  # an owner's it no longer follows
                elif self.rid in ledger.taken_rids(msg):
                    self._owner = ""  # its next events are the new owner's: the index names it
                    continue
                else:
                    out = self._from(msg)
                if out:
                    yield out
                    if out[-1].terminal:
                        return
        finally:
            await cancel_and_wait(index)
            if rounds is not None:
                await cancel_and_wait(rounds)

    @staticmethod
    async def _pump(messages: AsyncGenerator[Msg, None], is_round: bool, queue: _Queue) -> None:
        """A reader's messages into the queue; why it stopped, if it did (its connection
        closed), after them."""
        try:
            async for msg in messages:
                queue.put_nowait((is_round, msg))
        except Exception as exc:
            queue.put_nowait((is_round, exc))

    def _from(self, msg: Msg) -> list[Delivered]:
        """What of a record's events (an index's, or a round's of many requests) comes
        next, with what waited for it."""
        try:
            events = ledger.events_of(self.rid, msg)
        except (KeyError, ValueError) as exc:
            log.error("ledger record on %s unreadable: %r", msg.subject, exc)
            return []
        for event in events:
            if event.rid == self.rid and event.seq > self.seen:
                self._early[event.seq] = event
        out = []
        while self.seen + 1 in self._early:
            out.append(self._early.pop(self.seen + 1))
            self.seen += 1
        return out

    def _moved(self, msg: Msg) -> bool:
        owner = (msg.headers or {}).get(h.OWNER, "")
        return bool(owner) and owner != self._owner

    async def _follow_owner(
        self, msg: Msg, queue: _Queue, rounds: asyncio.Task[None] | None
    ) -> asyncio.Task[None]:
        """Read the rounds of the owner an index record names, after the sequence it says."""
        hdrs = msg.headers or {}
        if rounds is not None:
            await cancel_and_wait(rounds)
        if self._rounds is not None:
            await self._rounds.close()
        self._owner = hdrs[h.OWNER]
        self._rounds = Reader(self.js, self._owner, DeliverPolicy.ALL)
        self._rounds.last = int(hdrs.get(h.OWNER_SEQ, 0))  # it starts after that
        await self._rounds.open()
        return asyncio.create_task(self._pump(self._rounds.messages(), True, queue))
