"""Graceful drain: a stopping stack answers new requests 503, lets open streams finish
within `drain_timeout`, and ends what cannot finish with an error event naming the
shutdown, then [DONE]; its schedule worker hands what it still owns to a peer at once."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from tests.conftest import make_settings, start_stack
from tests.streams import Streamed, post, until
from tests.test_errors import assert_error
from tokenway.aio import Signal

pytestmark = pytest.mark.asyncio(loop_scope="session")

STAGES = ["ingress", "render", "schedule", "sim"]


def body(tokens: int) -> dict:
    return {"prompt": "Tell a long story.", "stream": True, "max_tokens": tokens,
            "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip


async def stopped_mid_stream(
    nats_url: str,
    tmp: Path,
    tokens: int,
    meanwhile: Callable[[httpx.AsyncClient, str], Awaitable[None]] | None = None,
    **overrides: object,
) -> Streamed:
    """A stack with `overrides`, told to stop once a stream of `tokens` has begun;
    `meanwhile(client, base URL)` runs once it drains. The stream as its client saw it."""
    # A model of its own: on the session's bus, another stack's schedule worker would take
    # over what this one hands over when it stops, and finish it within the drain.
    settings = make_settings(tmp, served_model_name=f"drain-{uuid.uuid4().hex[:8]}", **overrides)
    stack = await start_stack(nats_url, settings, STAGES)
    progress, out = Signal(), Streamed()
    async with httpx.AsyncClient(timeout=60) as http:
        streaming = asyncio.create_task(post(http, stack.url, body(tokens), out, progress))
        await until(progress, lambda: len(out.times) >= 3)
        stack.stop.set()
        await stack.ingress.draining.wait()
        if meanwhile is not None:
            await meanwhile(http, stack.url)
        await streaming
    await stack.task
    return out


async def test_a_stopping_stack_refuses_new_requests_and_finishes_open_streams(
    nats_url: str, tmp_path: Path
) -> None:
    async def refused(http: httpx.AsyncClient, url: str) -> None:
        resp = await http.post(f"{url}/v1/completions", json=body(5))
        error = assert_error(resp, 503, "shutting down")
        assert error["type"] == "ServiceUnavailableError"
        assert (await http.get(f"{url}/ready")).status_code == 503

    out = await stopped_mid_stream(nats_url, tmp_path, 150, refused, sim_itl=0.01, drain_timeout=60)
    assert out.error is None and out.done == 1
    assert out.usage is not None and out.usage["completion_tokens"] == 150


async def test_a_stream_that_outlasts_the_drain_ends_with_an_error_naming_it(
    nats_url: str, tmp_path: Path
) -> None:
    out = await stopped_mid_stream(nats_url, tmp_path, 400, sim_itl=0.05, drain_timeout=0.5)
    assert out.error is not None and "shutting down" in out.error["message"], out.raw[-300:]
    assert out.rid and out.rid in out.error["message"]  # where to resume it
    assert out.done == 1
