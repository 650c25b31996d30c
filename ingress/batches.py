"""The OpenAI Files and Batch APIs on JetStream: `POST /v1/files` keeps a batch input file in
the `tw-files` object store, `POST /v1/batches` records a batch for the batch runners
(`workers.batch`), and the rest reads them back, in OpenAI's shapes, so the `openai` SDK's
`files` and `batches` calls work unchanged. Files and batches are their tenant's: another
tenant's are as absent as ones that never were."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Awaitable, Callable, Sequence

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.datastructures import UploadFile

from tokenway import batches
from tokenway.batch_store import BatchStore, NotFound
from tokenway.batches import ENDED, Batch, BatchRefused, FileObject, Record
from tokenway.errors import (
    Conflict,
    InvalidRequest,
    ModelNotFound,
    TokenwayError,
    TooLarge,
    error_body,
)
from tokenway.quota import FILES, UNLIMITED, Quota, QuotaExceeded

_json = msgspec.json.Encoder()
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # what file and batch ids are made of
_UPLOAD = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": ["batch"]},
                    },
                }
            }
        },
    }
}
_CREATE = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["input_file_id", "endpoint", "completion_window"],
                    "properties": {
                        "input_file_id": {"type": "string"},
                        "endpoint": {"type": "string", "enum": list(batches.ENDPOINTS)},
                        "completion_window": {"type": "string", "enum": list(batches.WINDOWS)},
                        "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                    },
                }
            }
        },
    }
}


def _ok(doc: object) -> Response:
    return Response(_json.encode(doc), media_type="application/json")


def _page(items: Sequence[FileObject | Batch], has_more: bool) -> Response:
    """OpenAI's list shape."""
    first, last = (items[0].id, items[-1].id) if items else (None, None)
    return _ok(
        {"object": "list", "data": items, "has_more": has_more, "first_id": first, "last_id": last}
    )


def _error(exc: TokenwayError) -> Response:
    return Response(error_body(exc.info()), status_code=exc.status, media_type="application/json")


async def _lookup(what: str, ident: str, answer: Callable[[], Awaitable[Response]]) -> Response:
    """`answer`, or the 404 of an id that is malformed or names nothing of the tenant's."""
    if not _ID.fullmatch(ident):
        return _error(_missing(what, ident))
    try:
        return await answer()
    except NotFound:
        return _error(_missing(what, ident))


def _missing(what: str, ident: str) -> TokenwayError:
    return ModelNotFound(f"No such {what}: {ident[:80]!r}", param="id", code=f"{what}_not_found")


def add_routes(
    app: FastAPI,
    store: Callable[[], Awaitable[BatchStore]],
    file_max_bytes: int,
    quota: Callable[[str], Quota] = lambda tenant: UNLIMITED,
) -> None:
    """`quota`: each tenant's share of the files store (its uploads and its batches'
    outputs count against it)."""

    def tenant(request: Request) -> str:
        return request.scope["state"]["tenant"]

    @app.post("/v1/files", openapi_extra=_UPLOAD)
    async def upload(request: Request) -> Response:
        limit = file_max_bytes
        if int(request.headers.get("content-length") or 0) > limit + (64 << 10):
            return _error(TooLarge(f"a file may hold at most {limit} bytes", param="file"))
        try:
            form = await request.form(max_files=1, max_fields=4)
        except Exception as exc:  # the multipart parser's refusals of a malformed body
            return _error(InvalidRequest(f"the body is not a multipart form: {exc}"))
        try:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose != "batch":
                return _error(
                    InvalidRequest(
                        "purpose must be 'batch' (the files kept here are batch input files)",
                        param="purpose",
                    )
                )
            if not isinstance(upload, UploadFile):
                return _error(InvalidRequest("the form needs a file", param="file"))
            data = await upload.read(limit + 1)
            if len(data) > limit:
                return _error(TooLarge(f"a file may hold at most {limit} bytes", param="file"))
            meta = batches.file_object(
                batches.new_id("file").replace("_", "-", 1),
                data,
                upload.filename or "upload.jsonl",
                "batch",
            )
        finally:
            await form.close()
        try:
            return _ok(
                await (await store()).put_file(meta, data, tenant(request), quota(tenant(request)))
            )
        except QuotaExceeded as exc:
            return _error(exc)

    @app.get("/v1/files")
    async def list_files(request: Request) -> Response:
        found = await (await store()).list_files(tenant(request))
        listed = [f for f in found if f.purpose != "batch_part"]
        return _page(listed, has_more=False)

    @app.get("/v1/files/{file_id}")
    async def file(file_id: str, request: Request) -> Response:
        async def read() -> Response:
            return _ok(await (await store()).file(file_id, tenant(request)))

        return await _lookup("file", file_id, read)

    @app.get("/v1/files/{file_id}/content")
    async def content(file_id: str, request: Request) -> Response:
        async def read() -> Response:
            data = await (await store()).content(file_id, tenant(request))
            return Response(data, media_type="application/octet-stream")

        return await _lookup("file", file_id, read)

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, request: Request) -> Response:
        async def delete() -> Response:
            await (await store()).delete_file(file_id, tenant(request))
            return _ok({"id": file_id, "object": "file", "deleted": True})

        return await _lookup("file", file_id, delete)

    @app.post("/v1/batches", openapi_extra=_CREATE)
    async def create(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _error(InvalidRequest("the body is not JSON"))
        if not isinstance(body, dict):
            return _error(InvalidRequest("the body must be a JSON object"))
        fields: dict[str, str] = {}
        for name in ("input_file_id", "endpoint", "completion_window"):
            value = body.get(name)
            if not isinstance(value, str):
                return _error(InvalidRequest(f"{name} must be a string", param=name))
            fields[name] = value
        meta = body.get("metadata")
        try:
            batch = batches.new_batch(
                fields["input_file_id"], fields["endpoint"], fields["completion_window"], meta
            )
        except BatchRefused as exc:
            return _error(InvalidRequest(str(exc), param=exc.param))
        kept = await store()
        if not _ID.fullmatch(batch.input_file_id):
            return _error(_missing("file", batch.input_file_id))
        try:
            given = await kept.file(batch.input_file_id, tenant(request))
        except NotFound:
            return _error(_missing("file", batch.input_file_id))
        if given.purpose != "batch":
            return _error(
                InvalidRequest("the input file is not a batch file", param="input_file_id")
            )
        share = quota(tenant(request))
        try:  # its output will be the tenant's: no room at all, no batch
            await kept.book.admits(tenant(request), share, FILES)
        except QuotaExceeded as exc:
            return _error(exc)
        await kept.create(Record(batch=batch, tenant=tenant(request), quota=share))
        return _ok(batch)

    @app.get("/v1/batches")
    async def list_batches(request: Request) -> Response:
        try:
            limit = min(max(int(request.query_params.get("limit", 20)), 1), 100)
        except ValueError:
            return _error(InvalidRequest("limit must be a number", param="limit"))
        after = request.query_params.get("after")
        mine = [r.batch for r in await (await store()).records() if r.tenant == tenant(request)]
        mine.reverse()  # newest first, as OpenAI lists them
        if after is not None:
            at = next((i for i, b in enumerate(mine) if b.id == after), None)
            mine = mine[at + 1 :] if at is not None else []
        page = mine[:limit]
        return _page(page, has_more=len(mine) > limit)

    @app.get("/v1/batches/{batch_id}")
    async def batch(batch_id: str, request: Request) -> Response:
        async def read() -> Response:
            return _ok((await (await store()).get(batch_id, tenant(request))).batch)

        return await _lookup("batch", batch_id, read)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel(batch_id: str, request: Request) -> Response:
        async def stop() -> Response:
            kept = await store()
            record = await kept.get(batch_id, tenant(request))
            if record.batch.status in ENDED:
                return _error(
                    Conflict(
                        f"Cannot cancel a batch with status {record.batch.status}", param="batch_id"
                    )
                )
            changed = await kept.change(batch_id, lambda r: batches.cancelled(r, time.time()))
            return _ok(changed.batch)

        return await _lookup("batch", batch_id, stop)
