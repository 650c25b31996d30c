"""vLLM's `POST /inference/v1/abort_requests` across ingresses: which generate requests this
ingress holds, by their tenant and the id their response answers under, and the word to
every ingress (`tw.abort`) to abort a tenant's ids. An ingress that holds one asks its
owner to end it "abort" (a `Cancel` with `abort`), and its client gets the output so far,
as vLLM's aborted generate call ends. A tenant's ids name its own requests only: two
tenants may choose the same."""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from tokenway import bus
from tokenway.errors import InvalidRequest
from tokenway.wire import Abort, Cancel

log = logging.getLogger(__name__)

MAX_IDS = 1024  # ids one call may name
MAX_ID_CHARS = 512

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Abort)
_ABORT = _encoder.encode(Cancel(abort=True))


class AbortBody(msgspec.Struct):
    request_ids: list[str] | str | None = None


_bodies = msgspec.json.Decoder(AbortBody)


def requested(body: bytes) -> list[str]:
    """The ids an abort_requests body names (a list, or one as a bare string)."""
    try:
        ids = _bodies.decode(body).request_ids
    except (msgspec.DecodeError, RecursionError) as exc:
        raise InvalidRequest(f"JSON decode error: {exc}") from None
    if ids is None:
        raise InvalidRequest("Missing 'request_ids' in request body", param="request_ids")
    ids = [ids] if isinstance(ids, str) else ids
    if len(ids) > MAX_IDS or any(len(i) > MAX_ID_CHARS for i in ids):
        raise InvalidRequest(
            f"at most {MAX_IDS} request ids of at most {MAX_ID_CHARS} characters each",
            param="request_ids",
        )
    return ids


class Aborts:
    def __init__(self, nc: NATS, ingress_id: str) -> None:
        self.nc = nc
        self.ingress_id = ingress_id
        # (tenant, response id) → the rids (streams) of this ingress answering under it
        self.held: defaultdict[tuple[str, str], set[str]] = defaultdict(set)
        self.names: dict[str, tuple[str, str]] = {}  # rid → its (tenant, response id)
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(bus.ABORTS, cb=self._on_abort)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()

    def hold(self, tenant: str, name: str, rid: str) -> None:
        """The request `rid` answers under `name` until it is dropped."""
        self.held[tenant, name].add(rid)
        self.names[rid] = tenant, name

    def drop(self, rid: str) -> None:
        """Its answer is over (nothing of a request never held)."""
        key = self.names.pop(rid, None)
        if key is not None:
            rids = self.held[key]
            rids.discard(rid)
            if not rids:
                del self.held[key]

    async def abort(self, tenant: str, ids: list[str]) -> None:
        """Told to every ingress, this one included; as vLLM's, nothing waits for it."""
        await self.nc.publish(bus.ABORTS, _encoder.encode(Abort(tenant=tenant, ids=ids)))

    async def _on_abort(self, msg: Msg) -> None:
        try:
            abort = _decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.warning("undecodable abort ignored: %s", exc)
            return
        for name in abort.ids:
            for rid in list(self.held.get((abort.tenant, name), ())):
                log.info("request %s (%s) aborted", rid, name)
                await self.nc.publish(bus.cancel_subject(self.ingress_id, rid), _ABORT)
