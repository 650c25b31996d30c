"""Where a request meets an engine: admission in priority order, the topology (one union
engine, or a prefill engine then a decode engine), the hand-off, and the capacity it holds.

A request holds its prompt tokens plus, per sequence, `decode_reserve` tokens of output
ahead of what it produced (never more than its `max_tokens`) on the engine that decodes it,
and its prompt on the prefill engine while that leg runs. Like an engine's own scheduler
it is charged for what it uses and will soon, not for all it may ever produce: a request
without `max_tokens` (the context left, ~131k tokens) would otherwise hold an eighth of
an engine for as long as it runs, and one with `n=8` all of it. Only a request whose
whole budget no engine could ever hold is refused. An owner only pulls work while some
engine has room (and `owner_lookahead` requests more), so the waiting line here is short;
within it tenants take turns, then lower `priority` goes first (`workers.schedule.line`).

With token obfuscation, engines are only those advertising this scheduler's key fingerprint
(or, without a key, none): work never reaches an engine of the other ID space, and a request
finding only such engines ends with a 503 saying so. Affinity hashes the physical prompt, as
the engines' KV caches hold it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from tokenway import bus
from tokenway.aio import Signal, wait_any
from tokenway.block_hashes import block_hashes
from tokenway.config import Settings
from tokenway.errors import (
    DeadlineExceeded,
    EngineFailed,
    InvalidRequest,
    NoCompatibleEngine,
    NoEngine,
)
from tokenway.obfuscation import ObfuscationError, Permutation
from tokenway.registry import EngineRegistry
from tokenway.wire import EngineAbort, EngineInfo, EngineReply, EngineWork, Role
from workers.schedule import affinity, metrics, routing
from workers.schedule.breaker import Breakers
from workers.schedule.line import Line
from workers.schedule.owned import Choice, Owned

log = logging.getLogger(__name__)

_DISPATCH_TRIES = 3
# What an owner pulls while no engine of its model is alive: each request waits
# `engine_wait` for one, then is told there is none.
_WITHOUT_ENGINES = 16
# Seconds a batch job's requests keep yielding after the last interactive one ran or
# waited here: back-to-back interactive requests are one stretch of traffic to them.
_YIELD_HOLD = 1.0
_encoder = msgspec.msgpack.Encoder()
_reply_decoder = msgspec.msgpack.Decoder(EngineReply)


def cost(r: Owned) -> int:
    """Tokens the live attempt holds on the engine that decodes it once it used its budget."""
    return len(r.prompt) + (r.params.max_tokens or 0) * max(r.params.n, 1)


def _ahead(made: int, reserve: int, budget: int | None) -> int:
    """What one sequence holds: its output rounded up to a whole `reserve` ahead, within
    its budget."""
    ahead = (made // reserve + 1) * reserve
    return ahead if budget is None else min(ahead, budget)


def holding(r: Owned, reserve: int) -> int:
    """Tokens the live attempt holds as it starts: its prompt and each sequence's reserve."""
    return len(r.prompt) + sum(_ahead(c.made, reserve, r.params.max_tokens) for c in r.choices)


class NeverFits(InvalidRequest):
    """No engine could ever hold the request, however idle: the client's 400."""


@dataclass(frozen=True)
class Plan:
    """Where an attempt runs: `engine` streams the output; `prefill` is P/D's first leg."""

    engine: EngineInfo
    prefill: EngineInfo | None = None
    why: str = ""  # the routing decision, for the log


class Dispatcher:
    def __init__(
        self,
        nc: NATS,
        owner_id: str,
        registry: EngineRegistry,
        settings: Settings,
        obfuscation: Permutation | None = None,
        model: str = "",
    ) -> None:
        self.nc = nc
        self.owner_id = owner_id
        self.registry = registry
        self.settings = settings
        self.obfuscation = obfuscation
        self.fingerprint = obfuscation.fingerprint if obfuscation else None
        self.index = affinity.PrefixIndex(ttl=settings.affinity_ttl)
        self.breakers = Breakers(
            threshold=settings.breaker_threshold,
            base=settings.breaker_backoff,
            cap=settings.breaker_max_backoff,
        )
        self.seqs: Counter[str] = Counter()  # sequences we run per engine
        self.tokens: Counter[str] = Counter()  # tokens those may hold
        self.freed = Signal()
        self._interactive = 0  # interactive sequences running here
        self._interactive_until = 0.0  # monotonic: batch requests yield until then
        self.line = Line()
        self.turn = Signal()  # the line changed: whose turn it is may have too
        self.model = model
        self.queue_time = metrics.QUEUE.labels(model)
        self.running = metrics.RUNNING.labels(model)
        self.waiting = metrics.WAITING.labels(model)

    # -- capacity ---------------------------------------------------------------------------

    def may_pull(self, batch: bool = False) -> int:
        """Sequences the owner may pull: what the engines have room for, and
        `owner_lookahead` more, so that its line has other tenants' turns to give, less
        what already waits in it. A batch job's requests are pulled without looking ahead
        (in the queue, not the line, they leave interactive ones the next turn) and only
        into the room beyond the engines' headroom."""
        alive = self.registry.alive()
        if not alive:
            # Requests still come in, to wait a while for an engine and then meet the 503
            # in `_wait_turn` instead of lying in the queue until their deadline.
            return max(_WITHOUT_ENGINES - self.line.waiting(), 0)
        # With only incompatible engines, their room still lets requests in, so that each
        # meets the explicit 503 in `_compatible` instead of waiting out its deadline.
        engines = self._matching(alive) or alive
        if batch:
            engines = routing.leaving(engines, self._batch_headroom())
        room = routing.free_slots(engines, self.seqs, self.tokens)
        ahead_by = 0 if batch else self.settings.owner_lookahead
        return max(room + ahead_by - self.line.waiting(), 0)

    def _batch_headroom(self) -> float:
        """The share of each engine a batch job's requests leave free: most of it while
        interactive requests run or wait here (`batch_busy_share` is theirs then)."""
        h = self.settings.batch_headroom
        if self._interactive or time.monotonic() < self._interactive_until:
            return max(h, 1 - self.settings.batch_busy_share)
        return h

    def _yield_batch(self) -> None:
        self._interactive_until = time.monotonic() + _YIELD_HOLD

    def _matching(self, engines: list[EngineInfo]) -> list[EngineInfo]:
        return [e for e in engines if e.obfuscation == self.fingerprint]

    def _compatible(self) -> list[EngineInfo]:
        """Live engines in our token-ID space; a 503 when only engines of another are there."""
        alive = self.registry.alive()
        usable = self._matching(alive)
        if alive and not usable:
            ours = f"key {self.fingerprint}" if self.fingerprint else "no obfuscation key"
            raise NoCompatibleEngine(
                f"no engine for model {alive[0].model} uses this scheduler's token "
                f"obfuscation ({ours}); {len(alive)} registered engine(s) use "
                f"{'another key or none' if self.fingerprint else 'an obfuscation key'}"
            )
        return usable

    def _affinity_hashes(self, r: Owned) -> list[int]:
        """Block hashes of the prompt as the engines hold it: physical IDs when obfuscated.

        Obfuscated, every ID of the request is checked here, so an ID outside the vocabulary
        is the client's 400 before anything is sent, not an engine failure at the bridge.
        """
        prompt = r.prompt
        if self.obfuscation is not None:
            try:
                prompt = self.obfuscation.to_physical(prompt, "the prompt")
                self.obfuscation.params_to_physical(r.params)
            except ObfuscationError as exc:
                raise InvalidRequest(str(exc)) from exc
        return block_hashes(prompt, self.settings.kv_block_size, salt=r.request.cache_salt)

    def _hold(self, engine: str, seqs: int, tokens: int) -> None:
        self.seqs[engine] += seqs
        self.tokens[engine] += tokens

    def _release(self, engine: str, seqs: int, tokens: int) -> None:
        self.seqs[engine] -= seqs
        self.tokens[engine] -= tokens
        if self.seqs[engine] <= 0:
            del self.seqs[engine], self.tokens[engine]
        self.freed.fire()

    def release(self, r: Owned) -> None:
        """Give back what the attempt held (on every exit path, exactly once); a probe of a
        half-open breaker that got no verdict (the request ended first, or was the one at
        fault) lets the next request probe at once, not after the probe timeout."""
        for engine in r.probes:
            self.breakers.abandon(engine, time.monotonic())
        r.probes.clear()
        if r.engine is not None:
            self._release(r.engine, len(r.choices), r.held)
            self.line.stopped(r.tenant, len(r.choices))
            if not r.batch:
                self._interactive -= len(r.choices)
                self._yield_batch()
            self.running.dec()
            r.engine, r.held = None, 0
        self.release_prefill(r)

    def grow(self, r: Owned, c: Choice, added: int) -> None:
        """Choice `c` of the live attempt produced `added` tokens: hold its next reserve
        where it outgrew one (per delta, so only that choice is looked at)."""
        if r.engine is None:
            return
        reserve, budget = self.settings.decode_reserve, r.params.max_tokens
        more = _ahead(c.made, reserve, budget) - _ahead(c.made - added, reserve, budget)
        if more > 0:
            self.tokens[r.engine] += more
            r.held += more

    def release_prefill(self, r: Owned) -> None:
        if r.prefill_engine is not None and r.prefill_held:
            self._release(r.prefill_engine, 1, len(r.prompt))
            r.prefill_held = False

    # -- dispatch ---------------------------------------------------------------------------

    async def dispatch(self, r: Owned) -> None:
        """Hand the request to an engine (or a P/D pair); wait for room until its deadline."""
        tried: set[str] = set()
        hashes = self._affinity_hashes(r)
        while not r.ended.is_set():
            plan = await self._wait_turn(r, tried, hashes)
            if plan is None:
                return
            self.queue_time.observe(max(time.time() - r.arrived, 0.0))
            if plan.prefill is not None:
                await self._run_prefill(r, plan, tried)
                if r.ended.is_set() or r.prefill_kv is None:
                    continue  # failed or declined: choose again
            r.dispatched = r.dispatched or time.time()  # before: output may beat the accept
            # Before too: a short answer can end the request, and its span, before the call
            # returns, and an ended span drops its events (one refused is a try on the span).
            r.span.event(f"dispatched → {plan.why}")
            if await self._start(r, plan.engine, tried):
                for holder in filter(None, (plan.engine, plan.prefill)):  # the prompt's KV
                    self.index.record(holder.id, hashes, time.monotonic())
                log.info("request %s (%s at the engines) → %s", r.rid, r.key, plan.why)
                return

    async def _wait_turn(self, r: Owned, tried: set[str], hashes: list[int]) -> Plan | None:
        """The request's plan once it is its turn and an engine has room."""
        place = self.line.join(r.tenant, r.request.priority, max(r.params.n, 1), r.batch)
        if not r.batch:
            self._yield_batch()
        self.waiting.inc()
        self.turn.fire()
        alone_since: float | None = None  # since when no engine of the model is alive
        try:
            while True:
                waits = (self.turn.waiter(), self.registry.changed.waiter(), self.freed.waiter())
                now = time.monotonic()
                patience = self._patience(now, alone_since)
                alone_since = None if patience is None else alone_since or now
                engines = [
                    e
                    for e in self._compatible()
                    if e.id not in tried and self.breakers.admits(e.id, now)
                ]
                if self.line.first() is place:
                    plan = self._relay_plan(r, engines, hashes, now) or self._plan(
                        r, engines, hashes, now
                    )
                    if plan is not None and self._claim(r, plan, now):
                        return plan
                untried = [e for e in engines if e.role in routing.OUTPUT_ROLES]
                if len(tried) >= _DISPATCH_TRIES or (tried and not untried):
                    raise EngineFailed(f"no engine accepted the request (tried {sorted(tried)})")
                remaining = r.deadline - time.time()
                if remaining <= 0:
                    raise DeadlineExceeded("no engine had room before the request's deadline")
                # a batch request yielding to interactive ones looks again when that ends
                wake = self._interactive_until - now if r.batch else 0.0
                await wait_any(
                    *waits,
                    r.ended,
                    timeout=min(remaining, patience or remaining, wake if wake > 0 else remaining),
                )
                if r.ended.is_set():
                    return None
        finally:
            self.line.leave(place)
            self.waiting.dec()
            self.turn.fire()
            self.freed.fire()  # room to pull one more

    def _patience(self, now: float, alone_since: float | None) -> float | None:
        """With no engine of the model alive: how much longer to wait for one (a 503 once
        `engine_wait` is over). None while there is one."""
        if self.registry.alive():
            return None
        left = self.settings.engine_wait - (now - (alone_since or now))
        if left <= 0:
            raise NoEngine(
                f"no engine is serving model {self.model} "
                f"(none registered for {self.settings.engine_wait:g}s); retry later"
            )
        return left

    def _claim(self, r: Owned, plan: Plan, now: float) -> bool:
        """Take the engines' breaker turn (a half-open breaker lets one probe through: the
        request holds it until the engine's verdict, or gives it back as it ends)."""
        legs = [plan.engine] + ([plan.prefill] if plan.prefill else [])
        claimed = [e for e in legs if self.breakers.allow(e.id, now)]
        if len(claimed) == len(legs):
            r.probes.update(e.id for e in legs if self.breakers.state(e.id, now) == "half_open")
            return True
        for e in claimed:
            self.breakers.abandon(e.id, now)
        return False

    def _relay_plan(
        self, r: Owned, engines: list[EngineInfo], hashes: list[int], now: float
    ) -> Plan | None:
        """A relay goes to other engines than the ones that failed it, when they can take
        it (a P/D relay may still need the failed decode engine, for want of another)."""
        others = [e for e in engines if e.id not in r.avoid]
        if not r.avoid or len(others) == len(engines):
            return None
        try:
            return self._plan(r, others, hashes, now)
        except NeverFits:  # too small without the failed ones: they decide
            return None

    def _plan(
        self, r: Owned, engines: list[EngineInfo], hashes: list[int], now: float
    ) -> Plan | None:
        n = len(r.choices)
        if why := routing.never_fits(engines, cost(r), n):
            raise NeverFits(f"{why}: ask for fewer max_tokens or a smaller n", param="max_tokens")
        if r.batch:  # it starts only where it leaves interactive requests their headroom,
            # in the smallest view of the engines that it can ever fit (a whole one at most)
            for headroom in (self._batch_headroom(), self.settings.batch_headroom):
                roomy = routing.leaving(engines, headroom)
                if not routing.never_fits(roomy, cost(r), n):
                    engines = roomy
                    break
        need = holding(r, self.settings.decode_reserve)
        # The prompt's KV is made where it is prefilled: that engine is chosen by affinity.
        prefill = self._choose(engines, hashes, now, len(r.prompt), 1, "prefill")
        decode = routing.pick(engines, self.seqs, self.tokens, need, n, "decode")
        if prefill is not None and decode is not None:
            why = f"engine {decode.id} (decode) after prefill on {prefill.describe()}"
            return Plan(engine=decode, prefill=prefill.engine, why=why)
        if single := self._choose(engines, hashes, now, need, n, "union"):
            return Plan(engine=single.engine, why=single.describe())
        # No P/D pair and no union engine with room: a decode engine prefilling for itself
        # (a vLLM decode instance does that for a request that brings no KV to pull).
        if decode is not None:
            return Plan(engine=decode, why=f"engine {decode.id} (decode, prefilling for itself)")
        return None

    def _choose(
        self,
        engines: list[EngineInfo],
        hashes: list[int],
        now: float,
        need: int,
        n: int,
        role: Role,
    ) -> affinity.Choice | None:
        return affinity.choose(
            engines,
            self.seqs,
            hashes,
            self.index,
            now,
            self.settings.prefill_scale,
            tokens=self.tokens,
            need=need,
            n=n,
            role=role,
        )

    async def _run_prefill(self, r: Owned, plan: Plan, tried: set[str]) -> None:
        """P/D's first leg: the prompt on the prefill engine, asking it to hand the KV over."""
        assert plan.prefill is not None
        prefill = plan.prefill
        r.prefill_engine, r.prefill_kv = prefill.id, None
        r.attempt += 1
        r.prefill_attempt = r.attempt
        r.prefill_done.clear()
        params = msgspec.structs.replace(
            r.params, max_tokens=1, min_tokens=0, n=1, stop=[], logprobs=None
        )
        kv = {**(r.client_kv or {}), "do_remote_decode": True}
        self._hold(prefill.id, 1, len(r.prompt))
        r.prefill_held = True
        if not await self._send(prefill, r, params, kv, tried):
            self.release_prefill(r)
            return
        remaining = max(r.deadline - time.time(), 0)
        await wait_any(r.prefill_done, r.ended, timeout=remaining)
        self.release_prefill(r)
        if r.ended.is_set():
            return
        if r.prefill_kv is None:
            if not r.prefill_done.is_set():
                raise DeadlineExceeded("the prefill leg did not finish before the deadline")
            log.warning("prefill on %s for %s failed; choosing again", prefill.id, r.rid)

    async def _start(self, r: Owned, engine: EngineInfo, tried: set[str]) -> bool:
        """The attempt whose tokens the client sees (union, or P/D's decode leg)."""
        r.attempt += 1
        r.next_delta = 0
        kv = r.prefill_kv if r.prefill_kv is not None else r.client_kv
        r.held = holding(r, self.settings.decode_reserve)
        self._hold(engine.id, len(r.choices), r.held)
        self.line.started(r.tenant, len(r.choices))
        if not r.batch:
            self._interactive += len(r.choices)
        self.running.inc()
        r.engine = engine.id
        if await self._send(engine, r, r.params, kv, tried):
            return True
        self.release(r)
        return False

    async def _send(
        self,
        engine: EngineInfo,
        r: Owned,
        params: object,
        kv: dict[str, object] | None,
        tried: set[str],
    ) -> bool:
        tried.add(engine.id)
        work = EngineWork(
            rid=r.key,
            attempt=r.attempt,
            owner=self.owner_id,
            token_ids=r.prompt,
            sampling_params=params,  # type: ignore[arg-type]
            priority=r.request.priority,
            kv_transfer_params=kv,
            cache_salt=r.request.cache_salt,
            # The native API is a fallback for a first try only, and never for obfuscated IDs.
            native_ok=r.out_seq == 0 and self.obfuscation is None,
            obfuscation=self.fingerprint,
            traceparent=r.trace or None,
            reasoning_ended=r.request.reasoning_ended,
            request_id=r.rid,
        )
        try:
            msg = await self.nc.request(
                bus.engine_subject(engine.id, "generate"),
                _encoder.encode(work),
                timeout=self.settings.engine_timeout,
            )
            reply = _reply_decoder.decode(msg.data)
        except (NatsTimeout, NoRespondersError, msgspec.DecodeError) as exc:
            log.warning("engine %s did not take %s: %r", engine.id, r.rid, exc)
            self.engine_failed(r, engine.id)
            return False
        except BaseException:
            self.engine_refused(r, engine.id)  # cancelled: no verdict
            raise
        if not reply.accepted:  # full: says nothing about its health
            log.info("engine %s declined %s: %s", engine.id, r.rid, reply.error)
            self.engine_refused(r, engine.id)
        return reply.accepted

    def engine_served(self, r: Owned, engine: str) -> None:
        """An attempt's first output arrived: the engine works (closes a half-open breaker)."""
        r.probes.discard(engine)
        self.breakers.on_success(engine, time.monotonic())

    def engine_failed(self, r: Owned, engine: str) -> None:
        """An engine-side failure of a running attempt (never render or derender ones)."""
        r.probes.discard(engine)
        self.breakers.on_failure(engine, time.monotonic())

    def engine_refused(self, r: Owned, engine: str) -> None:
        """No verdict on the engine: it refused the request itself (the request's fault), or
        declined or never saw the work. Its breaker stays as it was; a probe the request
        held is given back."""
        if engine in r.probes:
            r.probes.discard(engine)
            self.breakers.abandon(engine, time.monotonic())

    def engine_gone(self, engine: str) -> None:
        self.index.forget(engine)
        self.breakers.forget(engine)

    async def abort(self, engine: str, key: str, attempt: int) -> None:
        """Stop the attempt of the request with this key (`Owned.key`) at `engine`."""
        payload = _encoder.encode(EngineAbort(rid=key, attempt=attempt))
        await self.nc.publish(bus.engine_subject(engine, "abort"), payload)
