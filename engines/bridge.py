"""The engine-bridge shell: binds any `Engine` to NATS.

It registers the engine in `tw-engines` with heartbeats, takes work on
`tw.engine.<id>.generate`, aborts on `tw.engine.<id>.abort` (and drops the work of a dead
owner on `tw.orphan.<key>`), numbers each attempt's deltas, and sends each engine step (what
every running attempt produced since the last) as one `TokenStep` message per owner. Work is
known by its request's key and attempt (`EngineWork.rid`), never by a client's request id.

With token obfuscation (`--obfuscation-key`), this is the one place where IDs change space:
each attempt's work is mapped to physical IDs before the engine sees it, and each step
back to semantic IDs before it leaves, so nothing above the bridge ever sees a physical
ID. The bridge advertises the key's fingerprint and declines work mapped for another.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from tokenway import bus, spans
from tokenway.config import Settings
from tokenway.obfuscation import Permutation
from tokenway.registry import bucket_ttl, heartbeat
from tokenway.wire import (
    EngineAbort,
    EngineInfo,
    EngineReply,
    EngineWork,
    FinishReason,
    LogprobEntry,
    TokenDelta,
    TokenStep,
)

log = logging.getLogger(__name__)


class Emit(Protocol):
    """How an engine reports one step of one sequence."""

    def __call__(
        self,
        token_ids: list[int],
        finish: FinishReason | None,
        stop_reason: int | str | None,
        logprobs: list[LogprobEntry] | None = None,
        index: int = 0,
        kv_transfer_params: dict[str, object] | None = None,
        cached_tokens: int | None = None,  # prompt tokens found in the prefix cache
    ) -> None: ...


class Refused(Exception):
    """The engine refused the request for a reason of the request's own (a grammar it cannot
    compile, a prompt it rejects): that request's error, with the HTTP status the engine
    answered (a 4xx), never a failure of the engine. `reason` is what the client reads (no
    engine URL in it); `str()` is for the log."""

    def __init__(self, message: str, status: int = 400, reason: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = message if reason is None else reason


# How long an engine step's first delta waits for the rest of the step: a quarter of the
# time since the step before began, within these bounds. vLLM's API server writes a step's
# outputs one sequence after another (~90 µs each on a CPU core), so 32 sequences take ~3 ms
# to arrive: a fixed 2 ms cut most steps in two, and each part cost a commit round.
STEP_GATHER, MAX_STEP_GATHER = 0.002, 0.025

_work_decoder = msgspec.msgpack.Decoder(EngineWork)
_abort_decoder = msgspec.msgpack.Decoder(EngineAbort)
_encoder = msgspec.msgpack.Encoder()


class Engine(Protocol):
    """One variation point: something that turns prompt token IDs into output token IDs."""

    def info(self) -> EngineInfo:
        """Identity, role and capacity, with current load."""
        ...

    async def generate(self, work: EngineWork, emit: Emit) -> None:
        """Run one attempt, calling `emit` per step; cancelled on abort."""
        ...

    async def healthy(self) -> str | None:
        """None when the engine can take work; else why not (it stays out of the registry)."""
        ...

    async def aclose(self) -> None:
        """Release connections, after every attempt has ended."""
        ...


class Bridge:
    name = "engine"

    def __init__(
        self, settings: Settings, engine: Engine, obfuscation: Permutation | None = None
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.obfuscation = obfuscation
        self.fingerprint = obfuscation.fingerprint if obfuscation else None
        self.id = engine.info().id
        self.tasks: dict[tuple[str, int], asyncio.Task[None]] = {}
        self.owners: dict[tuple[str, int], str] = {}  # who each running attempt reports to
        self.orphaned: set[tuple[str, int]] = set()  # attempts dropped for a request's new owner
        self._outbox: dict[str, list[TokenDelta]] = {}
        self._reported: set[tuple[str, int]] = set()  # attempts in the outbox
        # What a step waits for: the running attempts that have stepped (one still
        # prefilling reports nothing: the step does not wait for it)
        self._stepping: set[tuple[str, int]] = set()
        self._step_began = 0.0  # when the last step's first delta came
        self._gather = STEP_GATHER
        self._flush_timer: asyncio.TimerHandle | None = None
        self._nc: NATS | None = None
        self._group: asyncio.TaskGroup | None = None
        self.idle = asyncio.Event()
        self.idle.set()
        # Set when an abort freed sequences: the registry hears it at once, not at the next
        # beat (a new owner relaying handed-over streams onto a full engine waits for it).
        self.freed = asyncio.Event()
        self.problem: str | None = None  # why the last health check kept it out, if it did
        self.checked = asyncio.Event()  # a health check has answered
        self.started = asyncio.Event()  # it takes work

    async def _healthy(self) -> str | None:
        self.problem = await self.engine.healthy()
        self.checked.set()
        return self.problem

    async def run(self, nats_url: str, stop: asyncio.Event) -> None:
        nc = self._nc = await bus.connect(
            nats_url, f"tokenway-engine-{self.id}", self.settings, stop=stop
        )
        kv = await bus.engines_kv(nc.jetstream(), self.settings)
        ttl = await bucket_ttl(kv, self.settings.engine_ttl)
        async with asyncio.TaskGroup() as group:
            self._group = group
            await nc.subscribe(bus.engine_subject(self.id, "generate"), cb=self._on_generate)
            await nc.subscribe(bus.engine_subject(self.id, "abort"), cb=self._on_abort)
            await nc.subscribe(bus.orphan_subject(), cb=self._on_abort)
            group.create_task(heartbeat(kv, self.info, self._healthy, ttl, stop, self.freed))
            log.info(
                "engine %s (%s) serving %s%s",
                self.id,
                self.engine.info().role,
                self.engine.info().model,
                f", token IDs obfuscated (key {self.fingerprint})" if self.fingerprint else "",
            )
            self.started.set()
            await stop.wait()
            for task in list(self.tasks.values()):
                task.cancel()
        await bus.drain(nc)
        await self.engine.aclose()  # after the cancelled attempts sent their aborts

    def info(self) -> EngineInfo:
        """The engine's entry, with the key fingerprint owners match before sending work."""
        info = self.engine.info()
        info.obfuscation = self.fingerprint
        return info

    async def _on_generate(self, msg: Msg) -> None:
        try:
            work = _work_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            await msg.respond(
                _encoder.encode(EngineReply(accepted=False, error=f"bad work: {exc}"))
            )
            return
        if work.obfuscation != self.fingerprint:  # fail closed: never the wrong ID space
            mine = f"key {self.fingerprint}" if self.fingerprint else "no obfuscation"
            theirs = f"key {work.obfuscation}" if work.obfuscation else "plain token IDs"
            reply = EngineReply(
                accepted=False, error=f"engine {self.id} uses {mine}; the work has {theirs}"
            )
            await msg.respond(_encoder.encode(reply))
            return
        info = self.engine.info()
        if info.running >= info.max_seqs:
            reply = EngineReply(
                accepted=False, error=f"engine {self.id} is full ({info.max_seqs} sequences)"
            )
            await msg.respond(_encoder.encode(reply))
            return
        assert self._group is not None
        key = (work.rid, work.attempt)
        self.tasks[key] = self._group.create_task(self._run(work))
        self.owners[key] = work.owner
        self.idle.clear()
        await msg.respond(_encoder.encode(EngineReply(accepted=True)))

    async def _on_abort(self, msg: Msg) -> None:
        try:
            abort = _abort_decoder.decode(msg.data)
        except msgspec.DecodeError:
            log.warning("engine %s: undecodable abort ignored", self.id)
            return
        if abort.owner is None:
            keys = [(abort.rid, abort.attempt)]
        else:  # orphaned: whatever of this request runs for an owner that is gone
            keys = [k for k, o in self.owners.items() if k[0] == abort.rid and o != abort.owner]
            self.orphaned.update(keys)
        for key in keys:
            task = self.tasks.get(key)
            if task is not None:
                task.cancel()

    async def _run(self, work: EngineWork) -> None:
        seq = 0
        obf = self.obfuscation

        def emit(
            token_ids: list[int],
            finish: FinishReason | None,
            stop_reason: int | str | None,
            logprobs: list[LogprobEntry] | None = None,
            index: int = 0,
            kv_transfer_params: dict[str, object] | None = None,
            cached_tokens: int | None = None,
        ) -> None:
            nonlocal seq
            if obf is not None:  # back to semantic IDs; an unknown ID fails the attempt
                token_ids = obf.to_semantic(token_ids)
                stop_reason = obf.stop_reason_to_semantic(stop_reason)
                if logprobs is not None:
                    logprobs = obf.logprobs_to_semantic(logprobs)
            delta = TokenDelta(
                rid=work.rid,
                attempt=work.attempt,
                seq=seq,
                token_ids=token_ids,
                finish_reason=finish,
                stop_reason=stop_reason,
                logprobs=logprobs,
                index=index,
                kv_transfer_params=kv_transfer_params,
                cached_tokens=cached_tokens,
            )
            seq += 1
            self._queue(work.owner, delta)

        key = (work.rid, work.attempt)
        rid = work.request_id or work.rid  # what the request is called in the logs
        span = spans.start(
            "generate",
            work.traceparent,
            "client",
            request_id=rid,
            engine=self.id,
            attempt=work.attempt,
        )
        work.traceparent = span.traceparent() or work.traceparent  # the engine's spans: ours
        failed: str | None = None
        try:
            await self.engine.generate(obf.work_to_physical(work) if obf else work, emit)
        except asyncio.CancelledError:
            span.set(aborted=True)
            self.freed.set()  # (the task ends, and its sequence with it, before the beat)
            if key in self.orphaned:  # an owner thought dead may be alive: it must know
                failed = "dropped for the request's new owner"
                self._fail(work, seq, f"engine {self.id}: {failed}")
            # else aborted: the owner asked, so it expects nothing more
        except Refused as exc:  # the request's own fault: its error, not the engine's
            log.info("engine %s refused %s (%d): %s", self.id, rid, exc.status, exc)
            failed = f"refused ({exc.status}): {exc.reason}"
            self._fail(work, seq, f"engine {self.id} refused the request: {exc.reason}", exc.status)
        except Exception as exc:  # the engine failed this attempt: tell the owner why
            log.exception("engine %s failed %s", self.id, rid)
            failed = f"{type(exc).__name__}: {exc}"
            self._fail(work, seq, f"engine {self.id}: {failed}")
        finally:
            span.set(steps=seq)
            span.end(failed)
            self.tasks.pop(key, None)
            self._stepping.discard(key)
            self.owners.pop(key, None)
            self.orphaned.discard(key)
            if not self.tasks:
                self.idle.set()

    def _fail(self, work: EngineWork, seq: int, error: str, refused: int | None = None) -> None:
        """The attempt's last delta: it ended without a finish, and why (`refused`: the
        status of the engine's refusal of the request itself)."""
        delta = TokenDelta(
            rid=work.rid,
            attempt=work.attempt,
            seq=seq,
            finish_reason="error",
            error=error,
            refused=refused,
        )
        self._queue(work.owner, delta)

    def _queue(self, owner: str, delta: TokenDelta) -> None:
        """One engine step leaves as one message per owner. A simulated engine emits a step
        in one loop turn; vLLM streams each sequence on a connection of its own, so its step
        arrives spread over several turns: the step is complete once every attempt that
        has stepped before has reported, and leaves anyway a gather's time after its first
        delta (a quarter of the last step's time, `STEP_GATHER` to `MAX_STEP_GATHER`): an
        attempt that stopped reporting holds no step longer."""
        key = (delta.rid, delta.attempt)
        if not self._outbox:  # a step's first delta
            now = time.monotonic()
            since, self._step_began = now - self._step_began, now
            self._gather = min(max(since / 4, STEP_GATHER), MAX_STEP_GATHER)
        self._outbox.setdefault(owner, []).append(delta)
        self._reported.add(key)
        self._stepping.add(key)
        if self._reported.issuperset(self._stepping):
            self._flush()
        elif self._flush_timer is None:
            loop = asyncio.get_running_loop()
            self._flush_timer = loop.call_later(self._gather, self._flush)

    def _flush(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        self._reported.clear()
        outbox, self._outbox = self._outbox, {}
        assert self._nc is not None and self._group is not None
        for owner, entries in outbox.items():
            payload = _encoder.encode(TokenStep(engine=self.id, entries=entries))
            self._group.create_task(self._nc.publish(bus.tok_subject(owner), payload))
