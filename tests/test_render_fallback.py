"""The render failure domain through the whole pipeline (real NATS, stages, HTTP, openai SDK):
with `--render-backend vllm`, a healthy render server's tokens reach the engine; when it fails,
the client gets the answer local rendering gives and the fallback counter on /metrics moves;
a 400/422 from it reaches the client with its status and message."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio

from tests.conftest import Stack, make_settings, resolve_model, start_stack
from tests.fakes.vllm_render import FakeVllmRender, Knobs
from tokenway.wire import RenderRequest
from workers.render.core import Renderer

pytestmark = pytest.mark.asyncio(loop_scope="session")

MODEL = "render-vllm"
BODY: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me about rivers."}],
    "max_tokens": 12,
}
# The response names the prompt tokens the engine got.
EXTRA = {"extra_body": {"return_token_ids": True}}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def fake(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[FakeVllmRender]:
    settings = make_settings(tmp_path_factory.mktemp("fake-render"), served_model_name=MODEL)
    async with FakeVllmRender(Renderer(*resolve_model(settings))) as server:
        yield server


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    nats_url: str, fake: FakeVllmRender, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    # A model name of its own: no other test's render worker may take these requests.
    settings = make_settings(
        tmp_path_factory.mktemp("render-vllm"), served_model_name=MODEL,
        render_backend="vllm", render_url=fake.url, render_timeout=1.5,
    )  # fmt: skip
    s = await start_stack(nats_url, settings, ["ingress", "render", "schedule", "derender", "sim"])
    yield s
    await s.close()


@pytest.fixture
def client(stack: Stack, fake: FakeVllmRender) -> openai.AsyncOpenAI:
    fake.reset()
    return openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="-", max_retries=0)


def local_ids(fake: FakeVllmRender) -> list[int]:
    request = RenderRequest(
        api="chat",
        request_id="x",
        body=json.dumps({**BODY, **EXTRA["extra_body"]}).encode(),
        created=0,
    )
    return fake.renderer.render(request).token_ids


async def answer(client: openai.AsyncOpenAI) -> tuple[list[int], str, int]:
    """(prompt token IDs the engine got, the content, prompt_tokens in usage)."""
    resp = await client.chat.completions.create(**BODY, **EXTRA)
    assert resp.usage is not None
    return resp.prompt_token_ids, resp.choices[0].message.content, resp.usage.prompt_tokens


async def fallbacks(stack: Stack, reason: str) -> float:
    async with httpx.AsyncClient(timeout=10) as http:
        page = (await http.get(f"{stack.url}/metrics")).text
    found = re.search(rf'^tokenway_render_fallbacks_total{{reason="{reason}"}} (\S+)$', page, re.M)
    return float(found.group(1)) if found else 0.0


async def test_a_healthy_render_servers_tokens_reach_the_engine(
    client: openai.AsyncOpenAI, fake: FakeVllmRender, stack: Stack
) -> None:
    fake.knobs.prefix = [7, 8, 9]
    ids, content, prompt_tokens = await answer(client)
    assert ids == [7, 8, 9, *local_ids(fake)]
    assert prompt_tokens == len(ids) and content
    assert len(fake.calls) == 1
    assert not stack.by_name["render"][0].backend.local_loaded


@pytest.mark.parametrize(
    ("knobs", "reason"),
    [
        (Knobs(fault="die"), "connection"),
        (Knobs(fault="hang"), "timeout"),
        (Knobs(status=503), "server_error"),
        (Knobs(fault="garbage"), "undecodable"),
        (Knobs(fault="shape"), "shape"),
        (Knobs(fault="vocab"), "vocab"),
    ],
    ids=["die", "hang", "503", "garbage", "shape", "vocab"],
)
async def test_a_failing_render_server_gives_the_local_answer(
    client: openai.AsyncOpenAI, fake: FakeVllmRender, stack: Stack, knobs: Knobs, reason: str
) -> None:
    expected = await answer(client)  # healthy: the fake renders as local rendering does
    assert expected[0] == local_ids(fake)
    before = await fallbacks(stack, reason)
    fake.reset(knobs)
    assert await answer(client) == expected
    assert len(fake.calls) == 1
    assert await fallbacks(stack, reason) == before + 1


async def test_a_render_server_that_went_away_gives_the_local_answer(
    client: openai.AsyncOpenAI, fake: FakeVllmRender, stack: Stack
) -> None:
    expected = await answer(client)
    before = await fallbacks(stack, "connection")
    await fake.stop()
    try:
        assert await answer(client) == expected
    finally:
        await fake.start()
    assert await fallbacks(stack, "connection") == before + 1


@pytest.mark.parametrize(
    ("status", "error"),
    [(400, openai.BadRequestError), (422, openai.UnprocessableEntityError)],
)
async def test_a_render_server_refusal_reaches_the_client_with_its_status(
    client: openai.AsyncOpenAI, fake: FakeVllmRender, stack: Stack, status: int, error: type
) -> None:
    before = await fallbacks(stack, "server_error")
    fake.knobs = Knobs(status=status, message="messages[0]: that is not allowed here")
    with pytest.raises(error) as info:
        await client.chat.completions.create(**{**BODY, "stream": True})
    assert info.value.status_code == status
    assert info.value.body["message"] == "messages[0]: that is not allowed here"
    assert len(fake.calls) == 1  # not retried
    assert await fallbacks(stack, "server_error") == before
