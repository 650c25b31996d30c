"""Where the Batch API's files and batches live on JetStream: the `tw-files` object store
(each file's bytes; its OpenAI file object and tenant in the object's description) and the
`tw-batches` bucket (each batch's `Record`, changed compare-and-set, so the ingress and
every runner can write it without losing one another's change). Every file counts against
its tenant's quota (`tokenway.quota`) from its writing to its deletion.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
from nats.js import JetStreamContext
from nats.js import api as jsapi
from nats.js.errors import (
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
    ObjectNotFoundError,
)
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from tokenway import bus
from tokenway.batches import FileObject, Record
from tokenway.config import Settings
from tokenway.quota import FILES, Charge, Quota
from tokenway.quota_book import QuotaBook

_record = msgspec.json.Decoder(Record)
_json = msgspec.json.Encoder()


class _Described(msgspec.Struct, kw_only=True):
    file: FileObject
    tenant: str = ""


_described = msgspec.json.Decoder(_Described)


class NotFound(LookupError):
    """No such file or batch (or another tenant's: as absent as one that never was)."""


class BatchStore:
    def __init__(
        self, js: JetStreamContext, files: ObjectStore, kv: KeyValue, book: QuotaBook
    ) -> None:
        self.js = js
        self.files = files
        self.kv = kv
        self.book = book

    @classmethod
    async def bind(cls, js: JetStreamContext, s: Settings) -> BatchStore:
        return cls(
            js,
            await bus.files_store(js, s),
            await bus.batches_kv(js, s),
            QuotaBook(await bus.stored_kv(js, s)),
        )

    # -- files ----------------------------------------------------------------------------

    async def put_file(
        self, meta: FileObject, data: bytes, tenant: str, quota: Quota | None = None
    ) -> FileObject:
        """Keep a file, counted for its tenant: `QuotaExceeded`, and nothing kept, past
        `quota` (None: counted, never refused: an output file replacing the parts it is
        made of). A file written again under its id (a part, an output written again after
        a takeover) is counted once, at its new size."""
        try:
            before: int | None = (await self.files.get_info(meta.id)).size or 0
        except ObjectNotFoundError:
            before = None
        charged = Charge(FILES, 1 if before is None else 0, len(data) - (before or 0))
        await self.book.charge(tenant, quota, charged)
        about = _json.encode(_Described(file=meta, tenant=tenant)).decode()
        described = jsapi.ObjectMeta(name=meta.id, description=about)
        try:
            await self.files.put(meta.id, data, meta=described)
        except Exception:
            await self.book.release(tenant, charged)
            raise
        return meta

    async def file(self, file_id: str, tenant: str) -> FileObject:
        try:
            info = await self.files.get_info(file_id)
        except ObjectNotFoundError:
            raise NotFound(file_id) from None
        about = _described.decode(info.description or "")
        if about.tenant != tenant:
            raise NotFound(file_id)
        return about.file

    async def content(self, file_id: str, tenant: str) -> bytes:
        await self.file(file_id, tenant)
        try:
            return (await self.files.get(file_id)).data or b""
        except ObjectNotFoundError:
            raise NotFound(file_id) from None

    async def list_files(self, tenant: str) -> list[FileObject]:
        found = []
        seq = 1  # each object's description is its meta subject's one message (a rollup)
        while True:
            try:
                msg = await self.js.get_msg(
                    bus.FILES_STREAM, seq=seq, next=True, subject=f"$O.{bus.FILES_BUCKET}.M.>"
                )
            except NotFoundError:
                break
            seq = (msg.seq or seq) + 1
            info = jsapi.ObjectInfo.from_response(msgspec.json.decode(msg.data or b"{}"))
            if not info.deleted:
                about = _described.decode(info.description or "")
                if about.tenant == tenant:
                    found.append(about.file)
        return sorted(found, key=lambda f: (f.created_at, f.id))

    async def delete_file(self, file_id: str, tenant: str) -> None:
        """Delete one of the tenant's files (a batch's part too), given back to its quota."""
        meta = await self.file(file_id, tenant)
        try:
            info = await self.files.get_info(file_id)
            await self.files.delete(file_id)
        except ObjectNotFoundError:
            raise NotFound(file_id) from None  # deleted meanwhile, by whoever gave it back
        await self.book.release(tenant, Charge(FILES, 1, info.size or meta.bytes))

    # -- batches --------------------------------------------------------------------------

    async def create(self, record: Record) -> None:
        await self.kv.create(record.batch.id, _json.encode(record))

    async def get(self, batch_id: str, tenant: str | None = None) -> Record:
        """The batch's record (`tenant` given: only that tenant's)."""
        record, _ = await self._read(batch_id)
        if tenant is not None and record.tenant != tenant:
            raise NotFound(batch_id)
        return record

    async def change(self, batch_id: str, change: Callable[[Record], Record | None]) -> Record:
        """Apply `change` to the current record and store it compare-and-set, trying again
        on a concurrent write; `change` returning None leaves it as it is."""
        while True:
            record, revision = await self._read(batch_id)
            changed = change(record)
            if changed is None:
                return record
            try:
                await self.kv.update(batch_id, _json.encode(changed), last=revision)
                return changed
            except KeyWrongLastSequenceError:
                await asyncio.sleep(0)  # another writer was first: read theirs, change that

    async def records(self) -> list[Record]:
        """Every batch (for runners and listings), oldest first."""
        return await records(self.js, self.kv)

    async def _read(self, batch_id: str) -> tuple[Record, int]:
        return await _read(self.kv, batch_id)


async def records(js: JetStreamContext, kv: KeyValue) -> list[Record]:
    """Every batch in the `tw-batches` bucket, oldest first (a read: `tokenway status`)."""
    out = []
    for key in await bus.kv_keys(js, bus.BATCHES_BUCKET):
        try:
            out.append((await _read(kv, key))[0])
        except NotFound:
            continue
    return sorted(out, key=lambda r: (r.batch.created_at, r.batch.id))


async def _read(kv: KeyValue, batch_id: str) -> tuple[Record, int]:
    try:
        entry = await kv.get(batch_id)
    except KeyNotFoundError:
        raise NotFound(batch_id) from None
    if not entry.value:
        raise NotFound(batch_id)
    return _record.decode(entry.value), entry.revision or 0
