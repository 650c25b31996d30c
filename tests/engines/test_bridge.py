"""The engine bridge on a real bus: work in, token steps out, aborts, orphaned work."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import nats
import pytest
from tokenizers import Tokenizer

from engines.bridge import Bridge, Emit, Engine, Refused
from engines.sim import SimConfig, SimEngine
from tests.conftest import Bus, make_settings, wait_engines
from tokenway import bus
from tokenway.model import default_model_dir
from tokenway.registry import EngineRegistry
from tokenway.wire import (
    EngineAbort,
    EngineInfo,
    EngineReply,
    EngineWork,
    SamplingParams,
    TokenStep,
)

pytestmark = pytest.mark.asyncio(loop_scope="session")


@contextlib.asynccontextmanager
async def running_bridge(
    on: Bus, tmp_path: Path, engine: Engine, owner: str
) -> AsyncIterator[tuple[Bridge, nats.NATS, asyncio.Queue[TokenStep]]]:
    """`engine` behind a running bridge (as the engine role), registered; every TokenStep
    sent to `owner` (the test's observer connection plays the owner)."""
    settings = make_settings(tmp_path)
    bridge = Bridge(on.role(settings, "engine"), engine)
    stop = asyncio.Event()
    running = asyncio.create_task(bridge.run(on.url, stop))
    nc = await nats.connect(on.watch)
    registry = EngineRegistry(
        await bus.engines_kv(nc.jetstream(), settings), [engine.info().model], 3.0
    )
    watching = asyncio.create_task(registry.run(stop))
    steps: asyncio.Queue[TokenStep] = asyncio.Queue()

    async def on_step(msg: nats.aio.msg.Msg) -> None:
        await steps.put(msgspec.msgpack.decode(msg.data, type=TokenStep))

    try:
        await nc.subscribe(bus.tok_subject(owner), cb=on_step)
        await wait_engines(registry, 1)  # it registers once it listens
        yield bridge, nc, steps
    finally:
        stop.set()
        await asyncio.gather(running, watching)
        await nc.close()


async def test_work_orphaned_for_a_new_owner_tells_the_old_owner_it_was_dropped(
    session_bus: Bus, tmp_path: Path
) -> None:
    """A new owner drops the dead one's work on `tw.orphan.<rid>`; if the old owner is
    alive after all (it only stalled), it must hear that its attempt ended."""
    tokenizer = Tokenizer.from_file(str(default_model_dir(tmp_path) / "tokenizer.json"))
    engine_id = model = f"bridge-{uuid.uuid4().hex[:8]}"
    config = SimConfig(id=engine_id, model=model, eos_token_id=1, ttft=0, itl=0.001)
    engine = SimEngine(config, tokenizer)
    async with running_bridge(session_bus, tmp_path, engine, "old") as (bridge, nc, steps):
        work = EngineWork(
            rid="r1", attempt=1, owner="old", token_ids=[0, 6366],
            sampling_params=SamplingParams(max_tokens=100_000, ignore_eos=True),
        )  # fmt: skip
        reply = await nc.request(
            bus.engine_subject(engine_id, "generate"), msgspec.msgpack.encode(work)
        )
        async with asyncio.timeout(10):
            assert msgspec.msgpack.decode(reply.data, type=EngineReply).accepted
            await steps.get()  # it runs
            abort = EngineAbort(rid="r1", attempt=0, owner="new")
            await nc.publish(bus.orphan_subject("r1"), msgspec.msgpack.encode(abort))
            while True:
                step = await steps.get()
                [last] = [e for e in step.entries if e.error] or [None]
                if last is not None:
                    break
            await bridge.idle.wait()
        assert "dropped for the request's new owner" in last.error
        assert last.finish_reason == "error" and not bridge.tasks


class Turns:
    """An engine whose attempts each emit one token when the test says: a step of vLLM's
    arrives as one HTTP chunk per sequence, each in a loop turn of its own."""

    def __init__(self, engine_id: str, model: str, rids: list[str]) -> None:
        self.id, self.model = engine_id, model
        # rid → one entry per step to emit (True: the last)
        self.go: dict[str, asyncio.Queue[bool]] = {rid: asyncio.Queue() for rid in rids}

    def info(self) -> EngineInfo:
        return EngineInfo(id=self.id, model=self.model)

    async def generate(self, work: EngineWork, emit: Emit) -> None:
        turns = self.go[work.rid]
        while True:
            last = await turns.get()
            emit([7], "length" if last else None, None)
            if last:
                return

    async def healthy(self) -> str | None:
        return None

    async def aclose(self) -> None:
        pass


async def test_an_engine_step_spread_over_loop_turns_leaves_as_one_message(
    session_bus: Bus, tmp_path: Path
) -> None:
    engine_id = model = f"turns-{uuid.uuid4().hex[:8]}"
    engine = Turns(engine_id, model, ["a", "b"])

    def entries(step: TokenStep) -> list[tuple[str, int]]:
        return sorted((e.rid, e.seq) for e in step.entries)

    async with running_bridge(session_bus, tmp_path, engine, "o1") as (_, nc, steps):
        subject = bus.engine_subject(engine_id, "generate")
        async with asyncio.timeout(10):
            for rid in ("a", "b"):
                work = EngineWork(rid=rid, attempt=1, owner="o1", token_ids=[0],
                                  sampling_params=SamplingParams())  # fmt: skip
                await nc.request(subject, msgspec.msgpack.encode(work))
            for rid in ("a", "b"):  # first steps: nothing waits for a sequence still
                await engine.go[rid].put(False)  # prefilling (its first token, unknown)
                await asyncio.sleep(0)
            firsts = entries(await steps.get())
            firsts += [] if len(firsts) == 2 else entries(await steps.get())
            assert firsts == [("a", 0), ("b", 0)]
            for rid in ("a", "b"):  # one step: each sequence in its own loop turn
                await engine.go[rid].put(False)
                await asyncio.sleep(0)
            assert entries(await steps.get()) == [("a", 1), ("b", 1)]
            await engine.go["a"].put(False)  # b says nothing this time: a goes out alone
            assert entries(await steps.get()) == [("a", 2)]
            for rid in ("a", "b"):
                await engine.go[rid].put(True)
            ends = entries(await steps.get())
            ends += [] if len(ends) == 2 else entries(await steps.get())
            assert ends == [("a", 3), ("b", 2)]


class Refuses:
    """An engine that refuses every request itself, as vLLM refuses a grammar it cannot
    compile (`str()` names the server, for the log; `reason` is the client's)."""

    def __init__(self, engine_id: str) -> None:
        self.id = engine_id

    def info(self) -> EngineInfo:
        return EngineInfo(id=self.id, model=self.id)

    async def generate(self, work: EngineWork, emit: Emit) -> None:
        raise Refused("http://10.0.0.7:8000 answered 400: bad tag", 400, "bad tag")

    async def healthy(self) -> str | None:
        return None

    async def aclose(self) -> None:
        pass


async def test_an_engines_refusal_reaches_the_owner_as_the_requests_with_its_status(
    session_bus: Bus, tmp_path: Path
) -> None:
    engine = Refuses(f"refuses-{uuid.uuid4().hex[:8]}")
    async with running_bridge(session_bus, tmp_path, engine, "o-refused") as (_, nc, steps):
        work = EngineWork(rid="r1", attempt=1, owner="o-refused", token_ids=[0, 6366],
                          sampling_params=SamplingParams(max_tokens=4))  # fmt: skip
        await nc.request(bus.engine_subject(engine.id, "generate"), msgspec.msgpack.encode(work))
        async with asyncio.timeout(10):
            [last] = (await steps.get()).entries
    assert last.refused == 400 and last.finish_reason == "error"
    assert last.error == f"engine {engine.id} refused the request: bad tag"  # no server URL


async def test_an_engine_configured_with_a_longer_ttl_than_its_bucket_stays_registered(
    session_bus: Bus, tmp_path: Path
) -> None:
    """The registry bucket keeps the TTL it was provisioned with (the session's 3 s here).
    A bridge configured with 30 s beat every 10 s, so its entry expired 3 s after each
    beat and every request it ran for those 7 s failed as 'engine stopped heartbeating'
    (the vLLM tier's 15 s engines did). It beats by the bucket's TTL: several beats in a
    row land with no expiry between them."""
    tokenizer = Tokenizer.from_file(str(default_model_dir(tmp_path) / "tokenizer.json"))
    engine_id = model = f"bridge-{uuid.uuid4().hex[:8]}"
    engine = SimEngine(SimConfig(id=engine_id, model=model, eos_token_id=1), tokenizer)
    settings = make_settings(tmp_path, engine_ttl=30.0)
    bridge = Bridge(session_bus.role(settings, "engine"), engine)
    nc = await nats.connect(session_bus.watch)
    kv = await bus.engines_kv(nc.jetstream(), settings)
    assert (await kv.status()).ttl == 3.0  # as the session provisioned it
    watch = await kv.watch(bus.token(engine_id), include_history=False)
    stop = asyncio.Event()
    running = asyncio.create_task(bridge.run(session_bus.url, stop))
    try:
        beats = 0
        while beats < 4:
            entry = await asyncio.wait_for(watch.updates(timeout=None), 30)
            if entry is None:  # the (empty) snapshot's end
                continue
            assert entry.operation is None, f"the entry expired after {beats} beats"
            beats += 1
    finally:
        stop.set()
        await running
        await watch.stop()
        await nc.close()
