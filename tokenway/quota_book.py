"""Tenants' usage of the shared stores in the `tw-stored` bucket: one small record per
tenant, changed compare-and-set, so every ingress and batch runner keeps one count
(`tokenway.quota`)."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable

import msgspec
import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from tokenway import bus
from tokenway.errors import Unavailable
from tokenway.quota import Charge, Kept, Quota, Store, admits, charge, release

log = logging.getLogger(__name__)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Kept)
_TRIES = 32  # writers racing for one tenant's record retry this often, then a 503
KEYLESS = "_"  # the record of tenant "" (a keyless deployment: no tenant name starts so)


def key(tenant: str) -> str:
    return tenant or KEYLESS


class QuotaBook:
    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    async def charge(
        self, tenant: str, quota: Quota | None, c: Charge, force: bool = False
    ) -> None:
        """Count `c` for the tenant; `QuotaExceeded` (nothing counted) past its quota
        (None: counted whatever it costs)."""
        await self._change(tenant, lambda kept, now: charge(kept, quota, c, now, force))

    async def release(self, tenant: str, c: Charge) -> None:
        """Give back what `c` counted. Never raises: it is called once the thing is gone,
        and a release lost here leaves the tenant counted for more than it keeps (a stored
        response's until its slot ends; the log says which)."""
        try:
            await self._change(tenant, lambda kept, now: release(kept, c, now))
        except (nats.errors.Error, Unavailable) as exc:
            log.warning(
                "tenant %r stays charged %d %s (%d bytes): %r",
                tenant,
                c.count,
                c.store,
                c.bytes,
                exc,
            )

    async def admits(self, tenant: str, quota: Quota, store: Store) -> None:
        """`QuotaExceeded` when the tenant has no room at all left in `store`."""
        kept, _ = await self._read(tenant)
        admits(kept, quota, store, time.time())

    async def kept(self, tenant: str) -> Kept:
        return (await self._read(tenant))[0]

    async def _read(self, tenant: str) -> tuple[Kept, int]:
        try:
            entry = await self.kv.get(key(tenant))
        except KeyNotFoundError:
            return Kept(), 0
        return _decoder.decode(entry.value or b""), entry.revision or 0

    async def _change(self, tenant: str, change: Callable[[Kept, float], Kept]) -> None:
        for attempt in range(_TRIES):
            kept, revision = await self._read(tenant)
            changed = change(kept, time.time())
            try:
                await self.kv.update(key(tenant), _encoder.encode(changed), last=revision)
                return
            except KeyWrongLastSequenceError:  # another writer was first: read it again
                await asyncio.sleep(random.uniform(0, 0.002 * (attempt + 1)))
        raise Unavailable(f"the storage usage of tenant {tenant!r} is too contended; retry")


async def every_tenant(js: JetStreamContext, kv: KeyValue) -> dict[str, Kept]:
    """Every tenant's usage (a read: `tokenway status`), by tenant ("" for a keyless one)."""
    found = {}
    for name in sorted(await bus.kv_keys(js, bus.STORED_BUCKET)):
        try:
            entry = await kv.get(name)
        except KeyNotFoundError:
            continue
        if entry.value:
            found["" if name == KEYLESS else name] = _decoder.decode(entry.value)
    return found
