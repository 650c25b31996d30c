"""Tenants' usage in the `tw-tenants` bucket: admissions and releases by compare-and-set,
so any number of render workers and owners keep one count per tenant (`tokenway.tenancy`)."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable

import msgspec
import nats.errors
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from tokenway.errors import Unavailable
from tokenway.tenancy import Limits, Refused, Usage, admit, release

log = logging.getLogger(__name__)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Usage)
# Writers racing for one tenant's record retry this often before the request gets a 503.
_TRIES = 32


class TenantBook:
    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    async def admit(
        self, tenant: str, limits: Limits, rid: str, cost: int, until: float
    ) -> Refused | None:
        """Lease the request a slot and charge its tokens; why not, when it may not run."""
        return await self._change(tenant, lambda u: admit(u, limits, rid, cost, time.time(), until))

    async def release(self, tenant: str, rid: str) -> None:
        """Give the request's slot back (a request without a lease changes nothing). Never
        raises: it is called on the way out, and a lease not given back lapses by itself."""
        try:
            await self._change(tenant, lambda u: release(u, rid, time.time()))
        except (nats.errors.Error, Unavailable) as exc:
            log.warning(
                "the lease of request %s (tenant %s) stays until its deadline: %r", rid, tenant, exc
            )

    async def _change(
        self, tenant: str, change: Callable[[Usage], Usage | Refused | None]
    ) -> Refused | None:
        for attempt in range(_TRIES):
            try:
                entry = await self.kv.get(tenant)
                usage, revision = _decoder.decode(entry.value or b""), entry.revision or 0
            except KeyNotFoundError:
                usage, revision = Usage(), 0
            changed = change(usage)
            if not isinstance(changed, Usage):
                return changed
            try:
                await self.kv.update(tenant, _encoder.encode(changed), last=revision)
                return None
            except KeyWrongLastSequenceError:  # another writer was first: read it again
                await asyncio.sleep(random.uniform(0, 0.002 * (attempt + 1)))
        raise Unavailable(f"the usage of tenant {tenant} is too contended to update; retry")
