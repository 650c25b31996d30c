"""An owner's commit rounds: one fenced round record per reply, and index records where due.

A round commits what one engine step made for all of the owner's requests. The events of a
reply's requests go into one record on the owner's round subject for that reply, fenced on
its last sequence; a request's own index (`bus.out_subject`) gets a record when it commits
its first event, when a segment's worth of its events are not indexed yet, and when it
ends (`ledger`). A request indexed in a round has its events in that index record alone,
as has one whose events would not fit the round record: one request's size never moves
another's commit.

A round record refused by its fence means another owner stored a `Takeover` on the round
subject since: the requests it names are let go, and the record goes again without them.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import APIError

from tokenway import bus, ledger
from tokenway.ledger_writer import Entry, LedgerWriter, Outcome
from tokenway.wire import Delivered, Failed
from workers.schedule.owned import Owned

log = logging.getLogger(__name__)

# A request's unindexed events past this many payload bytes go into its index (so an index
# record stays far below NATS's max payload).
SEGMENT_BYTES = 64 * 1024
_REFUSALS = 8  # a round record refused again and again: the subject is not ours any more


class TakenOver(Exception):
    """Another owner wrote the request's ledger: it is theirs now."""


@dataclass(eq=False, slots=True)
class Staged:
    """One request's events of a round, and how committing them ended (None: stored)."""

    r: Owned
    events: list[Delivered]
    indexed: bool = False  # they go into its index record, not the round record
    outcome: Outcome | TakenOver | None = None

    @property
    def stored(self) -> bool:
        return self.outcome is None


class Rounds:
    """The owner's round subjects, one per reply it commits for, and what it last stored
    on each (the fence of its next round record)."""

    def __init__(self, writer: LedgerWriter, js: JetStreamContext, owner: str, limit: int) -> None:
        """`limit`: the bytes a round record may hold (below the connection's max payload)."""
        self.writer = writer
        self.js = js
        self.owner = owner
        self.limit = limit
        self.last: dict[str, int] = {}
        self._lock = asyncio.Lock()  # a round at a time: each is fenced on the one before

    def subject(self, reply: str) -> str:
        return bus.round_subject(reply, self.owner)

    def pointer(self, reply: str) -> ledger.Pointer:
        """Where a request of `reply` indexed now has its next events."""
        return ledger.Pointer(self.subject(reply), self.last.get(reply, 0))

    async def commit(self, staged: list[Staged]) -> dict[str, bytes]:
        """Store every request's events (each `Staged.outcome` says how that went); what to
        deliver to each reply: its stored events, in order."""
        async with self._lock:
            replies: dict[str, list[Staged]] = {}
            for s in staged:
                replies.setdefault(s.r.reply, []).append(s)
            rounds: dict[str, list[Staged]] = {}
            for reply, of_reply in replies.items():
                rounds[reply] = self._place(of_reply)
            entries: list[Entry] = []
            owners: list[tuple[str, list[Staged], bytes]] = []  # per round record
            for reply, in_round in rounds.items():
                if in_round:
                    payload = ledger.encode([e for s in in_round for e in s.events])
                    owners.append((reply, in_round, payload))
                    entries.append((self.subject(reply), payload, self._fence(reply)))
            indexed = [s for s in staged if s.indexed]
            entries += [self._index_entry(s) for s in indexed]
            outcomes = await self.writer.store(entries)
            payloads: dict[str, bytes] = {}
            for (reply, in_round, payload), outcome in zip(
                owners, outcomes[: len(owners)], strict=True
            ):
                stored = await self._settle(reply, in_round, payload, outcome)
                if stored is not None:
                    payloads[reply] = stored
            for s, outcome in zip(indexed, outcomes[len(owners) :], strict=True):
                if isinstance(outcome, int):
                    s.r.index_seq = outcome
                    s.r.indexed()
                else:
                    s.outcome = _refusal(outcome)
            for s in staged:
                if s.stored and not s.indexed:
                    s.r.unindex(s.events)
            return {
                reply: _delivery(of_reply, payloads.get(reply))
                for reply, of_reply in replies.items()
                if any(s.stored for s in of_reply)
            }

    def _place(self, of_reply: list[Staged]) -> list[Staged]:
        """Which of a reply's requests go into its round record (the rest are indexed)."""
        in_round, size = [], 0
        for s in of_reply:
            r, bytes_ = s.r, sum(len(e.payload) for e in s.events)
            if (
                not r.index_seq
                or s.events[-1].terminal
                or r.unindexed_tokens + _tokens(s.events) >= ledger.SEGMENT_TOKENS
                or r.unindexed_bytes + bytes_ >= SEGMENT_BYTES
                or size + bytes_ > self.limit
            ):
                s.indexed = True
                continue
            size += bytes_
            in_round.append(s)
        return in_round

    def _fence(self, reply: str) -> dict[str, str]:
        return ledger.round_headers(self.last.get(reply, 0))

    def _index_entry(self, s: Staged) -> Entry:
        r = s.r
        events = [*r.unindexed, *s.events]
        if len(r.choices) == 1:  # a reader resumes from the last state alone
            events[:-1] = [_stateless(e) for e in events[:-1]]
        headers = ledger.index_headers(
            events,
            reply=r.reply,
            after=r.index_seq,
            tenant=r.tenant,
            owner=self.pointer(r.reply),
        )
        return bus.out_subject(r.reply, r.rid), ledger.encode(events), headers

    async def _settle(
        self, reply: str, in_round: list[Staged], payload: bytes, outcome: Outcome
    ) -> bytes | None:
        """A reply's round record answered: the payload stored (None: not stored). Refused
        by a takeover: without the requests taken, again."""
        for _ in range(_REFUSALS):
            if isinstance(outcome, int):
                self.last[reply] = outcome
                return payload
            if not (isinstance(outcome, APIError) and ledger.superseded(outcome)):
                break
            subject = self.subject(reply)
            taken, self.last[reply] = await ledger.taken(self.js, subject, self.last.get(reply, 0))
            for s in in_round:
                if s.r.rid in taken:
                    s.outcome = TakenOver()
            in_round = [s for s in in_round if s.outcome is None]
            if not in_round:
                return None
            if not taken:
                log.error("round record on %s refused, and nothing taken: again", subject)
            payload = ledger.encode([e for s in in_round for e in s.events])
            (outcome,) = await self.writer.store([(subject, payload, self._fence(reply))])
        assert not isinstance(outcome, int)  # (stored: returned above)
        if isinstance(outcome, APIError) and ledger.superseded(outcome):
            outcome = RuntimeError(
                f"round records on {self.subject(reply)} refused {_REFUSALS} times"
            )
        for s in in_round:
            s.outcome = _refusal(outcome)
        return None


def _stateless(event: Delivered) -> Delivered:
    if isinstance(event, Failed) or event.state is None:
        return event
    return msgspec.structs.replace(event, state=None)


def _tokens(events: list[Delivered]) -> int:
    return sum(e.tokens for e in events)


def _delivery(of_reply: list[Staged], stored: bytes | None) -> bytes:
    """What to deliver of a reply's round: the record as stored when it holds every event
    of the round, else the events stored, encoded again."""
    if stored is not None and all(s.stored and not s.indexed for s in of_reply):
        return stored
    return ledger.encode([e for s in of_reply if s.stored for e in s.events])


def _refusal(outcome: BaseException) -> BaseException:
    if isinstance(outcome, APIError) and ledger.superseded(outcome):
        return TakenOver()
    return outcome
