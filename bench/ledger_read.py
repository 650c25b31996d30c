"""Reading one request back at the end of a long stream on a busy owner: what a takeover,
a relay's check and an SSE resume cost.

    python -m bench.ledger_read [--tokens 12000] [--others 64] [--json out.json]

A real nats-server. One owner (`workers.schedule.rounds.Rounds`) commits a token per
round for one long request and `--others` short-lived ones beside it (each replaced by a
fresh one every 100 tokens, as a busy owner's requests come and go); then the long request
is read back as a new owner would (`tokenway.ledger.read`). The baseline is the layout
before round records, in the same run: one fenced record per event on the request's own
subject, read back record by record (what `ledger.stored` does). Reported: records read
and wall time of each read, and the records stored.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import nats

from bench.ledger_writer import provisioned
from tokenway import bus, ledger
from tokenway.ledger_writer import LedgerWriter
from tokenway.wire import Chunk, GenerateRequest, OutputContext
from workers.schedule.owned import Owned
from workers.schedule.rounds import Rounds, Staged

PAYLOAD = b'data: {"id":"chatcmpl-0","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" word"}}]}\n\n'  # noqa: E501
STATE = bytes(range(120))
REPLY = "bench"
TURNOVER = 100  # tokens an "other" request lives


def _request() -> Owned:
    rid = uuid.uuid4().hex[:16]
    ctx = OutputContext(api="chat", response_id="chatcmpl-0", model="m", stream=True)
    req = GenerateRequest(request_id=rid, token_ids=[1], context=ctx)
    return Owned(rid=rid, reply=REPLY, request=req, deadline=1e12, msg=None)  # type: ignore[arg-type]


def _event(r: Owned) -> Chunk:
    seq = r.out_seq + 1
    return Chunk(rid=r.rid, seq=seq, payload=PAYLOAD, attempt=1, tokens=1, ids=[seq], state=STATE)


async def _rounds(url: str, tokens: int, others: int) -> dict[str, float]:
    nc = await nats.connect(url)
    try:
        writer = LedgerWriter(nc, nc.jetstream())
        await writer.start()
        rounds = Rounds(writer, nc.jetstream(), "sbench", nc.max_payload * 9 // 10)
        long, busy = _request(), [_request() for _ in range(others)]
        stored = 0
        for n in range(tokens):
            if n and n % TURNOVER == 0:
                busy = [_request() for _ in range(others)]
            staged = [Staged(r, [_event(r)]) for r in (long, *busy)]
            await rounds.commit(staged)
            stored += len({s.r.reply for s in staged if not s.indexed}) + sum(
                s.indexed for s in staged
            )
            for s in staged:
                assert s.stored, s.outcome
                s.r.out_seq += 1
        counted = _Counting(nc.jetstream())
        began = time.perf_counter()
        found = await ledger.read(counted, REPLY, long.rid)  # type: ignore[arg-type]
        took = time.perf_counter() - began
        assert found is not None and len(found.events) == tokens
        return {"records_stored": stored, "records_read": counted.gets, "read_s": took}
    finally:
        await nc.close()


async def _per_event(url: str, tokens: int) -> dict[str, float]:
    """The layout before round records: a fenced record per event on the request's subject."""
    nc = await nats.connect(url)
    try:
        js, rid, last = nc.jetstream(), uuid.uuid4().hex[:16], 0
        writer = LedgerWriter(nc, js)
        await writer.start()
        subject = bus.out_subject(REPLY, rid)
        for seq in range(1, tokens + 1):
            event = Chunk(rid=rid, seq=seq, payload=PAYLOAD, attempt=1, tokens=1, ids=[seq])
            headers = ledger.index_headers([event], reply=REPLY, after=last)
            (outcome,) = await writer.store([(subject, ledger.encode([event]), headers)])
            assert isinstance(outcome, int), outcome
            last = outcome
        began, read = time.perf_counter(), 0
        async for _ in ledger.stored(js, subject):
            read += 1
        return {
            "records_stored": tokens,
            "records_read": read,
            "read_s": time.perf_counter() - began,
        }
    finally:
        await nc.close()


class _Counting:
    """A JetStream context that counts the records its direct gets return."""

    def __init__(self, js: object) -> None:
        self._js = js
        self.gets = 0

    async def get_msg(self, *args: object, **kwargs: object) -> object:
        msg = await self._js.get_msg(*args, **kwargs)  # type: ignore[attr-defined]
        self.gets += 1
        return msg


async def run(tokens: int, others: int) -> dict[str, dict[str, float]]:
    async with provisioned() as (url, _):
        return {
            "rounds": await _rounds(url, tokens, others),
            "per_event": await _per_event(url, tokens),
        }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=12000, help="the long request's tokens")
    p.add_argument("--others", type=int, default=64, help="requests beside it per round")
    p.add_argument("--json", type=Path, help="also write the report to this file")
    a = p.parse_args(argv)
    result = asyncio.run(run(a.tokens, a.others))
    print(f"reading back a request of {a.tokens} tokens, an owner serving {a.others} others:")
    for name, r in result.items():
        print(f"  {name:9}: {r['records_read']:6.0f} records read in {r['read_s'] * 1e3:7.1f} ms "
              f"({r['records_stored']:.0f} records stored)")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps({"tokens": a.tokens, "others": a.others} | result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
