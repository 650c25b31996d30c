"""A client that leaves mid-stream leaves no engine work, owner state, slot or consumer behind."""

from __future__ import annotations

import asyncio

import httpx
import nats
import pytest

from tests.conftest import Stack
from tokenway import bus

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def consumer_names(nats_url: str) -> set[str]:
    nc = await nats.connect(nats_url)
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
    assert not schedule.ours
    assert all(not e.tasks for e in engines)
    assert len(router.nc._subs) == subs_before
    assert await consumer_names(nats_url) == consumers_before
