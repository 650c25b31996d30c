"""Multi-prompt requests: one sub-request per prompt, their output merged into one stream.

The schedule worker that takes a request with `prompts` owns it like any other (a `Parent`
in its one table: it holds its TW_SCHED message, kept alive by in-progress acks, and ends it
in its one exit) but runs no engine for it. It publishes one ordinary single-prompt
request per prompt to `tw.sched.<model>`, each with a request id of its own and this
worker's fan-out reply address, so every prompt gets the normal owner, flow control,
derender and ledger. It reads their committed output the way an ingress does (one wildcard
subscription, routed by rid) and commits the merge (`merge.py`) to the request's own
ledger, with its own `Tw-Seq`: SSE resume works on it.

Any prompt failing, the client leaving or the deadline cancels every sibling and waits
until their owners released them (their TW_SCHED messages are gone). Before anything was
committed, a failure of a failing stage or engine retries the whole request (new sub
request ids); after, never: per-prompt relay after output is not built, and a request
redelivered to a new owner after output ends with an explicit error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import APIError, NotFoundError

from tokenway import bus, ledger
from tokenway import headers as h
from tokenway.aio import wait_any
from tokenway.bus import is_stream_full
from tokenway.config import Settings
from tokenway.errors import (
    DeadlineExceeded,
    StageUnavailable,
    TokenwayError,
)
from tokenway.output_router import Event, OutputRouter, Slot
from tokenway.wire import OUTPUTS, SEED_TOKENS, TERMINAL_KINDS, ErrorInfo, GenerateRequest
from tokenway.worker import overloaded
from workers.schedule.merge import Merge, Output, retryable
from workers.schedule.owned import DONE, Held

log = logging.getLogger(__name__)

_encoder = msgspec.msgpack.Encoder()
# How long a cancelled sibling's owner may take to let go of it, and how often to look.
_RELEASE_TIMEOUT = 10.0
_RELEASE_POLL = (0.005, 0.25)
_NOT_RESUMABLE = (
    "the owner of this multi-prompt request was lost after output was sent; "
    "multi-prompt requests cannot be resumed after output"
)


class SubSlot(Slot):
    """A prompt's committed output as it arrives: wakes its request, and a gap in the
    delivered sequence that reading back could not fill (lost output) breaks it instead of
    passing with a warning."""

    def __init__(self, wake: asyncio.Event) -> None:
        super().__init__()
        self.wake = wake
        self.broken: str | None = None

    def put(self, event: Event) -> None:
        if event.seq > self.last_seq + 1 and self.broken is None:
            self.broken = f"lost output: event {self.last_seq + 1} never arrived"
        super().put(event)
        self.wake.set()


@dataclass(eq=False)
class Parent(Held):
    """A multi-prompt request this worker owns: it runs no engine, its prompts run as
    requests of their own."""

    wake: asyncio.Event = field(default_factory=asyncio.Event)  # output arrived

    def hand_over(self) -> None:
        """Its prompts' owners hold what they made, not this worker's ledger position: it
        ends here instead of going on under a peer."""
        self.fail(StageUnavailable("the schedule worker shut down").info())

    def sub_request(self, k: int, rid: str) -> GenerateRequest:
        """Prompt `k` as an ordinary request: its budget, its context, global choice indexes."""
        req = self.request
        prompt = req.prompts[k]  # type: ignore[index]
        ids = prompt.token_ids
        params = req.sampling_params
        if prompt.max_tokens is not None:
            params = msgspec.structs.replace(params, max_tokens=prompt.max_tokens)
        ctx = msgspec.structs.replace(
            req.context,
            prompt_tokens=len(ids),
            prompt_tail=ids[-SEED_TOKENS:],
            index_base=k * max(params.n, 1),
            closing_usage=False,
        )
        return msgspec.structs.replace(
            req, request_id=rid, token_ids=ids, sampling_params=params, context=ctx, prompts=None
        )


class FanOut:
    """Runs the multi-prompt requests its schedule worker owns; the worker holds them, as
    every request, in its one table and ends them in its one exit."""

    def __init__(self, nc: NATS, settings: Settings, model: str, owner_id: str) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.settings = settings
        self.model = model
        # Sub-requests' output comes back to this address as if it were an ingress.
        self.router = OutputRouter(nc, f"{owner_id}-fan")

    # -- one request ------------------------------------------------------------------------

    async def own(self, p: Parent) -> None:
        """Run it until it ends; how is `p.end`."""
        if p.msg.metadata.num_delivered > 1 and not await self._may_start_over(p):
            return
        for attempt in range(1, self.settings.fanout_retries + 2):
            if p.ended.is_set():
                return
            error = await self._attempt(p, attempt)
            if error is None:
                p.end_as(DONE)
                return
            last = attempt > self.settings.fanout_retries
            if p.out_seq or last or not retryable(error):
                p.fail(error)
                return
            log.warning(
                "multi-prompt request %s failed before output (%s); attempt %d",
                p.rid,
                error.message,
                attempt + 1,
            )

    async def _attempt(self, p: Parent, attempt: int) -> ErrorInfo | None:
        """Run every prompt once and merge their output: None when the request ended (or
        the client left), else why it failed. Siblings are released on every exit."""
        prompts = p.request.prompts or []
        base = f"{p.key}-{p.msg.metadata.num_delivered}-{attempt}"
        rids = [f"{base}-{k}" for k in range(len(prompts))]
        total = sum(len(prompt.token_ids) for prompt in prompts)
        merge = Merge(p.request.context, total, len(prompts), self.settings.fanout_buffer)
        slots = [SubSlot(p.wake) for _ in rids]
        for rid, slot in zip(rids, slots, strict=True):
            self.router.open(rid, slot)
        published: dict[str, int] = {}  # sub rid → its TW_SCHED stream sequence
        try:
            for k, rid in enumerate(rids):
                published[rid] = await self._publish(p, p.sub_request(k, rid))
            while not (merge.ended or merge.error or p.ended.is_set()):
                p.wake.clear()
                for k, slot in enumerate(slots):
                    if slot.broken is not None:
                        merge.fail(k, slot.broken)
                    for event in slot.events:
                        merge.add(k, event)
                    slot.events.clear()
                out = merge.take()
                if out is not None:
                    await self._commit(p, out)
                    continue
                remaining = p.deadline - time.time()
                if remaining <= 0:
                    return DeadlineExceeded(
                        f"multi-prompt request {p.rid} passed its deadline"
                    ).info()
                await wait_any(p.wake, p.ended, timeout=remaining)
        except TokenwayError as exc:
            return exc.info()
        finally:
            for rid in rids:
                self.router.close(rid)
            live = {r: s for k, (r, s) in enumerate(published.items()) if not merge.subs[k].done}
            await self._release(live)
        return merge.error

    async def _publish(self, p: Parent, sub: GenerateRequest) -> int:
        sub_of = ledger.Identity(
            sub.request_id,
            self.router.ingress_id,
            p.deadline,
            p.tenant,
            trace=p.trace,
            batch=p.batch,
        )
        headers = sub_of.headers()
        try:
            ack = await self.js.publish(
                bus.sched_subject(self.model, p.batch), _encoder.encode(sub), headers=headers
            )
        except APIError as exc:
            if is_stream_full(exc):
                raise overloaded("schedule") from exc
            raise StageUnavailable(f"could not queue a prompt: {exc.description}") from exc
        except NatsTimeout as exc:
            raise StageUnavailable("could not queue a prompt: no answer from JetStream") from exc
        return ack.seq

    async def _commit(self, p: Parent, out: Output) -> None:
        # Counted before the publish: an unanswered publish may still have been stored, so
        # the request counts as having shown output (no retry after it).
        p.out_seq += 1
        event = OUTPUTS[out.kind](rid=p.rid, seq=p.out_seq, payload=out.payload)
        try:
            await ledger.commit(self.nc, p.reply, p.rid, [event], tenant=p.tenant)
        except Exception as exc:
            raise StageUnavailable(f"could not commit output to the ledger: {exc!r}") from exc

    async def _release(self, live: dict[str, int]) -> None:
        """Cancel sub-requests still running and wait until their owners let go of them
        (acked: gone from the work queue), so their capacity is free when we answer."""
        delay, cap = _RELEASE_POLL
        give_up = time.monotonic() + _RELEASE_TIMEOUT
        while live:
            for rid in live:  # again each round: an owner that took it since may have missed it
                await self.nc.publish(bus.cancel_subject(self.router.ingress_id, rid), b"")
            await asyncio.sleep(delay)
            delay = min(delay * 2, cap)
            for rid, seq in list(live.items()):
                try:
                    await self.js.get_msg(bus.SCHED_STREAM, seq)
                except NotFoundError:
                    del live[rid]
            if live and time.monotonic() > give_up:
                log.warning(
                    "sub-requests %s still held after %.0fs", sorted(live), _RELEASE_TIMEOUT
                )
                return

    async def _may_start_over(self, p: Parent) -> bool:
        """A redelivered request (its owner was lost): start over when nothing was shown,
        else end it with an explicit error (or just let go when it already ended)."""
        try:
            last = await self.js.get_last_msg(bus.OUT_STREAM, bus.out_subject(p.reply, p.rid))
        except NotFoundError:
            await self._cancel_lost_owner_subs(p)
            return True
        hdrs = last.headers or {}
        if hdrs.get(h.KIND, h.KIND_CHUNK) in TERMINAL_KINDS:
            p.end_as(DONE)  # by its last owner
        else:
            p.out_seq = int(hdrs[h.SEQ])
            p.fail(StageUnavailable(_NOT_RESUMABLE).info())
        return False

    async def _cancel_lost_owner_subs(self, p: Parent) -> None:
        """The lost owner's sub-requests may still run: cancel every id it could have used."""
        prompts = len(p.request.prompts or [])
        for delivery in range(1, p.msg.metadata.num_delivered):
            for attempt in range(1, self.settings.fanout_retries + 2):
                for k in range(prompts):
                    rid = f"{p.key}-{delivery}-{attempt}-{k}"
                    await self.nc.publish(bus.cancel_subject(self.router.ingress_id, rid), b"")
