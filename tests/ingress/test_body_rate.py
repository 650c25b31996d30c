"""A client's request bodies are read at its own --max-body-rate: one tenant sending big
bodies back to back waits for its own, and another tenant's requests go on meanwhile."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import msgspec
import pytest

from tests.conftest import Stack, keyed_settings, start_stack

pytestmark = pytest.mark.asyncio(loop_scope="session")

BIG, CALM = "sk-big-0123456789abcdef", "sk-calm-0123456789abcdef"
LIMIT = 300_000  # --max-request-bytes: the bucket holds one such body
RATE = 20_000  # bytes a second: a body of 250 KB in debt is 12 s of waiting


def _big_body() -> bytes:
    """A body of 250 KB that is refused once read (max_tokens below 1): cheap to answer."""
    pad = "x" * 250_000
    body = {"model": "deepseek-v4", "max_tokens": 0,
            "messages": [{"role": "user", "content": pad}]}  # fmt: skip
    return msgspec.json.encode(body)


async def test_a_tenants_big_bodies_wait_for_its_own_rate_and_nobody_elses(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> None:
    settings = keyed_settings(stack, tmp_path_factory.mktemp("body-rate"),
                              f"big {BIG}\ncalm {CALM}\n",
                              max_request_bytes=LIMIT, max_body_rate=RATE)  # fmt: skip
    ingress = await start_stack(stack.settings.nats, settings, ["ingress"])
    rate = ingress.ingress.body_rate
    try:
        async with (
            httpx.AsyncClient(base_url=ingress.url, timeout=60,
                              headers={"Authorization": f"Bearer {BIG}"}) as big,
            httpx.AsyncClient(base_url=ingress.url, timeout=60,
                              headers={"Authorization": f"Bearer {CALM}"}) as calm,
        ):  # fmt: skip
            body = _big_body()
            headers = {"Content-Type": "application/json"}
            # The first two are read at once (the second into debt); the third waits.
            for _ in range(2):
                first = await big.post("/v1/chat/completions", content=body, headers=headers)
                assert first.status_code == 400, first.text
            began = rate.began_waiting.waiter()
            third = asyncio.ensure_future(
                big.post("/v1/chat/completions", content=body, headers=headers)
            )
            await began.wait()
            assert rate.waiting == 1
            answer = await calm.post("/v1/chat/completions", json={
                "model": "deepseek-v4", "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
            assert answer.status_code == 200, answer.text
            assert not third.done() and rate.waiting == 1  # still its own to wait for
            third.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await third
    finally:
        await ingress.close()
