"""Schedule shell: the request owner.

Pulls `tw.sched.<model>` only while engines have room, dispatches to an engine, turns the
engine's token steps into derender calls (one call per batch of ready requests), commits the
results to `TW_OUT`, and holds the request's message un-acked, with in-progress acks, until
the request ends; a multi-prompt request is held the same way and run by `fanout.py`. When
an engine fails an attempt the owner relays: a new attempt on another engine continues from
the committed output. A request redelivered after its owner died is first read back from
its ledger. Every request, every path (done, error, cancel, deadline, hand-over), ends in
one `_finish`, and how it ended is one value (`owned.Outcome`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from array import array
from collections import OrderedDict
from functools import partial

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import MaxPayloadError
from nats.js import JetStreamContext
from nats.js.errors import APIError, NotFoundError

from tokenway import bus, ledger, ledger_writer, spans, token_only
from tokenway import headers as h
from tokenway import metrics as stage_metrics
from tokenway.aio import grace, wait_any
from tokenway.config import Settings
from tokenway.derendering import Derenderer, is_large
from tokenway.errors import (
    DeadlineExceeded,
    EngineFailed,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    StageTimeout,
    StageUnavailable,
    Unavailable,
    internal,
    too_big_for_the_bus,
)
from tokenway.limits import RequestLimits
from tokenway.model import ModelInfo
from tokenway.obfuscation import Permutation
from tokenway.registry import EngineRegistry, bucket_ttl
from tokenway.sse import framed
from tokenway.tenant_book import TenantBook
from tokenway.wire import (
    OUTPUTS,
    Cancel,
    Delivered,
    Derendered,
    DerenderEntry,
    DerenderFailed,
    DerenderResult,
    EngineAbort,
    GenerateRequest,
    HandOver,
    OwnerInfo,
    TokenDelta,
    TokenStep,
    Whole,
)
from tokenway.worker import Behind, consume
from workers.schedule import isolation, metrics
from workers.schedule.derendering import Pool
from workers.schedule.dispatch import Dispatcher
from workers.schedule.fanout import FanOut, Parent
from workers.schedule.owned import (
    DONE,
    Choice,
    HandedOver,
    Owned,
    Superseded,
    first_attempt,
    refusal,
)
from workers.schedule.rounds import Rounds, Staged, TakenOver

log = logging.getLogger(__name__)

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(GenerateRequest)
_step_decoder = msgspec.msgpack.Decoder(TokenStep)
_handover_decoder = msgspec.msgpack.Decoder(HandOver)
_cancel_decoder = msgspec.msgpack.Decoder(Cancel)

# Cancels for requests not (yet) owned here are remembered this long, in count.
_CANCEL_MEMORY = 10_000
# Hand-overs heard from stopping peers, kept until taken over: every owner of the model hears
# each one and one takes it, so they are bounded by the tokens they hold (4 bytes each).
_HANDOVER_TOKENS = 1 << 22
_TAKEOVER_TRIES = 5  # reads of a ledger whose last owner indexes it meanwhile
# Engine work still reporting to us that we no longer want is aborted again this often.
_REABORT_EVERY = 1.0
_DERENDER_BACKOFF = 0.05

# A derender work item: the request, its choice (None: the closing usage chunk), the entry.
Work = tuple[Owned, Choice | None, DerenderEntry]
# What to commit of one result: its choice, the result, kind, payload and its tokens.
Publication = tuple[Choice | None, Derendered, str, bytes, list[int]]


class ScheduleService:
    name = "schedule"

    def __init__(
        self,
        settings: Settings,
        model: str,
        info: ModelInfo,
        obfuscation: Permutation | None = None,
        derenderer: Derenderer | None = None,
    ) -> None:
        """`derenderer`: a derender backend of this process, which the program builds where
        derendering is placed in the owner (the default); None: the derender workers' pool."""
        self.settings = settings
        self.model = model
        self.model_info = info
        self._clip = settings.context_budget == "on"
        self._limits = RequestLimits.of(settings)  # for direct publishers' constraints
        self.observed = metrics.Observed(model)
        self.obfuscation = obfuscation
        self.owner_id = f"s{secrets.token_hex(4)}"
        # What it owns, run on an engine or fanned out over its prompts: by key
        # (`ledger.request_key`), not by rid.
        self.requests: dict[str, Owned | Parent] = {}
        self._parents = 0  # the fanned-out among them (`--max-fanout`)
        self.empty = asyncio.Event()
        self.started = asyncio.Event()  # it owns requests
        self.empty.set()
        # (reply, rid) → whether vLLM's abort_requests asked (else the client left)
        self._cancelled: OrderedDict[tuple[str, str], bool] = OrderedDict()
        self._handovers: OrderedDict[str, ledger.Committed] = OrderedDict()  # by request key
        self._handover_tokens = 0
        self._unwanted: OrderedDict[tuple[str, int], float] = OrderedDict()  # (key, attempt)
        self._ready: dict[str, Owned] = {}  # what the next derender + commit round looks at
        self._work = asyncio.Event()  # set when `_ready` gained a request
        self._nc: NATS | None = None
        self._js: JetStreamContext | None = None
        self._ledger: Rounds | None = None
        self._book: TenantBook | None = None
        self._group: asyncio.TaskGroup | None = None
        self.registry: EngineRegistry | None = None
        self.dispatcher: Dispatcher | None = None
        self.fanout: FanOut | None = None  # runs the multi-prompt requests
        self._backend = derenderer
        self.derenderer: Derenderer | None = None
        self._draining = False

    # -- lifecycle ------------------------------------------------------------------------

    async def run(self, nats_url: str, stop: asyncio.Event) -> None:
        nc = self._nc = await bus.connect(
            nats_url, f"tokenway-schedule-{self.owner_id}", self.settings, stop=stop
        )
        js = self._js = nc.jetstream()
        writer = ledger_writer.LedgerWriter(nc, js, self.settings.bus_retry)
        await writer.start()
        # A round record keeps a tenth of NATS's max payload for its headers and framing.
        self._ledger = Rounds(writer, js, self.owner_id, nc.max_payload * 9 // 10)
        self.derenderer = self._backend if self._backend else Pool(nc, self.settings, self.model)
        kv = await bus.engines_kv(js, self.settings)
        self.registry = EngineRegistry(
            kv, (self.model,), await bucket_ttl(kv, self.settings.engine_ttl)
        )
        self.registry.on_removed.append(self._engine_gone)
        self.dispatcher = Dispatcher(
            nc, self.owner_id, self.registry, self.settings, self.obfuscation, self.model
        )
        self._book = TenantBook(await bus.tenants_kv(js, self.settings))
        self.fanout = FanOut(nc, self.settings, self.model, self.owner_id)
        await self.fanout.router.start()
        # What it owns stays its own (progress acks, the engines' registry) until drained.
        drained = asyncio.Event()
        async with asyncio.TaskGroup() as group:
            self._group = group
            group.create_task(self.registry.run(drained))
            await nc.subscribe(bus.tok_subject(self.owner_id), cb=self._on_tokens)
            await nc.subscribe(bus.CANCELS, cb=self._on_cancel)
            await nc.subscribe(bus.OWNERS_SUBJECT, cb=self._on_owners)
            await nc.subscribe(bus.handover_subject(self.model), cb=self._on_handover)
            group.create_task(self._keepalive(drained))
            rounds = group.create_task(self._rounds())
            log.info("schedule %s owning %s", self.owner_id, self.model)
            self.started.set()
            await consume(
                js,
                bus.sched_consumer(self.settings, self.model),
                self._on_request,
                stop,
                batch=self._capacity,
                freed=self.dispatcher.freed,
                behind=Behind(
                    bus.sched_consumer(self.settings, self.model, batch=True),
                    partial(self.dispatcher.may_pull, batch=True),
                ),
            )
            handed = await self._shutdown(grace(stop, self.settings.drain_timeout))
            drained.set()
            rounds.cancel()
        await self.fanout.router.stop()
        await bus.drain(nc)
        await self.derenderer.aclose()
        left = f"{_requests(handed)} handed over" if handed else "nothing left to hand over"
        log.info("schedule %s stopped: %s", self.owner_id, left)

    async def _shutdown(self, within: float) -> int:
        """Stop fetching (done by now), let owned requests finish within `within` seconds,
        then hand the rest over: a NAK redelivers each at once to a peer, which continues
        it from the ledger (no waiting out the owner's ack wait). How many it handed over."""
        self._draining = True
        if self.requests:
            log.info("schedule %s draining: %d requests", self.owner_id, len(self.requests))
        try:
            await asyncio.wait_for(self.empty.wait(), within)
            return 0
        except TimeoutError:
            handed = list(self.requests.values())
            for r in handed:
                r.hand_over()
            await self.empty.wait()
        log.info(
            "schedule %s handed %s back to %s after a %gs drain: the other schedule "
            "workers of %s continue them from the ledger",
            self.owner_id,
            _requests(len(handed)),
            bus.SCHED_STREAM,
            within,
            self.model,
        )
        return len(handed)

    def _capacity(self) -> int:
        if self.dispatcher is None:
            return 0
        room = self.settings.max_inflight - (len(self.requests) - self._parents)
        return min(room, self.dispatcher.may_pull(), 64)

    async def _keepalive(self, stop: asyncio.Event) -> None:
        """In-progress acks keep our messages ours while requests run longer than the
        owner's ack wait; four per wait, so one that is late or lost does not cost them."""
        while not stop.is_set():
            await wait_any(stop, timeout=self.settings.owner_ack_wait / 4)
            for msg in [r.msg for r in self.requests.values()]:
                try:
                    await msg.in_progress()
                except nats.errors.Error as exc:  # NATS away: the next round retries
                    log.warning("in-progress ack on %s failed: %r", msg.subject, exc)
            if self.dispatcher is not None:
                self.dispatcher.index.expire(time.monotonic())

    def owned(self, reply: str, rid: str) -> Owned | Parent | None:
        """The request of that reply and id, while it is owned here."""
        return self.requests.get(ledger.request_key(reply, rid))

    def info(self) -> OwnerInfo:
        """What it owns now, for `tokenway status`."""
        line = self.dispatcher.line if self.dispatcher is not None else None
        return OwnerInfo(
            id=self.owner_id,
            model=self.model,
            owned=len(self.requests),
            running=sum(
                isinstance(r, Owned) and r.engine is not None for r in self.requests.values()
            ),
            waiting=len(line) if line is not None else 0,
            tenants=dict(line.running) if line is not None else {},
            draining=self._draining,
        )

    async def _on_owners(self, msg: Msg) -> None:
        try:
            await msg.respond(_encoder.encode(self.info()))
        except nats.errors.Error as exc:  # the asker is gone, or NATS is away
            log.debug("owner status not sent: %r", exc)

    # -- intake ---------------------------------------------------------------------------

    async def _on_request(self, msg: Msg) -> None:
        assert self._js is not None and self._group is not None
        try:
            who = ledger.Identity.of(msg)
        except (KeyError, ValueError) as exc:
            why = f"no valid request headers: {ledger.what_is_wrong(exc)}"
            await ledger.dead_letter(self._js, "schedule", msg, "decode", why)
            return
        try:
            request = _request_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            why = f"undecodable request: {exc}"
            await ledger.dead_letter(self._js, "schedule", msg, "decode", why)
            return
        rid, key = who.rid, who.key
        if key in self.requests:  # redelivered while we still own it: keep the newest handle
            self.requests[key].msg = msg
            return
        aborted = self._cancelled.get((who.reply, rid))
        if aborted is False:  # its client left: nobody to run it for
            if who.limits and self._book is not None:
                await self._book.release(who.tenant, rid)
            await msg.ack()
            return
        refused = None
        try:
            if token_only.is_direct(request):  # vLLM's token-only body: no output context yet
                request = token_only.completed(
                    request, self.model, self.model_info, self._clip, self._limits
                )
            isolation.check_kv_transfer(
                request.kv_transfer_params, who.tenant, self.settings.trust_client_kv_transfer
            )
            isolation.check_salt(request.cache_salt)
        except (InvalidRequest, ModelNotFound) as exc:
            refused = exc.info()
        deadline = who.deadline
        if deadline is None:
            deadline = time.time() + self.settings.request_timeout
        if request.prompts and refused is None:  # one request per prompt
            self._fan_out(msg, who, deadline, request)
            return
        if refused is None:  # tenants' prompts cached apart (a multi-prompt one's: per prompt)
            salt = isolation.cache_salt(
                who.tenant, request.cache_salt, self.settings.share_prefix_cache
            )
            request = msgspec.structs.replace(request, cache_salt=salt)
        span = spans.start(
            "schedule", who.trace or None, request_id=rid, model=self.model, owner=self.owner_id
        )
        r = Owned(
            rid=rid,
            reply=who.reply,
            request=request,
            deadline=deadline,
            msg=msg,
            tenant=who.tenant,
            key=key,
            leased=bool(who.limits),
            batch=who.batch,
            arrived=msg.metadata.timestamp.timestamp(),
            attempt=first_attempt(msg.metadata.num_delivered),
            trace=span.traceparent() or who.trace,
            span=span,
        )
        if refused is not None:  # its error event goes out on the way out, nothing runs
            r.fail(refused)
        elif aborted:  # before it ran: it ends at once, with no output
            r.abort()
            self._kick([r])
        self._hold(r)
        self._group.create_task(self._own(r))

    def _fan_out(
        self, msg: Msg, who: ledger.Identity, deadline: float, request: GenerateRequest
    ) -> None:
        assert self._group is not None
        p = Parent(
            rid=who.rid,
            reply=who.reply,
            request=request,
            deadline=deadline,
            msg=msg,
            tenant=who.tenant,
            key=who.key,
            leased=bool(who.limits),
            batch=who.batch,
            trace=who.trace,
        )
        if self._parents >= self.settings.max_fanout:  # its error goes out on the way out
            p.fail(
                Overloaded(
                    f"this worker owns {self.settings.max_fanout} multi-prompt "
                    "requests (--max-fanout); retry later",
                    code="queue_full",
                ).info()
            )
        self._hold(p)
        self._group.create_task(self._own(p))

    def _hold(self, r: Owned | Parent) -> None:
        """In the one table until `_finish` takes it out."""
        self.requests[r.key] = r
        self._parents += isinstance(r, Parent)
        self.empty.clear()

    async def _own(self, r: Owned | Parent) -> None:
        """Run the request (on engines, or fanned out over its prompts) until it ends."""
        assert self.fanout is not None
        try:
            if isinstance(r, Parent):
                if not r.ended.is_set():
                    await self.fanout.own(r)
            else:
                await self._run(r)
        except TimeoutError:
            r.fail(
                DeadlineExceeded(
                    f"request {r.rid} passed its deadline after {r.out_seq} chunks"
                ).info()
            )
        except (
            EngineFailed,
            StageUnavailable,
            Unavailable,
            DeadlineExceeded,
            InvalidRequest,
        ) as exc:
            r.fail(exc.info())
        except Exception:  # a bug fails this request, never the worker
            log.exception("owning %s failed", r.rid)
            r.fail(internal(r.rid))
        finally:
            await self._finish(r)

    async def _run(self, r: Owned) -> None:
        """Dispatch and relay its attempts until it ends; TimeoutError at its deadline."""
        assert self.dispatcher is not None
        if r.msg.metadata.num_delivered > 1 and not await self._read_back(r):
            return  # its last owner finished it
        while not r.ended.is_set():
            if r.trouble.is_set():
                again = await self._relay(r)
            else:  # aborted before it ran: its end is derendered without an engine
                again = not r.aborted
            if again:
                await self.dispatcher.dispatch(r)
            await wait_any(r.ended, r.trouble, timeout=max(r.deadline - time.time(), 0))
            if not (r.ended.is_set() or r.trouble.is_set()):
                raise TimeoutError

    async def _relay(self, r: Owned) -> bool:
        """The live attempt failed at its engine (or its owner died): roll back to the
        committed output and prepare the attempt that continues it on another engine.
        False when no engine is needed any more."""
        assert self.dispatcher is not None and r.broken is not None
        if r.relays >= self.settings.relay_attempts:
            raise EngineFailed(f"{r.broken.message} (after {r.relays} relays)")
        await wait_any(r.settled, r.ended)  # what is in flight commits, or not, first
        if r.ended.is_set():
            return False
        if r.engine is not None:
            r.avoid.add(r.engine)
            await self.dispatcher.abort(r.engine, r.key, r.attempt)
        self.dispatcher.release(r)
        if not await self._still_ours(r):  # learnt before the engine is asked again
            log.warning("request %s: another owner wrote its ledger since; letting it go", r.rid)
            r.supersede()
            return False
        self.observed.relays.inc()
        log.warning(
            "request %s: %s; relaying after %d committed chunks (relay %d)",
            r.rid,
            r.broken.message,
            r.out_seq,
            r.relays + 1,
        )
        if not r.relay():  # the budget is spent (or it was aborted): only the end is left
            self._kick([r])
            return False
        await wait_any(r.ended, timeout=self.settings.relay_backoff * (r.relays - 1))
        return not r.ended.is_set()

    async def _still_ours(self, r: Owned) -> bool:
        """Whether the request's index still ends where this owner left it. A peer that took
        the request over while this worker stalled past its hold has written there since;
        one read, where a relay would otherwise start engine work for nobody. Unanswered:
        taken as ours, since the ledger's fence refuses a stale owner's next write anyway."""
        assert self._js is not None
        try:
            last = await self._js.get_last_msg(bus.OUT_STREAM, bus.out_subject(r.reply, r.rid))
        except NotFoundError:
            return r.index_seq == 0
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("request %s: its ledger unread before relaying (%r)", r.rid, exc)
            return True
        return last.seq == r.index_seq

    async def _read_back(self, r: Owned) -> bool:
        """A new owner after the last one died or stopped: pick the request up where its
        ledger ends (where a stopping owner's hand-over says it does, once checked).

        False when the ledger already holds its end. Engine work the old owner started is
        aborted, then the request relays from the committed output like after an engine
        failure.
        """
        assert self._js is not None and self._nc is not None
        await self._nc.publish(
            bus.orphan_subject(r.key),
            _encoder.encode(EngineAbort(rid=r.key, attempt=0, owner=self.owner_id)),
        )
        found = await self._handed_over(r)
        if found is not None:
            log.warning(
                "request %s: taken over as its last owner handed it over, after %d "
                "committed chunks",
                r.rid,
                found.seq,
            )
        else:
            found = await self._take_over(r)
        if found is None:
            return True  # nothing was committed: start afresh
        if found.ended:
            log.info("request %s was finished by its last owner", r.rid)
            # Its last owner may have died before delivering the end: a reader still waiting
            # gets it now (and reads back whatever else it missed).
            assert found.last is not None  # (read back: a hand-over is of a request going on)
            await ledger.deliver(self._nc, r.reply, ledger.encode([found.last]))
            r.end_as(DONE)
            return False
        r.refuse_continuing(f"the owner of request {r.rid} stopped", "resumed")
        r.out_seq, r.index_seq = found.seq, found.index_seq
        r.attempt = max(r.attempt, found.attempt)  # (its own count starts past the old one's)
        choice = r.choices[0]
        choice.state, choice.committed = found.state, found.tokens
        # Relayed like an engine failure (and counted as one relay).
        r.attempt_failed(EngineFailed(f"the owner of request {r.rid} stopped").info())
        self.observed.takeovers.inc()
        if found.last is not None:  # (else said above)
            log.warning("request %s: taken over after %d committed chunks", r.rid, found.seq)
        return True

    async def _take_over(self, r: Owned) -> ledger.Committed | None:
        """Read what the request's ledger holds and make it ours: a `Takeover` on its last
        owner's round subject first (that owner stores nothing more of it), its rounds read
        up to there, then a change of owner on its index. None: nothing is committed."""
        assert self._js is not None and self._ledger is not None
        mine = self._ledger.subject(r.reply)
        for _ in range(_TAKEOVER_TRIES):
            found = await ledger.read_index(self._js, r.reply, r.rid)
            if found is None:
                return None
            before = None
            if found.owner is not None and found.owner.subject != mine and not found.ended:
                before = await ledger.take_over(self._js, found.owner.subject, [r.rid], mine)
            await ledger.read_rounds(self._js, found, r.rid, before)
            committed = ledger.Committed.of(found)
            if committed.ended or await self._change_owner(r, committed):
                return committed
        raise StageUnavailable(f"request {r.rid}: its ledger kept moving while taken over")

    async def _change_owner(self, r: Owned, committed: ledger.Committed) -> bool:
        """Index what the last owner left in its rounds, naming this owner's rounds for what
        follows: fenced, so the last owner indexes nothing more of it. False: it did since."""
        assert self._js is not None and self._ledger is not None
        try:
            ack = await ledger.index(
                self._js,
                r.reply,
                r.rid,
                committed.unindexed,
                after=committed.index_seq,
                tenant=r.tenant,
                owner=self._ledger.pointer(r.reply),
                seq=committed.seq,
                within=self.settings.bus_retry,
            )
        except APIError as exc:
            if ledger.superseded(exc):
                return False
            raise StageUnavailable(f"could not take request {r.rid} over: {exc!r}") from exc
        committed.index_seq, committed.unindexed = ack.seq, []
        return True

    async def _on_handover(self, msg: Msg) -> None:
        try:
            handed = _handover_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.warning("undecodable hand-over ignored: %s", exc)
            return
        if handed.key in self.requests:  # (our own, as we stop)
            return
        self._forget_handover(handed.key)
        self._handovers[handed.key] = ledger.Committed(
            seq=handed.out_seq,
            index_seq=handed.index_seq,
            attempt=handed.attempt,
            ended=False,
            state=handed.state,
            tokens=array("i", handed.tokens),
            last=None,
            unindexed=[],
        )
        self._handover_tokens += len(handed.tokens)
        while self._handover_tokens > _HANDOVER_TOKENS:  # the oldest go: read back instead
            self._forget_handover(next(iter(self._handovers)))

    def _forget_handover(self, key: str) -> ledger.Committed | None:
        handed = self._handovers.pop(key, None)
        if handed is not None:
            self._handover_tokens -= len(handed.tokens)
        return handed

    async def _handed_over(self, r: Owned) -> ledger.Committed | None:
        """What the request's stopping owner said of it, made ours by a change of owner on
        its index, fenced where the owner said its index ends; None to read the ledger
        back (it did not say, or not what its index holds)."""
        handed = self._forget_handover(r.key)
        if handed is None or len(r.choices) != 1:
            return None
        return handed if await self._change_owner(r, handed) else None

    async def _hand_over(self, r: Owned) -> None:
        """Tell the model's other owners where the request stands (everything of it is
        committed by now, and indexed here first): the one it goes to picks it up from
        there."""
        if len(r.choices) != 1 or not r.index_seq:
            return  # nothing committed: a peer starts it afresh anyway
        assert self._nc is not None and self._js is not None
        try:
            if r.unindexed:
                ack = await ledger.index(
                    self._js,
                    r.reply,
                    r.rid,
                    r.unindexed,
                    after=r.index_seq,
                    tenant=r.tenant,
                    within=self.settings.bus_retry,
                )
                r.index_seq = ack.seq
            choice = r.choices[0]
            handed = HandOver(
                key=r.key,
                index_seq=r.index_seq,
                out_seq=r.out_seq,
                attempt=r.attempt,
                state=choice.state,
                tokens=choice.committed.tolist(),
            )
            await self._nc.publish(bus.handover_subject(self.model), _encoder.encode(handed))
        except (nats.errors.Error, APIError) as exc:  # the peer reads the ledger back instead
            log.warning("hand-over of %s not sent: %r", r.rid, exc)

    async def _finish(self, r: Owned | Parent) -> None:
        """The one exit of every request, a fanned-out one's too: abort leftovers, let what
        is in flight land, tell the client, free, ack."""
        assert self.dispatcher is not None and self._book is not None
        if isinstance(r, Owned):
            await self._let_engines_go(r)
        if r.error is not None:
            await self._tell_error(r)
        if isinstance(r, Owned):
            self._account(r)
        if r.leased and not r.goes_on:  # else it goes on elsewhere
            await self._book.release(r.tenant, r.rid)
        # Still ours (kept in progress) until the server confirms the ack: gone from
        # `requests` only then, so a drained worker has nothing left in flight.
        match r.end:
            case HandedOver():
                assert isinstance(r, Owned)  # (a fanned-out request ends instead)
                await self._hand_over(r)  # before the NAK that gives the request to a peer
                await r.msg.nak()
            case Superseded():
                pass  # its new owner holds the message now
            case _:
                await bus.ack_surely(r.msg, self.settings.bus_retry)
        self.requests.pop(r.key, None)
        self._parents -= isinstance(r, Parent)
        if not self.requests:
            self.empty.set()

    async def _let_engines_go(self, r: Owned) -> None:
        """Abort the engine work it leaves, then wait for a derender + commit already under
        way (each is bounded by its timeout), so an ended request leaves no work behind."""
        assert self.dispatcher is not None
        if r.engine is not None and not r.engine_done:
            await self.dispatcher.abort(r.engine, r.key, r.attempt)
        if r.prefill_engine is not None and r.prefill_attempt is not None:
            if not r.prefill_done.is_set() or r.error is not None:
                # A prefill still running, or holding KV for a decode that will not come.
                await self.dispatcher.abort(r.prefill_engine, r.key, r.prefill_attempt)
        await r.settled.wait()

    async def _tell_error(self, r: Owned | Parent) -> None:
        """Its error event, fenced on what it committed (a fanned-out request's merge is
        its own writer's alone)."""
        assert self._nc is not None and r.error is not None  # owned once connected
        before, after = (r.unindexed, r.index_seq) if isinstance(r, Owned) else ([], None)
        try:
            await ledger.publish_error(
                self._nc,
                r.reply,
                r.rid,
                r.error,
                before=before,
                seq=r.out_seq + 1,
                after=after,
                tenant=r.tenant,
            )
        except APIError as exc:
            if ledger.superseded(exc):  # a peer took it over: its slot and message are theirs
                log.warning("request %s is owned elsewhere now; its error is not ours", r.rid)
                r.supersede()
            else:
                log.exception("could not deliver the error of %s", r.rid)
        except Exception:
            log.exception("could not deliver the error of %s", r.rid)

    def _account(self, r: Owned) -> None:
        """Its metrics, line and span; its engine capacity back."""
        assert self.dispatcher is not None
        if not r.goes_on:  # else its end is another owner's to tell
            now = time.time()
            self.observed.ended(r, now)
            if log.isEnabledFor(logging.INFO):
                log.info("%s", r.summary(now))
        r.span.set(
            engine=r.engine or "",
            prompt_tokens=len(r.request.token_ids),
            output_tokens=r.output_tokens,
            relays=r.relays,
            handed_over=isinstance(r.end, HandedOver),
        )
        r.span.end(None if r.error is None else r.error.message)
        self.dispatcher.release(r)

    # -- cancellation and engine loss --------------------------------------------------------

    async def _on_cancel(self, msg: Msg) -> None:
        """The client left (an empty cancel), or vLLM's abort_requests asked (`Cancel`): the
        one ends with nothing more said, the other with its output so far, finished
        "abort"."""
        reply, rid = bus.cancelled(msg.subject)
        try:
            abort = bool(msg.data) and _cancel_decoder.decode(msg.data).abort
        except msgspec.DecodeError:
            log.warning("undecodable cancel of %s taken as its client's leaving", rid)
            abort = False
        # Remembered even when owned here: a late ack lets JetStream deliver it again, and
        # that delivery must not run it for nobody.
        self._cancelled[reply, rid] = abort
        if len(self._cancelled) > _CANCEL_MEMORY:
            self._cancelled.popitem(last=False)
        r = self.owned(reply, rid)
        if r is None:
            return
        if abort and isinstance(r, Owned):
            log.info("request %s aborted", rid)
            if r.engine is not None and not r.engine_done:
                assert self.dispatcher is not None
                await self.dispatcher.abort(r.engine, r.key, r.attempt)
            r.abort()
            self._kick([r])
        else:
            log.info("request %s cancelled", rid)
            r.cancel()

    def _engine_gone(self, engine_id: str, why: str) -> None:
        """An engine left the registry: `why` says whether it stopped or went silent."""
        if self.dispatcher is not None:
            self.dispatcher.engine_gone(engine_id)
        for r in self.requests.values():
            if not isinstance(r, Owned):
                continue
            if r.engine == engine_id and not r.engine_done:
                r.attempt_failed(EngineFailed(f"engine {engine_id} {why}").info())
            elif r.prefill_engine == engine_id and not r.prefill_done.is_set():
                r.prefill_done.set()  # the leg is lost; dispatch chooses again

    # -- the token path -------------------------------------------------------------------

    async def _on_tokens(self, msg: Msg) -> None:
        try:
            step = _step_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.error("undecodable token step on %s: %s", msg.subject, exc)
            return
        touched = []
        now, made = 0.0, 0  # this step's time (read once for all its entries), its tokens
        assert self.dispatcher is not None
        for delta in step.entries:
            r = self.requests.get(delta.rid)  # its key
            if not isinstance(r, Owned) or delta.attempt not in (r.attempt, r.prefill_attempt):
                await self._abort_unwanted(step.engine, delta)
                continue
            healthy, live = r.broken is None, not r.ended.is_set()
            if delta.attempt == r.prefill_attempt:
                r.accept_prefill(delta)
                if refusal(delta):
                    self.dispatcher.engine_refused(r, step.engine)
                elif delta.error is not None:
                    self.dispatcher.engine_failed(r, step.engine)
                elif delta.finish_reason is not None:
                    self.dispatcher.engine_served(r, step.engine)
            elif r.accept(delta):
                touched.append(r)
                self.dispatcher.grow(r, r.choices[delta.index], len(delta.token_ids))
                if delta.seq == 0:
                    self.dispatcher.engine_served(r, step.engine)
                now = now or time.time()
                self.observed.output(r, now)
                made += len(delta.token_ids)
            if healthy and r.broken is not None:
                self.dispatcher.engine_failed(r, step.engine)  # an error, or lost output
            elif live and r.ended.is_set() and refusal(delta):  # the request's fault, its end
                self.dispatcher.engine_refused(r, step.engine)
        self.observed.step(made)
        self._kick(touched)

    async def _abort_unwanted(self, engine: str, delta: TokenDelta) -> None:
        """Output of an attempt that ended here (the client left, a relay replaced it) still
        arrives: its abort was lost, or is still on its way. Ask again, at most every
        `_REABORT_EVERY` seconds, so that an engine always ends up free."""
        assert self.dispatcher is not None
        if delta.finish_reason is not None:
            return  # its last words: the engine is done with it
        key, now = (delta.rid, delta.attempt), time.monotonic()
        if now - self._unwanted.get(key, -_REABORT_EVERY) < _REABORT_EVERY:
            return
        self._unwanted[key] = now
        self._unwanted.move_to_end(key)
        if len(self._unwanted) > _CANCEL_MEMORY:
            self._unwanted.popitem(last=False)
        await self.dispatcher.abort(engine, delta.rid, delta.attempt)

    def _kick(self, candidates: list[Owned]) -> None:
        """These requests may have output to derender and commit: the next round takes it."""
        for r in candidates:
            self._ready[r.key] = r
        if candidates:
            self._work.set()

    async def _rounds(self) -> None:
        """Derender and commit rounds, one at a time: each takes what every request has ready
        when it starts, so what arrives during a round (the next engine step) goes out as one
        in the next, however many requests it touches. A heavy round (a whole long response)
        runs beside, so the streams do not wait for it."""
        assert self._group is not None
        while True:
            await self._work.wait()
            await asyncio.sleep(0)  # let this loop turn's other arrivals join the round
            self._work.clear()
            ready, self._ready = self._ready, {}
            light: list[Work] = []
            for r in ready.values():
                items: list[Work] = [
                    (r, choice, entry)
                    for choice, entry in r.take_ready(self.settings.stream_interval)
                ]
                if r.needs_usage_chunk():
                    items.append((r, None, r.usage_entry()))
                if not items:
                    continue
                r.settled.clear()
                if is_large([entry for _, _, entry in items]):
                    self._group.create_task(self._derender_and_commit(items, beside=True))
                else:
                    light += items
            if light:
                await self._derender_and_commit(light)

    async def _derender_and_commit(self, items: list[Work], beside: bool = False) -> None:
        """One round. What arrives for its requests meanwhile is kicked as it arrives (and
        waits for the next round); after it, only what the round itself made due (the
        closing usage chunk), or, for a round `beside`, what arrived while it ran."""
        try:
            assert self.derenderer is not None
            began = time.perf_counter()
            results = await self.derenderer.derender([entry for _, _, entry in items])
            derendered = time.perf_counter()
            await self._commit(items, results)
            stage_metrics.DERENDER.observe(derendered - began)
            stage_metrics.COMMIT.observe(time.perf_counter() - derendered)
        except (StageUnavailable, StageTimeout) as exc:
            for r, _, _ in items:
                r.fail(exc.info())
        except Exception:  # a bug fails these requests, never the worker
            log.exception(
                "derendering or committing failed for %s",
                ", ".join(sorted({r.rid for r, _, _ in items})),
            )
            for r, _, _ in items:
                r.fail(internal(r.rid))
        finally:
            for _, choice, _ in items:
                if choice is not None:
                    choice.busy = False
            for r, _, _ in items:
                if not any(c.busy for c in r.choices):
                    r.settled.set()
        touched = {id(r): r for r, _, _ in items}.values()
        self._kick([r for r in touched if beside or r.needs_usage_chunk()])

    async def _commit(self, items: list[Work], results: list[DerenderResult]) -> None:
        """Store the round's events in TW_OUT (`rounds`), then deliver what was stored; a
        choice's state advances only once stored."""
        staged: dict[str, tuple[Staged, list[Publication]]] = {}
        for (r, choice, entry), res in zip(items, results, strict=True):
            if r.ended.is_set():
                continue
            if isinstance(res, DerenderFailed):
                r.fail(res.error)
                continue
            publish = self._publication(r, choice, entry, res)
            if publish is None:
                continue
            s, pubs = staged.setdefault(r.key, (Staged(r, []), []))
            s.events.append(_event(r, r.out_seq + len(s.events) + 1, res, *publish))
            pubs.append((choice, res, *publish))
        if not staged:
            return
        assert self._ledger is not None and self._nc is not None
        deliveries = await self._ledger.commit([s for s, _ in staged.values()])
        for s, pubs in staged.values():
            self._committed(s, pubs)
        for reply, payload in deliveries.items():
            await ledger.deliver(self._nc, reply, payload)

    def _committed(self, s: Staged, pubs: list[Publication]) -> None:
        """Advance the request past its stored events, or end it with why they were not."""
        r, outcome = s.r, s.outcome
        if isinstance(outcome, TakenOver):
            log.warning("request %s is owned elsewhere now; letting it go", r.rid)
            r.supersede()
            return
        if isinstance(outcome, MaxPayloadError):
            assert self._nc is not None  # what was published went over the connection
            size = sum(len(e.payload) for e in s.events)
            r.fail(too_big_for_the_bus(size, self._nc.max_payload).info())
            return
        if outcome is not None:
            r.fail(StageUnavailable(f"could not commit output: {outcome!r}").info())
            return
        r.out_seq += len(s.events)
        for choice, res, kind, _, tokens in pubs:
            if choice is not None:
                choice.state = res.state
                choice.committed.extend(tokens)
            if kind in (h.KIND_END, h.KIND_RESPONSE):
                r.end_as(DONE)

    @staticmethod
    def _publication(
        r: Owned, choice: Choice | None, entry: DerenderEntry, res: Derendered
    ) -> tuple[str, bytes, list[int]] | None:
        """What to publish for one derender result (kind, payload, its tokens), if anything."""
        if choice is None:  # the closing usage chunk of an n > 1 stream
            return h.KIND_END, framed(r.ctx.api, res.chunks), []
        if res.finish_reason is not None:  # derender ended it: a stop string
            choice.finish, choice.stop_reason = res.finish_reason, res.stop_reason
        last = entry.finish_reason is not None or res.finish_reason is not None
        tokens = entry.token_ids if res.kept is None else entry.token_ids[: res.kept]
        if not r.stream:
            choice.done = True
            # Derender merges a request's choices into the first entry's response.
            return (h.KIND_RESPONSE, res.chunks[0], tokens) if res.chunks else None
        if not res.chunks and not last:
            choice.hold_back(entry)
            return None
        # Marked before the ack, so a sibling committed right after sees it as done.
        kind = h.KIND_END if last and r.is_last(choice) else h.KIND_CHUNK
        choice.done = last
        return kind, framed(r.ctx.api, res.chunks), tokens


def _event(
    r: Owned, seq: int, res: Derendered, kind: str, payload: bytes, tokens: list[int]
) -> Delivered:
    """A commit as stored and delivered: a streamed one with its token IDs and the state
    after it, where a relay goes on from."""
    if kind == h.KIND_RESPONSE:
        return Whole(rid=r.rid, seq=seq, payload=payload, attempt=r.attempt, tokens=len(tokens))
    variant = OUTPUTS[kind]
    return variant(
        rid=r.rid,
        seq=seq,
        payload=payload,
        attempt=r.attempt,
        tokens=len(tokens),
        ids=list(tokens),
        state=res.state,
    )


def _requests(count: int) -> str:
    return f"{count} request" if count == 1 else f"{count} requests"
