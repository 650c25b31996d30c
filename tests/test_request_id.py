"""A client's X-Request-Id (vLLM's habit): it names the response, every response echoes it,
and the stream keeps an id of its own for resuming."""

from __future__ import annotations

import asyncio
import re

import httpx
import openai
import pytest

from tests.conftest import Stack
from tests.test_errors import assert_error

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHAT = [{"role": "user", "content": "hi"}]
CLIENT_ID = "job-42.a:7_b"


def client(stack: Stack, request_id: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{stack.url}/v1", api_key="unused", max_retries=0,
        default_headers={"X-Request-Id": request_id},
    )  # fmt: skip


async def test_a_client_request_id_names_the_response_and_comes_back(stack: Stack) -> None:
    api = client(stack, CLIENT_ID)
    raw = await api.chat.completions.with_raw_response.create(
        model="deepseek-v4", messages=CHAT, max_tokens=4
    )
    assert raw.headers["x-request-id"] == CLIENT_ID
    assert raw.parse().id == f"chatcmpl-{CLIENT_ID}"
    raw = await api.completions.with_raw_response.create(
        model="deepseek-v4", prompt="hi", max_tokens=4
    )
    assert raw.headers["x-request-id"] == CLIENT_ID
    assert raw.parse().id == f"cmpl-{CLIENT_ID}"


async def test_a_stream_echoes_the_client_id_and_resumes_by_its_own(stack: Stack) -> None:
    api = client(stack, CLIENT_ID)
    raw = await api.chat.completions.with_raw_response.create(
        model="deepseek-v4", messages=CHAT, max_tokens=4, stream=True
    )
    chunks = [chunk async for chunk in raw.parse()]
    assert raw.headers["x-request-id"] == CLIENT_ID
    assert {chunk.id for chunk in chunks} == {f"chatcmpl-{CLIENT_ID}"}
    stream_id = raw.headers["x-tokenway-stream-id"]
    assert re.fullmatch(r"[0-9a-f]{24}", stream_id)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        resumed = await http.get(f"/v1/streams/{stream_id}", headers={"Last-Event-ID": "1"})
    assert resumed.status_code == 200 and resumed.text.endswith("data: [DONE]\n\n")
    assert resumed.headers["x-tokenway-stream-id"] == stream_id


async def test_requests_sharing_a_client_id_each_run(stack: Stack) -> None:
    """The id names responses; it does not key the request (a client reusing one loses
    nothing)."""
    api = client(stack, CLIENT_ID)
    calls = [
        api.completions.create(model="deepseek-v4", prompt="hi", max_tokens=4, seed=i)
        for i in range(3)
    ]
    done = await asyncio.gather(*calls)
    assert [c.choices[0].finish_reason for c in done] == ["length"] * 3


async def test_without_a_client_id_every_response_carries_its_own(stack: Stack) -> None:
    api = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    raw = await api.chat.completions.with_raw_response.create(
        model="deepseek-v4", messages=CHAT, max_tokens=4
    )
    assert raw.parse().id == f"chatcmpl-{raw.headers['x-request-id']}"


async def test_errors_and_other_routes_echo_the_client_id(stack: Stack) -> None:
    echo = {"X-Request-Id": CLIENT_ID}
    async with httpx.AsyncClient(base_url=stack.url, timeout=30, headers=echo) as http:
        body = {"model": "no-such-model", "messages": CHAT}
        missing = await http.post("/v1/chat/completions", json=body)
        assert_error(missing, 404)
        wrong = await http.get("/v1/completions")
        assert_error(wrong, 405)
        models = await http.get("/v1/models")
        assert models.status_code == 200
        nowhere = await http.get("/v1/nowhere")
        assert_error(nowhere, 404)
    for resp in (missing, wrong, models, nowhere):
        assert resp.headers.get_list("x-request-id") == [CLIENT_ID], resp.request.url


@pytest.mark.parametrize("bad", ["two words", "x" * 129, "semi;colon", "é"])
async def test_an_invalid_client_id_is_400_on_every_route(stack: Stack, bad: str) -> None:
    headers = [("X-Request-Id", bad.encode())]
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        body = {"model": "deepseek-v4", "messages": CHAT, "max_tokens": 4}
        chat = await http.post("/v1/chat/completions", json=body, headers=headers)
        models = await http.get("/v1/models", headers=headers)
    for resp in (chat, models):
        error = assert_error(resp, 400, "X-Request-Id")
        assert error["param"] == "X-Request-Id"
