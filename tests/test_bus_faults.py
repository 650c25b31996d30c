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
from tests.test_errors import assert_error
from tokenway import bus

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


async def refused(stack: Stack, *needles: str) -> None:
    """A chat request is refused for now: 503, Retry-After, an error naming `needles`."""
    async with httpx.AsyncClient(timeout=60) as http:
        resp = await http.post(f"{stack.url}/v1/chat/completions", json=CHAT)
    error = assert_error(resp, 503, *needles)
    assert error["type"] == "ServiceUnavailableError"
    assert resp.headers["retry-after"] == "1"


@pytest_asyncio.fixture(loop_scope="session")
async def own_stack(nats_url: str, tmp_path: Path) -> AsyncIterator[Stack]:
    """A pipeline of its own (its streams get deleted), retrying the bus for 3 s."""
    settings = make_settings(tmp_path, bus_retry=3.0, request_timeout=60)
    stack = await start_stack(nats_url, settings, ["ingress", "render", "schedule", "sim"])
    yield stack
    await stack.close()


async def test_a_dropped_render_consumer_is_recreated(own_stack: Stack, nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    spec = bus.render_consumer(own_stack.settings, own_stack.model)
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
        await refused(own_stack, "queue")
    finally:
        await bus.provision_streams(js, own_stack.settings)
        await nc.close()


async def test_a_stream_longer_than_the_owners_ack_wait_stays_with_its_owner(
    nats_url: str, tmp_path: Path
) -> None:
    """Owners give up a request within `owner_ack_wait` of dying, so a live owner must keep
    acknowledging progress on every request it holds: a stream of several ack waits is
    never redelivered to another worker."""
    # A model of its own: a request another test left queued for the default model would be
    # this owner's to run first (with the session's stacks, 18 s of others' work).
    settings = make_settings(tmp_path, owner_ack_wait=0.4, sim_itl=0.01,
                             served_model_name=f"ack-wait-{tmp_path.name}")  # fmt: skip
    stack = await start_stack(nats_url, settings, ["ingress", "render", "schedule", "sim"])
    nc = await nats.connect(nats_url)
    try:
        body = {**CHAT, "max_tokens": 150, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=60) as http:
            resp = await http.post(f"{stack.url}/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 150
        spec = bus.sched_consumer(settings, stack.model)
        info = await nc.jetstream().consumer_info(spec.stream, spec.durable)
        assert info.config.ack_wait == 0.4
        assert info.num_redelivered == 0
    finally:
        await nc.close()
        await stack.close()


async def test_a_model_with_no_live_engine_is_a_503_naming_it(
    nats_url: str, tmp_path: Path
) -> None:
    """No engine registered: the request waits `engine_wait` for one, then says so, instead
    of sitting in the queue until its deadline."""
    # A model of its own: other tests' engines of the default model share this NATS.
    settings = make_settings(tmp_path, engine_wait=0.5, request_timeout=20,
                             served_model_name=f"engineless-{tmp_path.name}")  # fmt: skip
    stack = await start_stack(nats_url, settings, ["ingress", "render", "schedule"])
    try:
        await refused(stack, stack.model, "no engine")
    finally:
        await stack.close()


async def test_a_publish_over_the_bus_limit_is_refused_at_once_not_retried(
    nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Too big is an answer, like a refusal: `publish_stored` must not retry it for
    `within` seconds (the client would wait that long for its 400)."""
    nc = await nats.connect(nats_url)
    try:
        with pytest.raises(nats.errors.MaxPayloadError):
            await bus.publish_stored(
                nc.jetstream(), bus.render_subject("too-big"), b"x" * (nc.max_payload + 1),
                {}, within=30.0,
            )  # fmt: skip
        assert "retrying" not in caplog.text
    finally:
        await nc.close()
