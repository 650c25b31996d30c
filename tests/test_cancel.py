"""A client that leaves mid-stream leaves no engine work, owner state, slot or consumer behind."""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import nats
import pytest

from tests.conftest import Stack
from tokenway import bus
from tokenway.wire import EngineAbort, FinishReason, TokenDelta, TokenStep

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def consumer_names(nats_url: str) -> set[str]:
    nc = await nats.connect(servers=bus.seeds(nats_url))
    try:
        js = nc.jetstream()
        names = set()
        for stream in (bus.RENDER_STREAM, bus.SCHED_STREAM, bus.OUT_STREAM):
            names |= {c.name for c in await js.consumers_info(stream)}
        return names
    finally:
        await nc.close()


async def test_disconnect_mid_stream_cancels_everything(stack: Stack, nats_url: str) -> None:
    schedule = stack.by_name["schedule"][0]
    engines = stack.by_name["engine"]
    router = stack.ingress.router
    consumers_before = await consumer_names(nats_url)
    subs_before = len(router.nc._subs)

    body = {"messages": [{"role": "user", "content": "a long answer please"}], "stream": True,
            "max_tokens": 100_000, "ignore_eos": True}  # fmt: skip
    async with httpx.AsyncClient(timeout=30) as http:
        async with http.stream("POST", f"{stack.url}/v1/chat/completions", json=body) as resp:
            async for part in resp.aiter_bytes():
                assert b"data: " in part
                break  # the client leaves after its first chunk
        assert schedule.requests, "the request should still be owned while it streams"

    async with asyncio.timeout(10):
        await schedule.empty.wait()
        for engine in engines:
            await engine.idle.wait()
        await router.idle.wait()
    assert not schedule.dispatcher.seqs and not schedule.dispatcher.tokens
    assert all(not e.tasks for e in engines)
    assert len(router.nc._subs) == subs_before
    assert await consumer_names(nats_url) == consumers_before


async def test_client_leaving_a_non_stream_request_cancels_it(stack: Stack, nats_url: str) -> None:
    schedule = stack.by_name["schedule"][0]
    body = {"messages": [{"role": "user", "content": "a very long answer"}],
            "max_tokens": 100_000, "ignore_eos": True}  # fmt: skip
    nc = await nats.connect(nats_url)
    dispatched = await nc.subscribe(bus.engine_subject("*", "generate"))
    async with httpx.AsyncClient() as http:
        request = asyncio.create_task(http.post(f"{stack.url}/v1/chat/completions", json=body))
        await dispatched.next_msg(timeout=10)  # an engine is generating for it now
        request.cancel()  # the client gives up and closes its connection
    await nc.close()
    async with asyncio.timeout(10):
        await schedule.empty.wait()
        for engine in stack.by_name["engine"]:
            await engine.idle.wait()
        await stack.ingress.router.idle.wait()


async def test_output_of_work_the_owner_let_go_aborts_the_engine_again(
    stack: Stack, nats_url: str
) -> None:
    """The one abort for a request the client left can be lost on the way (or still be on
    it): every further step of that work asks again, at most once a second per attempt."""
    owner = stack.by_name["schedule"][0].owner_id
    nc = await nats.connect(nats_url)
    try:
        aborts = await nc.subscribe(bus.engine_subject("ghost", "abort"))
        await nc.flush()

        def step(rid: str, seq: int, finish: FinishReason | None = None) -> bytes:
            delta = TokenDelta(rid=rid, attempt=2, seq=seq, token_ids=[5], finish_reason=finish)
            return msgspec.msgpack.encode(TokenStep(engine="ghost", entries=[delta]))

        for seq in range(3):  # three steps of one unwanted attempt: one abort
            await nc.publish(bus.tok_subject(owner), step("gone-1", seq))
        await nc.publish(bus.tok_subject(owner), step("gone-2", 0, finish="length"))  # its end
        await nc.publish(bus.tok_subject(owner), step("gone-3", 0))  # comes after, in order
        got = [
            msgspec.msgpack.decode((await aborts.next_msg(timeout=10)).data, type=EngineAbort)
            for _ in range(2)
        ]
        assert got == [EngineAbort(rid="gone-1", attempt=2), EngineAbort(rid="gone-3", attempt=2)]
    finally:
        await nc.close()
