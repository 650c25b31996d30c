"""The engine bridge on a real bus: work in, token steps out, aborts, orphaned work."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import msgspec
import nats
import pytest
from tokenizers import Tokenizer

from engines.bridge import Bridge
from engines.sim import SimConfig, SimEngine
from tests.conftest import make_settings, wait_engines
from tokenway import bus
from tokenway.model import default_model_dir
from tokenway.registry import EngineRegistry
from tokenway.wire import EngineAbort, EngineReply, EngineWork, SamplingParams, TokenStep

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_work_orphaned_for_a_new_owner_tells_the_old_owner_it_was_dropped(
    nats_url: str, tmp_path: Path
) -> None:
    """A new owner drops the dead one's work on `tw.orphan.<rid>`; if the old owner is
    alive after all (it only stalled), it must hear that its attempt ended."""
    tokenizer = Tokenizer.from_file(str(default_model_dir(tmp_path) / "tokenizer.json"))
    engine_id = model = f"bridge-{uuid.uuid4().hex[:8]}"
    config = SimConfig(id=engine_id, model=model, eos_token_id=1, ttft=0, itl=0.001)
    settings = make_settings(tmp_path)
    bridge = Bridge(settings, SimEngine(config, tokenizer))
    stop = asyncio.Event()
    running = asyncio.create_task(bridge.run(nats_url, stop))
    nc = await nats.connect(nats_url)
    registry = EngineRegistry(await bus.engines_kv(nc.jetstream(), settings), model, 3.0)
    watching = asyncio.create_task(registry.run(stop))
    steps: asyncio.Queue[TokenStep] = asyncio.Queue()

    async def on_step(msg: nats.aio.msg.Msg) -> None:
        await steps.put(msgspec.msgpack.decode(msg.data, type=TokenStep))

    try:
        await nc.subscribe(bus.tok_subject("old"), cb=on_step)
        work = EngineWork(
            rid="r1", attempt=1, owner="old", token_ids=[0, 6366],
            sampling_params=SamplingParams(max_tokens=100_000, ignore_eos=True),
        )  # fmt: skip
        await wait_engines(registry, 1)  # it registers once it listens
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
    finally:
        stop.set()
        await asyncio.gather(running, watching)
        await nc.close()
