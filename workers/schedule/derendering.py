"""Where an owner's token deltas become OpenAI chunks: in the owner itself, or by the
derender pool (`--derender-placement`).

`owner` (the default) calls the derender backend in the schedule process: the local core is
pure and costs a few µs per chunk, while a call to the pool costs a request-reply on the bus
and a msgpack round of every entry with its output context, for every engine step. A large
call (a whole non-streaming response, many choices) runs in a thread, so the owner's event
loop goes on serving its other requests meanwhile. `pool` sends each call to the derender
workers on `tw.derender.<model>` (a queue group), retried with the same entries and states
when a worker dies or hangs: for a derender backend that must scale apart from the owners.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from tokenway import bus
from tokenway.config import Settings
from tokenway.errors import StageTimeout, StageUnavailable, too_big_for_the_bus
from tokenway.wire import (
    DerenderCall,
    DerenderEntry,
    DerenderFailed,
    DerenderReply,
    DerenderResult,
    responses_of,
)

log = logging.getLogger(__name__)

_encoder = msgspec.msgpack.Encoder()
_reply_decoder = msgspec.msgpack.Decoder(DerenderReply)
_BACKOFF = 0.05  # seconds before a call to the pool is tried again, times the try


class Pool:
    """The derender workers on the model's subject, as an owner's `Derenderer` (placed in
    the owner, its derender backend is one itself)."""

    awaits_io = True  # a request-reply on the bus

    def __init__(self, nc: NATS, settings: Settings, model: str) -> None:
        self.nc = nc
        self.settings = settings
        self.subject = bus.derender_subject(model)

    async def derender(self, entries: Sequence[DerenderEntry]) -> list[DerenderResult]:
        """One call, retried with the same chunks and states when a worker died or hung:
        derender is pure, so a retry cannot duplicate output, and it never re-runs inference."""
        assert self.nc is not None
        payload = _encoder.encode(DerenderCall(entries=list(entries)))  # (a list on the wire)
        if len(payload) > self.nc.max_payload:  # entries can carry the client's body
            return await self._split(entries, len(payload))
        tries = self.settings.derender_retries + 1
        for attempt in range(1, tries + 1):
            try:
                msg = await self.nc.request(
                    self.subject,
                    payload,
                    timeout=self.settings.derender_timeout,
                )
                break
            except (NatsTimeout, NoRespondersError) as exc:
                log.warning(
                    "derender call failed (%s), try %d of %d", type(exc).__name__, attempt, tries
                )
                if attempt == tries:
                    if isinstance(exc, NoRespondersError):
                        raise StageUnavailable("no derender worker is running") from exc
                    raise StageTimeout(
                        f"derender did not answer within {self.settings.derender_timeout}s, "
                        f"{tries} times"
                    ) from exc
                await asyncio.sleep(_BACKOFF * attempt)  # a worker may be restarting
        try:
            reply = _reply_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:  # garbage, or a worker of another version
            raise StageUnavailable(
                f"derender answered in a shape this owner cannot read (a derender worker of "
                f"another version?): {exc}"
            ) from exc
        if reply.error is not None:
            raise StageUnavailable(f"derender rejected the call: {reply.error.message}")
        if len(reply.results) != len(entries):
            raise StageUnavailable("derender answered a different number of entries")
        return reply.results

    async def _split(self, entries: Sequence[DerenderEntry], size: int) -> list[DerenderResult]:
        """A call over the bus's payload limit as two; a whole response's choices stay in one
        (derender merges them: `responses_of`, its run of entries, never its id, which two
        requests may share), and one that alone is too big fails with the reason."""
        runs = responses_of(entries)
        if len(runs) == 1:  # one response's output: more than the client may ask for here
            assert self.nc is not None
            error = too_big_for_the_bus(size, self.nc.max_payload).info()
            return [DerenderFailed(error=error) for _ in entries]
        half = runs[len(runs) // 2].start
        parts = await asyncio.gather(self.derender(entries[:half]), self.derender(entries[half:]))
        return parts[0] + parts[1]

    async def aclose(self) -> None:
        pass
