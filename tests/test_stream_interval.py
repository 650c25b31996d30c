"""vLLM's stream interval: a streamed chunk carries at least N of its request's tokens (the
server's `--stream-interval`, which a request's `stream_interval` may raise, never lower);
the first chunk and the end go at once, and the text is the same as one token at a time."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.test_scheduling import pipeline, sim

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def chunks(url: str, model: str, **extra: object) -> list[list[int]]:
    """The output token IDs of each streamed chunk of one completion, in order."""
    body = {"model": model, "prompt": "Count the chunks.", "max_tokens": 30, "seed": 3,
            "ignore_eos": True, "stream": True, "return_token_ids": True, **extra}  # fmt: skip
    async with httpx.AsyncClient(timeout=60) as http:
        resp = await http.post(f"{url}/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    docs = [json.loads(line[6:]) for line in resp.text.splitlines()
            if line.startswith("data: {")]  # fmt: skip
    return [c["token_ids"] for d in docs for c in d["choices"] if c.get("token_ids")]


def assert_at_least(got: list[list[int]], least: int, every: list[int]) -> None:
    """Every chunk between the first and the last holds `least` tokens or more, and the
    chunks add up to the same tokens as a stream of one token per chunk."""
    assert [t for chunk in got for t in chunk] == every
    assert len(got[0]) >= 1 and all(len(chunk) >= least for chunk in got[1:-1]), got


async def test_a_request_s_stream_interval_gathers_its_tokens_per_chunk(
    nats_url: str, tmp_path: Path
) -> None:
    async with pipeline(nats_url, tmp_path, [sim("si")]) as (stack, _):
        one = await chunks(stack.url, stack.model)
        every = [t for chunk in one for t in chunk]
        assert len(every) == 30 and len(one) > 8  # one or a few tokens per chunk
        four = await chunks(stack.url, stack.model, stream_interval=4)
        assert_at_least(four, 4, every)
        assert len(four) <= 2 + 28 // 4
        async with httpx.AsyncClient(timeout=60) as http:
            for wrong in (0, 2**64):  # (the second found by the fuzz test: it was a 500)
                body = {
                    "model": stack.model,
                    "prompt": "x",
                    "stream": True,
                    "stream_interval": wrong,
                }
                bad = await http.post(f"{stack.url}/v1/completions", json=body)
                assert bad.status_code == 400 and "stream_interval" in bad.text


async def test_the_server_s_stream_interval_is_a_floor_a_request_may_only_raise(
    nats_url: str, tmp_path: Path
) -> None:
    async with pipeline(nats_url, tmp_path, [sim("sf")], stream_interval=5) as (stack, _):
        floor = await chunks(stack.url, stack.model, stream_interval=2)
        every = [t for chunk in floor for t in chunk]
        assert len(every) == 30
        assert_at_least(floor, 5, every)
        assert_at_least(await chunks(stack.url, stack.model, stream_interval=8), 8, every)
