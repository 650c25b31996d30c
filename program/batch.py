"""`tokenway batch submit|status|results|cancel`: the Batch API from a shell, straight on
the bus (the same files and records the HTTP API keeps; the batch runners run them)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import msgspec
from nats.aio.client import Client as NATS

from tokenway import batches
from tokenway.batch_store import BatchStore, NotFound
from tokenway.batches import ENDED, BatchRefused, Record
from tokenway.config import Settings

_json = msgspec.json.Encoder()
_POLL = 0.5  # seconds between looks at a batch's progress, waiting for it


def add_verbs(verbs: argparse._SubParsersAction, common: object) -> None:
    """The verbs besides `run` (the runner stage); `common` adds the NATS flags."""
    submit = verbs.add_parser("submit", help="upload a JSONL file and start a batch of it")
    submit.add_argument("file", help="one request per line: custom_id, method, url, body")
    submit.add_argument(
        "--endpoint", default="/v1/chat/completions", choices=list(batches.ENDPOINTS)
    )
    submit.add_argument("--wait", action="store_true", help="show progress until it ends")
    shown = (
        ("status", "the batch object"),
        ("cancel", "stop a batch"),
        ("results", "the output file's lines (--errors: the error file's)"),
    )
    for name, text in shown:
        p = verbs.add_parser(name, help=text)
        p.add_argument("id")
        if name == "results":
            p.add_argument("--errors", action="store_true")
    for p in (submit, *(verbs.choices[n] for n in ("status", "cancel", "results"))):
        common(p)  # type: ignore[operator]


async def command(args: argparse.Namespace, settings: Settings, nc: NATS) -> int:
    store = await BatchStore.bind(nc.jetstream(), settings)
    try:
        if args.verb == "submit":
            record = await _submit(store, Path(args.file), args.endpoint)
            print(record.batch.id)
            return await _wait(store, record.batch.id) if args.wait else 0
        record = await store.get(args.id)
    except (NotFound, OSError, BatchRefused) as exc:
        print(f"tokenway batch: {exc}", file=sys.stderr)
        return 1
    if args.verb == "status":
        print(_json.encode(record.batch).decode())
    elif args.verb == "cancel":
        if record.batch.status in ENDED:
            print(f"tokenway batch: it is {record.batch.status} already", file=sys.stderr)
            return 1
        print(
            (await store.change(args.id, lambda r: batches.cancelled(r, time.time()))).batch.status
        )
    else:
        fid = record.batch.error_file_id if args.errors else record.batch.output_file_id
        if fid is None:
            print(f"tokenway batch: no such file yet ({record.batch.status})", file=sys.stderr)
            return 1
        sys.stdout.buffer.write(await store.content(fid, record.tenant))
    return 0


async def _submit(store: BatchStore, path: Path, endpoint: str) -> Record:
    data = await asyncio.to_thread(path.read_bytes)
    meta = batches.file_object(
        batches.new_id("file").replace("_", "-", 1), data, path.name, "batch"
    )
    await store.put_file(meta, data, "")
    batch = batches.new_batch(meta.id, endpoint, "24h", None)
    record = Record(batch=batch)
    await store.create(record)
    return record


async def _wait(store: BatchStore, batch_id: str) -> int:
    """A progress line until the batch ends; 0 when it completed."""
    while True:
        b = (await store.get(batch_id)).batch
        c = b.request_counts
        done = c.completed + c.failed
        bar = "#" * (30 * done // c.total) if c.total else ""
        print(
            f"\r{b.status:<11} [{bar:<30}] {done}/{c.total} ({c.failed} failed)",
            end="",
            file=sys.stderr,
            flush=True,
        )
        if b.status in ENDED:
            print(file=sys.stderr)
            return 0 if b.status == "completed" else 1
        await asyncio.sleep(_POLL)
