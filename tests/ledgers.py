"""What a request's ledger holds, checked the way an auditor would read `TW_OUT` by hand."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import msgspec
import nats
import nats.errors

from tokenway import bus, ledger
from tokenway.wire import Delivered, Failed


async def stored_once(nats_url: str, rid: str, reply: str | None = None) -> list[Delivered]:
    """The request's events, in order. Every copy of an event stored (in its index, in
    any owner's round records) is the same event, but for the `stream_state` a segment
    leaves out: a stale owner's output under a number another owner's holds would show as
    two. `nats_url`: a server, or a cluster's seeds (comma separated), where `TW_OUT` may
    still be electing its leader after a fault: an unanswered read is made again. `reply`:
    the request's (else read from its first record)."""
    async with asyncio.timeout(120):
        while True:
            try:
                return await _stored_once(nats_url, rid, reply)
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                await asyncio.sleep(0.2)  # another process's election: nothing to wait on


async def _stored_once(nats_url: str, rid: str, reply: str | None) -> list[Delivered]:
    nc = await nats.connect(servers=nats_url.split(","))
    try:
        js = nc.jetstream()
        if reply is None:
            index = bus.out_subject("*", rid)
            first = await js.get_msg(bus.OUT_STREAM, seq=1, subject=index, next=True)
            reply = first.subject.removeprefix("tw.out.").removesuffix(f".{rid}")
        copies: dict[int, set[bytes]] = defaultdict(set)
        for subject in (bus.out_subject(reply, rid), bus.round_subject(reply, "*")):
            async for m in ledger.stored(js, subject):
                for e in ledger.events_of(rid, m):
                    if e.rid == rid:
                        copies[e.seq].add(msgspec.msgpack.encode(_stateless(e)))
        assert all(len(c) == 1 for c in copies.values()), copies
        found = await ledger.read(js, reply, rid)
        assert found is not None and [e.seq for e in found.events] == sorted(copies)
        return found.events
    finally:
        await nc.close()


def data_lines(events: list[Delivered]) -> list[str]:
    """The SSE `data:` lines the events hold, as a client reads them."""
    text = b"".join(e.payload for e in events).decode()
    return [line for line in text.split("\n") if line.startswith("data: {")]


def _stateless(event: Delivered) -> Delivered:
    if isinstance(event, Failed):
        return event
    return msgspec.structs.replace(event, state=None)
