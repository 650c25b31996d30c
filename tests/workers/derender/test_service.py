"""The derender pool worker on a real bus: a large call does not hold up the calls behind it."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import msgspec
import nats
import pytest

from tests.conftest import make_settings
from tokenway import bus
from tokenway.derendering import THREAD_ABOVE
from tokenway.wire import DerenderCall, Derendered, DerenderEntry, DerenderReply, OutputContext
from workers.derender.service import DerenderService

pytestmark = pytest.mark.asyncio(loop_scope="session")

CTX = OutputContext(api="completion", response_id="cmpl-1", model="m", prompt_tokens=2)


def _call(tokens: int) -> bytes:
    entry = DerenderEntry(context=CTX, token_ids=[6366] * tokens, finish_reason="length")
    return msgspec.msgpack.encode(DerenderCall(entries=[entry]))


async def test_a_large_call_runs_beside_the_small_ones_behind_it(
    nats_url: str, model_dir: Path, tmp_path: Path
) -> None:
    """A whole non-streaming answer of many tokens took the worker's loop for as long as it
    was detokenized: every stream's next chunk, sent after it, waited for it."""
    model = f"m{uuid.uuid4().hex[:8]}"
    service = DerenderService(make_settings(tmp_path), model_dir, model)
    stop = asyncio.Event()
    worker = asyncio.create_task(service.run(nats_url, stop))
    nc = await nats.connect(nats_url)
    try:
        subject = bus.derender_subject(model)
        async with asyncio.timeout(10):
            while not await _answers(nc, subject):
                pass  # until the worker's subscription is in
        answered: list[str] = []

        async def ask(name: str, tokens: int) -> None:
            reply = await nc.request(subject, _call(tokens), timeout=30)
            [result] = msgspec.msgpack.decode(reply.data, type=DerenderReply).results
            assert isinstance(result, Derendered) and result.chunks
            answered.append(name)

        large = asyncio.create_task(ask("large", THREAD_ABOVE * 100))
        await asyncio.gather(*(ask(f"small {i}", 4) for i in range(3)))
        await large
        assert answered[-1] == "large", answered
    finally:
        stop.set()
        await worker
        await nc.close()


async def _answers(nc: nats.NATS, subject: str) -> bool:
    try:
        await nc.request(subject, _call(1), timeout=1)
    except nats.errors.NoRespondersError:
        return False
    return True
