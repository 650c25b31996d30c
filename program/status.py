"""`tokenway status`: the deployment as NATS holds it — engines, queues, owned requests,
dead letters, batches, what each tenant stores and stream sizes — read, never changed (the
`ops` role may run it)."""

from __future__ import annotations

import time

import msgspec
from msgspec import Struct
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError, NotFoundError

from tokenway import batch_store, bus, quota, quota_book
from tokenway.batches import ENDED
from tokenway.config import Settings
from tokenway.quota import FILES, RESPONSES
from tokenway.wire import EngineInfo, OwnerInfo

_engine = msgspec.msgpack.Decoder(EngineInfo)
_owner = msgspec.msgpack.Decoder(OwnerInfo)
_QUEUES = (bus.RENDER_STREAM, bus.SCHED_STREAM)


class Engine(Struct, kw_only=True):
    id: str
    model: str
    role: str
    running: int
    waiting: int
    max_seqs: int
    kv_usage: float | None
    beat_age: float  # seconds since its last heartbeat
    alive: bool  # beat within the registry's TTL


class Consumer(Struct, kw_only=True):
    name: str
    pending: int  # in the stream, not yet delivered to it
    in_flight: int  # delivered, not yet acknowledged: renders running, requests owned
    redelivered: int
    pulling: int  # workers waiting for work


class Stream(Struct, kw_only=True):
    name: str
    messages: int
    bytes: int
    max_bytes: int
    consumers: list[Consumer]
    replicas: int = 1
    # fewer replicas than a stream gets by default here (`Status.replicas_default`): a
    # lost server may take what it holds
    replicas_low: bool = False


class BatchRun(Struct, kw_only=True):
    id: str
    status: str
    total: int
    completed: int
    failed: int
    runner: str  # the runner holding it ("" between runners)


class StoreUsage(Struct, kw_only=True):
    """What one tenant keeps in a store, and its quota there (0: none; -1: not known yet)."""

    count: int
    bytes: int
    count_limit: int
    bytes_limit: int


class TenantStored(Struct, kw_only=True):
    tenant: str  # "" for a keyless deployment's one tenant
    files: StoreUsage
    responses: StoreUsage  # those not expired yet


class Status(Struct, kw_only=True):
    engines: list[Engine]
    owners: list[OwnerInfo]  # the schedule workers that answered
    streams: list[Stream]
    dead_letters: dict[str, int]  # by stage
    batches: list[BatchRun]  # the Batch API's batches not ended
    batches_ended: int
    missing: list[str]  # streams or the registry not there (not provisioned?)
    stored: list[TenantStored] = []  # each tenant's usage of the files and responses stores
    # the replicas `tokenway provision` gives a stream here: the cluster's size, up to 3
    replicas_default: int = 1


async def read_status(nc: NATS, settings: Settings) -> Status:
    js = nc.jetstream()
    missing: list[str] = []
    streams = []
    wanted = bus.default_replicas(nc._server_info)
    names = [s.config.name or "" for s in bus.streams(settings)]
    for spec in [*names, *bus.BUCKET_STREAMS]:
        try:
            info = await js.stream_info(spec)
        except NotFoundError:
            missing.append(spec)
            continue
        consumers = await js.consumers_info(spec) if spec in _QUEUES else []
        streams.append(
            Stream(
                name=spec,
                messages=info.state.messages,
                bytes=info.state.bytes,
                max_bytes=info.config.max_bytes or -1,
                replicas=info.config.num_replicas or 1,
                replicas_low=(info.config.num_replicas or 1) < wanted,
                consumers=[
                    Consumer(
                        name=c.name,
                        pending=c.num_pending or 0,
                        in_flight=c.num_ack_pending or 0,
                        redelivered=c.num_redelivered or 0,
                        pulling=c.num_waiting or 0,
                    )
                    for c in consumers
                ],
            )
        )
    letters: dict[str, int] = {}
    if bus.DLQ_STREAM not in missing:
        # `tw.dlq.<stage>` only: a replay's marker, `tw.dlq.replayed.<id>`, is no letter
        info = await js.stream_info(bus.DLQ_STREAM, subjects_filter=bus.dlq_subject("*"))
        for subject, count in (info.state.subjects or {}).items():
            stage = subject.removeprefix(bus.dlq_subject(""))
            letters[stage] = letters.get(stage, 0) + count
    runs, ended = await _batches(js)
    return Status(
        engines=await _engines(js, settings.engine_ttl),
        owners=await _owners(nc),
        streams=streams,
        dead_letters=letters,
        batches=runs,
        batches_ended=ended,
        missing=missing,
        stored=await _stored(js),
        replicas_default=wanted,
    )


async def _stored(js: JetStreamContext) -> list[TenantStored]:
    """Each tenant's usage of the stores, against the quota it was last charged against."""
    try:
        kv = await js.key_value(bus.STORED_BUCKET)
    except BucketNotFoundError:
        return []
    now, found = time.time(), []
    for tenant, kept in (await quota_book.every_tenant(js, kv)).items():
        found.append(
            TenantStored(
                tenant=tenant,
                files=_usage(kept, FILES, now),
                responses=_usage(kept, RESPONSES, now),
            )
        )
    return found


async def _batches(js: JetStreamContext) -> tuple[list[BatchRun], int]:
    """The batches not ended, and how many have (none: no batch was ever made)."""
    try:
        kv = await js.key_value(bus.BATCHES_BUCKET)
    except BucketNotFoundError:
        return [], 0
    runs, ended = [], 0
    for record in await batch_store.records(js, kv):
        b = record.batch
        if b.status in ENDED:
            ended += 1
            continue
        c = b.request_counts
        runs.append(
            BatchRun(
                id=b.id,
                status=b.status,
                total=c.total,
                completed=c.completed,
                failed=c.failed,
                runner=record.runner,
            )
        )
    return runs, ended


def _usage(kept: quota.Kept, store: quota.Store, now: float) -> StoreUsage:
    used = kept.used(store, now)
    limit = kept.quota.of(store) if kept.quota else quota.Tally(-1, -1)
    return StoreUsage(
        count=used.count, bytes=used.bytes, count_limit=limit.count, bytes_limit=limit.bytes
    )


async def _owners(nc: NATS, first: float = 2.0, between: float = 0.2) -> list[OwnerInfo]:
    """Every owner's answer: the first within `first` seconds, each next within `between`
    of the one before (owners answer at once; nobody says how many there are)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    owners: list[OwnerInfo] = []
    try:
        await nc.publish(bus.OWNERS_SUBJECT, b"", reply=inbox)
        while True:
            try:
                msg = await sub.next_msg(timeout=between if owners else first)
            except TimeoutError:
                break
            if msg.headers and msg.headers.get("Status") == "503":
                break  # the server's word that nobody listens: no owner runs
            owners.append(_owner.decode(msg.data))
    finally:
        await sub.unsubscribe()
    return sorted(owners, key=lambda o: (o.model, o.id))


async def _engines(js: JetStreamContext, ttl: float) -> list[Engine]:
    try:
        kv = await js.key_value(bus.ENGINES_BUCKET)
        keys = await bus.kv_keys(js, bus.ENGINES_BUCKET)
    except BucketNotFoundError:  # its stream is listed missing
        return []
    now, engines = time.time(), []
    for key in sorted(keys):
        try:
            entry = await kv.get(key)
        except NotFoundError:
            continue  # gone meanwhile
        if not entry.value:
            continue  # a delete marker
        e = _engine.decode(entry.value)
        engines.append(
            Engine(
                id=e.id,
                model=e.model,
                role=e.role,
                running=e.running,
                waiting=e.waiting,
                max_seqs=e.max_seqs,
                kv_usage=e.kv_usage,
                beat_age=round(now - e.updated, 3),
                alive=now - e.updated <= ttl,
            )
        )
    return engines


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _kept(k: StoreUsage) -> str:
    def of(limit: int, shown: str) -> str:
        return "" if limit < 0 else " of unlimited" if limit == 0 else f" of {shown}"

    return (
        f"{k.count}{of(k.count_limit, str(k.count_limit))} "
        f"({_size(k.bytes)}{of(k.bytes_limit, _size(k.bytes_limit))})"
    )


def format_status(s: Status) -> str:
    lines = ["engines"]
    for e in s.engines:
        kv = "-" if e.kv_usage is None else f"{e.kv_usage:.0%}"
        health = "alive" if e.alive else "silent"
        lines.append(
            f"  {e.id:<28} {e.model:<16} {e.role:<8} {e.running:>4}/{e.max_seqs:<4} "
            f"running  {e.waiting:>4} waiting  kv {kv:>4}  beat {e.beat_age:.1f}s ago "
            f"({health})"
        )
    if not s.engines:
        lines.append("  none registered")
    lines.append("owners")
    for o in s.owners:
        tenants = ", ".join(f"{t or 'default'} {n}" for t, n in sorted(o.tenants.items()))
        lines.append(
            f"  {o.id:<12} {o.model:<16} {o.owned:>5} owned  {o.running:>5} running  "
            f"{o.waiting:>5} waiting"
            + (f"  (sequences: {tenants})" if tenants else "")
            + ("  draining" if o.draining else "")
        )
    if not s.owners:
        lines.append("  none answered")
    lines.append("queues")
    for st in s.streams:
        for c in st.consumers:
            lines.append(
                f"  {st.name:<10} {c.name:<28} {c.pending:>6} queued  "
                f"{c.in_flight:>6} in flight  {c.redelivered:>4} redelivered  "
                f"{c.pulling:>3} workers pulling"
            )
    lines.append("dead letters")
    lines += [f"  {stage:<10} {count}" for stage, count in sorted(s.dead_letters.items())]
    if not s.dead_letters:
        lines.append("  none")
    lines.append("batches")
    for b in s.batches:
        held = f"runner {b.runner}" if b.runner else "no runner"
        lines.append(
            f"  {b.id:<30} {b.status:<12} {b.completed + b.failed:>6}/{b.total:<6} "
            f"answered  {b.failed:>5} failed  ({held})"
        )
    lines.append(f"  {s.batches_ended} ended" if s.batches or s.batches_ended else "  none")
    lines.append("stored (per tenant)")
    for t in s.stored:
        lines.append(
            f"  {t.tenant or '(keyless)':<16} files {_kept(t.files)}  "
            f"responses {_kept(t.responses)}"
        )
    if not s.stored:
        lines.append("  none")
    lines.append("streams")
    for st in s.streams:
        cap = "unbounded" if st.max_bytes < 0 else _size(st.max_bytes)
        low = (
            f"  below the cluster's {s.replicas_default}: a lost server may lose it "
            f"(`tokenway provision --replicas {s.replicas_default}` raises it)"
        )
        lines.append(
            f"  {st.name:<16} {st.messages:>8} messages  {_size(st.bytes):>10} of "
            f"{cap:<10} R{st.replicas}" + (low if st.replicas_low else "")
        )
    if s.missing:
        lines.append(f"missing: {', '.join(s.missing)} (run `tokenway provision`)")
    return "\n".join(lines)
