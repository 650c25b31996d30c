"""The batch runner stage: runs the Batch API's batches through the bus, line by line.

Every runner watches `tw-batches`. A batch not yet ended whose lease has lapsed is taken by
a compare-and-set of its record (this runner's id, a lease it renews), so one runner runs
it at a time, and another takes it over when that one dies. A taken batch goes through:

- `validating`: its input file is parsed; errors fail it, else it is `in_progress`;
- `in_progress`: the lines not answered yet are submitted as a batch job's requests
  (`tokenway.client`: behind interactive traffic, waiting out full queues), at most
  `--batch-concurrency` at a time. A line's answer is its ledger's one message, so a
  runner that takes over reads what already ran and submits only the rest: a line runs
  once. Answers are kept in parts of `PART_LINES` consecutive lines, written as soon as a
  part is whole, so a long batch does not outlive its ledgers' retention;
- `cancelling` (or past its window): nothing more is submitted, lines in flight are
  cancelled, and what was answered is its output;
- `finalizing`: the parts become the output and error files.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import time

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.js.errors import ObjectNotFoundError

from tokenway import batches, bus
from tokenway.aio import cancel_and_wait, wait_any
from tokenway.batch_store import BatchStore, NotFound
from tokenway.batches import ENDED, Errors, Line, Record
from tokenway.client import Client, Finished, RequestFailed, outcome
from tokenway.config import Settings
from tokenway.ledger_room import LedgerRoom
from tokenway.quota import CODE, QuotaExceeded

log = logging.getLogger(__name__)

PART_LINES = 100
_PROGRESS_EVERY = 1.0  # seconds between stores of a running batch's counts
# Runs of a batch that may fail in a row (a bug, a permission the runner lacks) before the
# batch fails saying so; each next try waits longer (a third of the lease, doubled each time).
RUNS = 5


def part_id(batch_id: str, kind: str, part: int) -> str:
    return f"{batch_id}.{kind}.{part}"


def result_file_id(batch_id: str, kind: str) -> str:
    """The output (or error) file's id: the same whoever writes it, so writing it again
    after a takeover replaces it."""
    return "file-" + hashlib.blake2b(f"{batch_id}:{kind}".encode(), digest_size=12).hexdigest()


class BatchRunner:
    name = "batch"

    def __init__(self, settings: Settings, model: str) -> None:
        self.settings = settings
        self.model = model  # for lines whose body names none
        self.runner_id = f"b{secrets.token_hex(4)}"
        self.started = asyncio.Event()  # it watches for batches
        self.running: dict[str, asyncio.Task[None]] = {}
        self.ledger_room: LedgerRoom | None = None  # lines wait while TW_OUT is nearly full

    async def run(self, nats_url: str, stop: asyncio.Event) -> None:
        name = f"tokenway-batch-{self.runner_id}"
        nc = await bus.connect(nats_url, name, self.settings, stop=stop)
        store = await BatchStore.bind(nc.jetstream(), self.settings)
        watcher = await store.kv.watchall()
        self.ledger_room = LedgerRoom(nc, self.settings.out_reserve)
        looking = asyncio.create_task(self.ledger_room.run(stop))
        log.info("batch runner %s running batches", self.runner_id)
        self.started.set()
        try:
            while not stop.is_set():
                try:
                    for record in await store.records():
                        self._maybe_take(nc, store, record)
                except NatsError as exc:  # JetStream busy or electing: the next look will do
                    log.warning(
                        "batch runner %s could not list the batches: %r", self.runner_id, exc
                    )
                # woken by any change of a batch, else in time to take over a lapsed lease
                update = asyncio.ensure_future(watcher.updates(self.settings.batch_lease / 3))
                await wait_any(stop, _done(update))
                update.cancel()
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await update
        finally:
            for task in self.running.values():
                task.cancel()
            await asyncio.gather(*self.running.values(), return_exceptions=True)
            looking.cancel()
            await asyncio.gather(looking, return_exceptions=True)
            await watcher.stop()
            await bus.drain(nc)

    def _maybe_take(self, nc: NATS, store: BatchStore, r: Record) -> None:
        bid = r.batch.id
        if bid in self.running or r.batch.status in ENDED:
            return
        if r.runner != self.runner_id and r.lease_until > time.time():
            return  # another runner holds it, or a failed run's next try is not due yet
        task = asyncio.create_task(self._hold(nc, store, bid), name=f"batch-{bid}")
        self.running[bid] = task
        task.add_done_callback(lambda _: self.running.pop(bid, None))

    async def _hold(self, nc: NATS, store: BatchStore, bid: str) -> None:
        """Take the batch (compare-and-set), run it while renewing the lease."""
        now = time.time()

        def take(r: Record) -> Record | None:
            if r.batch.status in ENDED:
                return None
            if r.runner != self.runner_id and r.lease_until > now:
                return None
            return msgspec.structs.replace(
                r, runner=self.runner_id, lease_until=now + self.settings.batch_lease
            )

        record = await store.change(bid, take)
        if record.runner != self.runner_id or record.batch.status in ENDED:
            return
        log.info("batch %s taken (%s)", bid, record.batch.status)
        work = asyncio.create_task(self._run(nc, store, record))
        finished = _done(work)
        release = self._release
        try:
            while not work.done():
                await wait_any(finished, timeout=self.settings.batch_lease / 3)
                if work.done():
                    break
                renewed = await store.change(bid, self._renewal)
                if renewed.runner != self.runner_id:  # taken over: this runner stalled
                    log.warning("batch %s is another runner's now; letting it go", bid)
                    work.cancel()
            await work
        except Exception:
            log.exception("running batch %s failed (run %d of %d)", bid, record.failures + 1, RUNS)
            release = self._failed
        finally:
            await cancel_and_wait(work)
            await store.change(bid, release)

    def _renewal(self, r: Record) -> Record | None:
        if r.runner != self.runner_id:
            return None
        return msgspec.structs.replace(r, lease_until=time.time() + self.settings.batch_lease)

    def _release(self, r: Record) -> Record | None:
        if r.runner != self.runner_id:
            return None
        return msgspec.structs.replace(r, runner="", lease_until=0.0, failures=0)

    def _failed(self, r: Record) -> Record | None:
        """Released after a failed run: tried again later by any runner, or, its runs used
        up, failed with a reason its client reads (the log has the traceback)."""
        if r.runner != self.runner_id:
            return None
        failures = r.failures + 1
        if failures < RUNS:
            later = time.time() + self.settings.batch_lease / 3 * 2 ** (failures - 1)
            return msgspec.structs.replace(r, runner="", lease_until=later, failures=failures)
        why = batches.LineError(
            code="batch_failed",
            message=f"the batch could not be run: {failures} runs of it failed; the server's "
            f"log has the reason under {r.batch.id}",
        )
        batch = msgspec.structs.replace(
            r.batch, status="failed", failed_at=int(time.time()), errors=Errors(data=[why])
        )
        return msgspec.structs.replace(
            r, batch=batch, runner="", lease_until=0.0, failures=failures
        )

    async def _run(self, nc: NATS, store: BatchStore, r: Record) -> None:
        bid = r.batch.id
        try:
            data = await store.content(r.batch.input_file_id, r.tenant)
        except NotFound:  # deleted after the batch was made
            data = b""
            missing = batches.LineError(code="missing_file", message="the input file is gone")
            r = await store.change(bid, lambda rec: _validated(rec, 0, [missing]))
        lines, errors = batches.parse_lines(data, r.batch.endpoint)
        if r.batch.status == "validating":
            r = await store.change(bid, lambda rec: _validated(rec, len(lines), errors))
            if r.batch.status == "failed":
                log.info("batch %s failed validation: %d errors", bid, len(errors))
                return
        if r.batch.status in ("in_progress", "cancelling"):  # a cancelled one submits nothing
            await Lines(self, nc, store, r, lines).run(r.batch.status == "in_progress")
            r = await store.get(bid)
        if r.batch.status in ("finalizing", "cancelling"):
            await self._finalize(store, r, len(lines))

    async def _finalize(self, store: BatchStore, r: Record, total: int) -> None:
        """The parts, concatenated into the output and error files; the batch ends."""
        bid = r.batch.id
        files: dict[str, str | None] = {}
        parts = range(-(-total // PART_LINES))
        for kind in ("out", "err"):
            data = b"".join([await _part(store, bid, kind, part) for part in parts])
            if not data:
                files[kind] = None
                continue
            fid = result_file_id(bid, kind)
            name = f"{bid}_{'output' if kind == 'out' else 'error'}.jsonl"
            meta = batches.file_object(fid, data, name, "batch_output")
            await store.put_file(meta, data, r.tenant)  # counted: the parts go below
            files[kind] = fid
        now = int(time.time())

        def ended(rec: Record) -> Record:
            b = rec.batch
            cancelled = b.status == "cancelling"
            over = any(e.code == CODE for e in (b.errors.data if b.errors else []))
            expired = cancelled and b.cancelling_at is None  # stopped by its window
            status = (
                "failed"
                if over
                else "expired"
                if expired
                else "cancelled"
                if cancelled
                else "completed"
            )
            stamps = {f"{status}_at": now}
            batch = msgspec.structs.replace(
                b, status=status, output_file_id=files["out"], error_file_id=files["err"], **stamps
            )
            return msgspec.structs.replace(rec, batch=batch)

        done = await store.change(bid, ended)
        for kind in ("out", "err"):  # the parts are in the files now
            for part in parts:
                with contextlib.suppress(NotFound):
                    await store.delete_file(part_id(bid, kind, part), r.tenant)
        log.info(
            "batch %s %s: %d completed, %d failed",
            bid,
            done.batch.status,
            done.batch.request_counts.completed,
            done.batch.request_counts.failed,
        )


class Lines:
    """One runner's run of an in-progress batch's lines."""

    def __init__(
        self, runner: BatchRunner, nc: NATS, store: BatchStore, record: Record, lines: list[Line]
    ) -> None:
        self.runner = runner
        self.store = store
        self.record = record
        self.lines = lines
        self.bid = record.batch.id
        # its lines are its tenant's, on the tenant's lane: their turns, their ledgers
        room = runner.ledger_room
        self.client = Client(
            nc,
            runner.model,
            reply=bus.token(self.bid),
            tenant=record.tenant,
            admission=room.wait if room is not None else None,
        )
        self.answers: dict[int, tuple[int, bytes]] = {}  # line → status, its output line
        self.parts = record.parts
        self.stopping = False
        self.over: batches.LineError | None = None  # its tenant's files quota, once past it

    async def run(self, submit: bool) -> None:
        """Read what ran already; with `submit`, run the rest; write the parts."""
        first = self.parts * PART_LINES
        index = {batches.line_rid(self.bid, i): i for i in range(first, len(self.lines))}
        async with self.client.finished() as finished:
            await finished.caught_up()
            for rid, i in index.items():  # what ran before a takeover
                if (out := finished.take(rid)) is not None:
                    self.answers[i] = self._answer(i, outcome(rid, out))
            if submit and not await self._commit():
                await self._submit(index, finished)
        await self._commit(final=True)

    async def _submit(self, index: dict[str, int], finished: Finished) -> None:
        todo = [(rid, self.lines[i].body) for rid, i in index.items() if i not in self.answers]
        concurrency = self.runner.settings.batch_concurrency
        results = self.client.submit_many(todo, concurrency, finished)

        async def take() -> None:
            async for rid, result in results:
                self.answers[index[rid]] = self._answer(index[rid], result)

        taking = asyncio.create_task(take())
        taken = _done(taking)
        try:  # the progress is stored each second, which is when a cancel is noticed
            while not taking.done():
                await wait_any(taken, timeout=_PROGRESS_EVERY)
                if not taking.done() and await self._commit():  # cancelled, or expired
                    taking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await taking
        finally:
            await cancel_and_wait(taking)
            await results.aclose()
        if self.stopping:
            for rid, i in index.items():
                if i not in self.answers:
                    await self.client.cancel(rid)

    def _answer(self, i: int, result: dict | RequestFailed) -> tuple[int, bytes]:
        if isinstance(result, RequestFailed):
            body: object = {"error": result.error}
            status = result.status
        else:
            body, status = result, 200
        return status, batches.output_line(self.bid, i, self.lines[i], status, body)

    async def _commit(self, final: bool = False) -> bool:
        """Write every part that is whole; store the counts. True when the batch is to stop
        (cancelled, or past its completion window)."""
        total = len(self.lines)
        while self.parts * PART_LINES < total and self.over is None:
            span = range(self.parts * PART_LINES, min((self.parts + 1) * PART_LINES, total))
            if not all(i in self.answers for i in span):
                if not final:
                    break
            try:
                await self._write_part(self.parts, span)
            except QuotaExceeded as exc:  # the lines of this part are not kept: it stops
                self.over = batches.LineError(code=CODE, message=exc.message)
                break
            if not all(i in self.answers for i in span):
                break  # a last, partial part: the batch stopped within it
            self.parts += 1
        ok = sum(1 for s, _ in self.answers.values() if s == 200)
        failed = len(self.answers) - ok
        now = int(time.time())
        parts, over = self.parts, self.over

        def counted(r: Record) -> Record:
            b = r.batch
            counts = msgspec.structs.replace(b.request_counts, completed=ok, failed=failed)
            status, errors = b.status, b.errors
            if status in ("in_progress", "finalizing") and over is not None:
                status, errors = "cancelling", Errors(data=[over])  # stops; ends `failed`
            elif status == "in_progress" and now > b.expires_at:
                status = "cancelling"  # its window passed: stop, as a cancel does
            elif status == "in_progress" and final:
                status = "finalizing"
            stamps = {"finalizing_at": now} if status == "finalizing" else {}
            batch = msgspec.structs.replace(
                b, request_counts=counts, status=status, errors=errors, **stamps
            )
            return msgspec.structs.replace(r, batch=batch, parts=max(r.parts, parts))

        try:
            record = await self.store.change(self.bid, counted)
        except NotFound:
            self.stopping = True
            return True
        self.stopping = record.batch.status == "cancelling"
        return self.stopping

    async def _write_part(self, part: int, span: range) -> None:
        for kind, wanted in (("out", _is_ok), ("err", _is_error)):
            data = b"".join(
                self.answers[i][1] for i in span if i in self.answers and wanted(self.answers[i][0])
            )
            pid = part_id(self.bid, kind, part)
            await self.store.put_file(
                batches.file_object(pid, data, pid, "batch_part"),
                data,
                self.record.tenant,
                self.record.quota,
            )


def _is_ok(status: int) -> bool:
    return status == 200


def _is_error(status: int) -> bool:
    return status != 200


async def _part(store: BatchStore, bid: str, kind: str, part: int) -> bytes:
    try:
        return (await store.files.get(part_id(bid, kind, part))).data or b""
    except ObjectNotFoundError:
        return b""


def _validated(r: Record, count: int, errors: list[batches.LineError]) -> Record | None:
    now = int(time.time())
    b = r.batch
    if b.status != "validating":
        return None
    if errors:
        batch = msgspec.structs.replace(
            b, status="failed", failed_at=now, errors=Errors(data=errors[:100])
        )
    else:
        counts = batches.RequestCounts(total=count)
        batch = msgspec.structs.replace(
            b, status="in_progress", in_progress_at=now, request_counts=counts
        )
    return msgspec.structs.replace(r, batch=batch)


def _done(task: asyncio.Task[None]) -> asyncio.Event:
    done = asyncio.Event()
    task.add_done_callback(lambda _: done.set())
    return done
