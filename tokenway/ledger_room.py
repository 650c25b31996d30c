"""Whether `TW_OUT` can take more requests without losing a running one's records.

`TW_OUT` is bounded (`TOKENWAY_OUT_MAX_BYTES`) and discards its oldest messages to make
room. A request's records are what relay, owner takeover and resume read back, so none
may go while the request runs. A record goes only once every byte stored before it is gone,
so what may be discarded harmlessly is what was stored before the oldest running request
began: the ended requests' records. Admission keeps that room:

    room = (max bytes - bytes) + (bytes stored before the oldest running request's start)

and refuses new requests while `room` is below the reserve (`TOKENWAY_OUT_RESERVE`, a
quarter of `TW_OUT`), which is what the requests already running may still write.

The oldest running request is `TW_SCHED`'s first message: a request stays in that work
queue, unacknowledged, from its queueing to its end, whoever owns it (a takeover
redelivers the same message). Its timestamp is where its records may begin; `TW_OUT`'s
first message stored since then (a message get by start time) splits the ledger into the
ended requests' records before it and the rest. The bytes before it are estimated from
the stream's mean message size: JetStream tells bytes of a whole stream, not of a range.
Three JetStream API calls a look, every 0.1-1 s by how fast the room shrinks (0.25 s while
refusing).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from datetime import datetime, timedelta

import msgspec
import nats.errors
from nats.aio.client import Client as NATS

from tokenway import bus
from tokenway.aio import Signal, wait_any
from tokenway.errors import Unavailable

log = logging.getLogger(__name__)

SKEW = timedelta(seconds=1)  # a cluster's streams may have leaders on clocks this far apart
FASTEST, SLOWEST, WHILE_FULL = 0.1, 1.0, 0.25  # seconds between looks


class State(msgspec.Struct):
    messages: int = 0
    bytes: int = 0
    first_seq: int = 0
    first_ts: str = ""
    last_seq: int = 0


class Config(msgspec.Struct):
    max_bytes: int = -1


class Info(msgspec.Struct):
    state: State
    config: Config = msgspec.field(default_factory=Config)


class _Message(msgspec.Struct):
    seq: int


class _Got(msgspec.Struct):
    message: _Message | None = None


_info = msgspec.json.Decoder(Info)
_got = msgspec.json.Decoder(_Got)


class Room(msgspec.Struct, frozen=True):
    """What a look found: bytes `TW_OUT` can still take before it would discard a record of
    a running request, of its `max_bytes`, and the `reserve` kept for running requests."""

    room: int
    max_bytes: int
    reserve: int

    @property
    def full(self) -> bool:
        return self.room < self.reserve


def room(out: Info, boundary: int, reserve_share: float) -> Room:
    """`TW_OUT`'s room, given `boundary`: the sequence of its first message a running
    request may own (past its last: none may)."""
    state, limit = out.state, out.config.max_bytes
    if limit <= 0:
        return Room(1 << 62, limit, 0)  # an unbounded ledger discards nothing
    ended = max(min(boundary, state.last_seq + 1) - state.first_seq, 0)
    mean = state.bytes / state.messages if state.messages else 0.0
    harmless = min(int(ended * mean), state.bytes)
    return Room(limit - state.bytes + harmless, limit, int(limit * reserve_share))


def _time(ts: str) -> datetime:
    return datetime.fromisoformat(ts)


def next_look(before: Room | None, now: Room | None, between: float) -> float:
    """Seconds to the next look: a quarter of the time the room would take to shrink to the
    reserve at the rate it shrank since the last look (`between` seconds ago)."""
    if before is None or now is None:
        return FASTEST
    if now.full:  # refusing: soon again, so that requests are taken as soon as it may
        return WHILE_FULL
    shrunk = before.room - now.room
    if shrunk <= 0:
        return SLOWEST
    left = now.room - now.reserve
    return min(max(left / (shrunk / max(between, 1e-3)) / 4, FASTEST), SLOWEST)


class LedgerRoom:
    """Looks at `TW_OUT` while it runs; `refusal()` says whether a new request must wait."""

    def __init__(self, nc: NATS, reserve_share: float) -> None:
        self.nc = nc
        self.reserve_share = reserve_share
        self.last: Room | None = None  # None: not looked yet (everything is admitted)
        self.looked = Signal()  # fired after each look, whatever it found
        self._failing = False

    def refusal(self) -> Unavailable | None:
        """The 503 a new request gets while the ledger is nearly full of running requests'
        records; None when it may run."""
        last = self.last
        if last is None or not last.full:
            return None
        return Unavailable(
            f"the output ledger (TW_OUT, {last.max_bytes} bytes) has room for {max(last.room, 0)} "
            "more bytes before it would discard records of running requests, and keeps "
            f"{last.reserve} for them (TOKENWAY_OUT_RESERVE); retry when they have ended",
            code="ledger_full",
        )

    async def wait(self) -> None:
        """Until a new request may run (at once, mostly): for a publisher that waits, such
        as the batch runner, rather than answering 503."""
        while self.refusal() is not None:
            await self.looked.waiter().wait()

    async def run(self, stop: asyncio.Event) -> None:
        at = time.monotonic()  # when `last` was looked at
        while not stop.is_set():
            before = self.last
            try:
                self.last = await self.look()
                self._failing = False
            except (nats.errors.Error, TimeoutError, ValueError) as exc:
                if not self._failing:  # said once per spell: NATS away says it elsewhere
                    log.warning("cannot look at TW_OUT's room (%r): admitting as before", exc)
                self._failing = True
            now = time.monotonic()
            wait = next_look(before, self.last, now - at)
            at = now
            self.looked.fire()
            await wait_any(stop, timeout=wait)

    async def look(self) -> Room:
        sched = await self._info(bus.SCHED_STREAM)
        out = await self._info(bus.OUT_STREAM)
        boundary = out.state.last_seq + 1  # no request runs: every record is an ended one's
        if sched.state.messages:
            since = (_time(sched.state.first_ts) - SKEW).isoformat().replace("+00:00", "Z")
            asked = json.dumps({"start_time": since}).encode()
            answer = await self.nc.request(
                f"{bus.JS_API}.STREAM.MSG.GET.{bus.OUT_STREAM}", asked, timeout=2.0
            )
            got = _got.decode(answer.data)
            if got.message is not None:  # else nothing was stored since it began
                boundary = got.message.seq
        return room(out, boundary, self.reserve_share)

    async def _info(self, stream: str) -> Info:
        answer = await self.nc.request(f"{bus.JS_API}.STREAM.INFO.{stream}", b"", timeout=2.0)
        return _info.decode(answer.data)
