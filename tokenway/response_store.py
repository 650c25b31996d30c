"""Stored responses of the Responses API (`store: true`, OpenAI's default): each response
and the conversation it answered, in the `tw-responses` bucket, so that
`previous_response_id` continues a conversation on any ingress and `GET /v1/responses/{id}`
(its `input_items` too) and `DELETE` find it, for their tenant only, within the bucket's
age (`TOKENWAY_RESPONSES_MAX_AGE`). Each is counted against its tenant's quota
(`tokenway.quota`) until it is deleted or its age ends."""

from __future__ import annotations

import time
from typing import Any

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from tokenway import bus
from tokenway.config import Settings
from tokenway.quota import RESPONSES, UNLIMITED, Charge, Quota, slot_width
from tokenway.quota_book import QuotaBook


class Stored(msgspec.Struct, kw_only=True):
    response: msgspec.Raw  # the response object, as its client got it
    input: list[dict[str, Any]]  # the conversation it answered, as items with ids
    tenant: str = ""
    kept_at: float = 0.0  # when it was stored (epoch seconds): its age ends a TTL later


_stored = msgspec.json.Decoder(Stored)
_json = msgspec.json.Encoder()


class NotStored(LookupError):
    """No such response (or another tenant's: as absent as one that never was)."""


class AlreadyStored(LookupError):
    """A response is stored under this id already: storing never replaces one."""


class ResponseStore:
    def __init__(self, kv: KeyValue, book: QuotaBook, ttl: float) -> None:
        self.kv = kv
        self.book = book
        self.ttl = ttl  # the bucket's: how long a response is kept
        self.width = slot_width(ttl)

    @classmethod
    async def bind(cls, js: JetStreamContext, s: Settings) -> ResponseStore:
        kv = await bus.responses_kv(js, s)
        ttl = (await kv.status()).ttl or s.responses_max_age  # whoever made it chose it
        return cls(kv, QuotaBook(await bus.stored_kv(js, s)), ttl)

    def _charge(self, size: int, kept_at: float) -> Charge:
        return Charge(RESPONSES, 1, size, kept_at + self.ttl, self.width)

    async def admits(self, tenant: str, quota: Quota) -> None:
        """`QuotaExceeded` when the tenant has no room left to store a response."""
        await self.book.admits(tenant, quota, RESPONSES)

    async def put(self, response_id: str, stored: Stored, quota: Quota = UNLIMITED) -> None:
        """Store a new response, counted for its tenant whatever its size (its client has it
        already: a tenant past its quota is refused its next `store: true` request). Ids
        are the server's own (`resp_<stream id>`), so one is never stored twice; were it
        ever, the first stays: `AlreadyStored`."""
        stored = msgspec.structs.replace(stored, kept_at=time.time())
        data = _json.encode(stored)
        charged = self._charge(len(data), stored.kept_at)
        await self.book.charge(stored.tenant, quota, charged, force=True)
        try:
            await self.kv.create(response_id, data)
        except KeyWrongLastSequenceError:
            await self.book.release(stored.tenant, charged)
            raise AlreadyStored(response_id) from None
        except Exception:
            await self.book.release(stored.tenant, charged)
            raise

    async def get(self, response_id: str, tenant: str) -> Stored:
        return (await self._entry(response_id, tenant))[0]

    async def _entry(self, response_id: str, tenant: str) -> tuple[Stored, int]:
        try:
            entry = await self.kv.get(response_id)
        except (KeyNotFoundError, NotFoundError):
            raise NotStored(response_id) from None
        stored = _stored.decode(entry.value or b"")
        if stored.tenant != tenant:
            raise NotStored(response_id)
        return stored, len(entry.value or b"")

    async def delete(self, response_id: str, tenant: str) -> None:
        stored, size = await self._entry(response_id, tenant)
        await self.kv.purge(response_id)
        await self.book.release(tenant, self._charge(size, stored.kept_at))
