"""JetStream answering "no leader" or nothing at all, as it does while a cluster elects one,
reproduced on a real single nats-server by taking a stream or a consumer away: stages
retry what is safe to retry, recreate what the server dropped, and a request that cannot be
queued gets a 503 with Retry-After, never a 500."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import nats
import pytest
import pytest_asyncio

from tests.conftest import Logged, Stack, make_settings, start_stack
from tokenway import bus

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


@pytest_asyncio.fixture(loop_scope="session")
async def own_stack(nats_url: str, tmp_path: Path) -> AsyncIterator[Stack]:
    """A pipeline of its own (its streams get deleted), retrying the bus for 3 s."""
    settings = make_settings(tmp_path, bus_retry=3.0, request_timeout=60)
    stack = await start_stack(nats_url, settings, ["ingress", "render", "schedule", "sim"])
    yield stack
    await stack.close()


async def test_a_dropped_render_consumer_is_recreated(own_stack: Stack, nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    spec = bus.render_consumer(own_stack.settings, own_stack.ingress.served)
    await nc.jetstream().delete_consumer(spec.stream, spec.durable)
    async with httpx.AsyncClient(timeout=60) as http:
        resp = await http.post(f"{own_stack.url}/v1/chat/completions", json=CHAT)
    assert resp.status_code == 200, resp.text
    await nc.close()


async def test_queueing_waits_out_a_missing_stream(own_stack: Stack, nats_url: str) -> None:
    """The render queue is gone for a moment (its leader elected anew): the request waits
    and is served once the stream is back."""
    retrying = Logged("retrying")
    logging.getLogger("tokenway.bus").addHandler(retrying)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        await js.delete_stream(bus.RENDER_STREAM)
        async with httpx.AsyncClient(timeout=60) as http:
            request = asyncio.ensure_future(
                http.post(f"{own_stack.url}/v1/chat/completions", json=CHAT)
            )
            await retrying.event.wait()
            await bus.provision_streams(js, own_stack.settings)
            resp = await request
        assert resp.status_code == 200, resp.text
    finally:
        logging.getLogger("tokenway.bus").removeHandler(retrying)
        await nc.close()


async def test_a_request_that_cannot_be_queued_is_503_with_retry_after(
    own_stack: Stack, nats_url: str
) -> None:
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await js.delete_stream(bus.RENDER_STREAM)
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            resp = await http.post(f"{own_stack.url}/v1/chat/completions", json=CHAT)
        assert resp.status_code == 503, resp.text
        assert resp.headers["retry-after"] == "1"
        error = resp.json()["error"]
        assert error["type"] == "ServiceUnavailableError" and "queue" in error["message"]
    finally:
        await bus.provision_streams(js, own_stack.settings)
        await nc.close()
