"""Stored responses of the Responses API (`store: true`, OpenAI's default): each response
and the conversation it answered, in the `tw-responses` bucket, so that
`previous_response_id` continues a conversation on any ingress and `GET /v1/responses/{id}`
(its `input_items` too) and `DELETE` find it, for their tenant only, within the bucket's
age (`--responses-max-age`)."""

from __future__ import annotations

from typing import Any

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from tokenway import bus
from tokenway.config import Settings


class Stored(msgspec.Struct, kw_only=True):
    response: msgspec.Raw  # the response object, as its client got it
    input: list[dict[str, Any]]  # the conversation it answered, as items with ids
    tenant: str = ""


_stored = msgspec.json.Decoder(Stored)
_json = msgspec.json.Encoder()


class NotStored(LookupError):
    """No such response (or another tenant's: as absent as one that never was)."""


class AlreadyStored(LookupError):
    """A response is stored under this id already: storing never replaces one."""


class ResponseStore:
    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    @classmethod
    async def bind(cls, js: JetStreamContext, s: Settings) -> ResponseStore:
        return cls(await bus.responses_kv(js, s))

    async def put(self, response_id: str, stored: Stored) -> None:
        """Store a new response. Ids are the server's own (`resp_<stream id>`), so one is
        never stored twice; were it ever, the first stays: `AlreadyStored`."""
        try:
            await self.kv.create(response_id, _json.encode(stored))
        except KeyWrongLastSequenceError:
            raise AlreadyStored(response_id) from None

    async def get(self, response_id: str, tenant: str) -> Stored:
        try:
            entry = await self.kv.get(response_id)
        except (KeyNotFoundError, NotFoundError):
            raise NotStored(response_id) from None
        stored = _stored.decode(entry.value or b"")
        if stored.tenant != tenant:
            raise NotStored(response_id)
        return stored

    async def delete(self, response_id: str, tenant: str) -> None:
        await self.get(response_id, tenant)
        await self.kv.purge(response_id)
