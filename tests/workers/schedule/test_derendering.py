"""Local derendering (in the owner, or a pool worker): the pure core in process, a large
call off the event loop; and the pool over the bus, a call too big for one message split."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import msgspec
import nats
import pytest
from nats.aio.msg import Msg

from tests.conftest import Stack, make_settings
from tokenway import bus
from tokenway.derendering import THREAD_ABOVE
from tokenway.errors import StageUnavailable
from tokenway.wire import Derendered, DerenderEntry, OutputContext
from workers.derender.backend import LocalBackend
from workers.derender.core import derender_call
from workers.schedule.derendering import Pool

pytestmark = pytest.mark.asyncio(loop_scope="session")

CTX = OutputContext(api="completion", response_id="cmpl-1", model="m", prompt_tokens=2)


def entry(tokens: int) -> DerenderEntry:
    return DerenderEntry(context=CTX, token_ids=[6366] * tokens, finish_reason="length")


async def loop_ran_during(call: asyncio.Future[object]) -> bool:
    """Whether a task scheduled after `call` ran before it finished: `call` let the event loop
    go on rather than holding it to the end."""
    seen: list[bool] = []

    async def other() -> None:
        seen.append(call.done())

    asyncio.get_running_loop().create_task(other())
    await call
    await asyncio.sleep(0)  # `other` has run by now, either way
    return seen == [False]


async def test_the_owner_derenders_as_the_core_does_a_large_call_in_a_thread(
    model_dir: Path,
) -> None:
    owner = backend = LocalBackend(model_dir)
    small, large = [entry(8)], [entry(THREAD_ABOVE + 1)]
    assert await owner.derender(small) == derender_call(backend.detok, small)
    assert not await loop_ran_during(asyncio.ensure_future(owner.derender(small)))
    call = asyncio.ensure_future(owner.derender(large))
    assert await loop_ran_during(call)  # the loop went on while it ran
    assert call.result() == derender_call(backend.detok, large)


async def test_a_call_over_the_bus_limit_splits_between_requests_that_share_a_response_id(
    stack: Stack,
) -> None:
    """Two whole answers of requests that share a response id (their X-Request-Id), each of
    which fits in a bus message but not both (their client bodies ride along): the pool's
    call is split between them, and each is derendered."""
    nc = await nats.connect(stack.observer)
    try:
        pool = Pool(nc, stack.settings, stack.model)
        body = b'{"prompt": "%s"}' % (b"x" * (nc.max_payload * 5 // 8))
        ctx = msgspec.structs.replace(CTX, model=stack.model, response_id="cmpl-same",
                                      request_body=body)  # fmt: skip
        entries = [DerenderEntry(context=ctx, token_ids=[6366, 33], finish_reason="length")] * 2
        results = await pool.derender(entries)
    finally:
        await nc.close()
    assert [(type(r), len(r.chunks)) for r in results] == [(Derendered, 1), (Derendered, 1)]


async def test_a_reply_from_a_derender_worker_of_the_version_before_fails_the_call_clearly(
    nats_url: str, tmp_path: Path
) -> None:
    """During an upgrade an owner may call a derender worker of the version before results
    were variants (its results name no kind): the call fails as the stage being unavailable
    (the owner answers its requests 502), saying why, never as a crash."""
    nc = await nats.connect(nats_url)
    model = f"m{uuid.uuid4().hex[:8]}"

    async def old_worker(msg: Msg) -> None:
        old = {"results": [{"chunks": [b'{"id": "cmpl-1"}'], "state": b"s"}]}
        await msg.respond(msgspec.msgpack.encode(old))

    sub = await nc.subscribe(bus.derender_subject(model), queue=bus.DERENDER_QUEUE, cb=old_worker)
    try:
        await nc.flush()
        pool = Pool(nc, make_settings(tmp_path), model)
        with pytest.raises(StageUnavailable, match="another version") as failed:
            await pool.derender([entry(2)])
        assert "kind" in failed.value.message
    finally:
        await sub.unsubscribe()
        await nc.close()
