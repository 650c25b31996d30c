"""Hostile input is bounded and answered, and hurts nobody else: requests whose answers
cannot travel, on a bus with a small message limit."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import msgspec
import pytest

from tests.conftest import Stack, guarded_bus, make_settings, start_stack
from tests.test_errors import assert_error

LIMIT = 128 * 1024  # the bus's message limit here: a whole response above it cannot commit


# The simulated engine here talks on to `max_tokens`, but nothing says it must: only the
# answer shows the response to be too big.
LOGPROBS = {"prompt": "hi", "n": 8, "max_tokens": 512, "logprobs": 5}
# Small to send to derender (token IDs), too big to answer (their text and their IDs again).
IDS = {"prompt": "hi", "n": 8, "max_tokens": 2048, "return_token_ids": True}
# Certain to be too big before anything runs: no EOS, so every choice runs to max_tokens.
CERTAIN = {**LOGPROBS, "ignore_eos": True}


@pytest.mark.parametrize(
    ("placement", "bigs"),
    [("owner", [LOGPROBS, CERTAIN]), ("pool", [LOGPROBS, IDS])],
    ids=["owner: commit, up front", "pool: call, reply"],
)
async def test_a_response_too_big_for_the_bus_is_a_400_and_spares_the_others(
    tmp_path: Path, placement: str, bigs: list[dict]
) -> None:
    """n=128 × top_logprobs=20 once failed every request of its commit round with a 500
    (owner) or was retried into a 504 two minutes later, derender busy all along (pool)."""
    async with guarded_bus(tmp_path / "js", max_payload=LIMIT) as server:
        settings = make_settings(
            tmp_path, derender_placement=placement, request_timeout=30, sim_output_len=100_000,
            served_model_name=f"small-bus-{placement}",
        )  # fmt: skip
        names = ["ingress", "render", "schedule", "sim", *(["derender"] * (placement == "pool"))]
        stack = await start_stack(server.url, settings, names)
        try:
            small = {"prompt": "hi", "max_tokens": 4}
            async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
                answers = await asyncio.gather(
                    *(http.post("/v1/completions", json=big) for big in bigs),
                    *(http.post("/v1/completions", json=small) for _ in range(4)),
                )
            for big, answer in zip(bigs, answers, strict=False):
                error = assert_error(answer, 400, "over the bus's message limit", "stream: true")
                assert error["param"] == "stream"
                assert ("is at least" in error["message"]) == (big is CERTAIN)  # before inference
            assert [a.status_code for a in answers[len(bigs) :]] == [200] * 4
        finally:
            await stack.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_a_slow_reader_costs_its_ingress_a_bounded_buffer_and_loses_nothing(
    stack: Stack,
) -> None:
    """An ingress that holds one byte of output per stream: every event past the first is
    read back from the ledger as the client takes what it holds, and the client gets the
    same stream as from an ingress that keeps all of it."""
    settings = msgspec.structs.replace(stack.settings, stream_buffer_bytes=1)
    bounded = await start_stack(stack.settings.nats, settings, ["ingress"])
    body = {"prompt": "hi", "n": 2, "max_tokens": 300, "ignore_eos": True, "seed": 7,
            "stream": True, "logprobs": 2}  # fmt: skip

    async def streamed(url: str) -> dict[int, tuple[str, list[str]]]:
        """Each choice's text and finish reasons (how it is cut into chunks, and their order
        among choices, are the engine's timing)."""
        async with (
            httpx.AsyncClient(base_url=url, timeout=60) as http,
            http.stream("POST", "/v1/completions", json=body) as resp,
        ):
            lines = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        texts: dict[int, str] = {}
        finishes: dict[int, list[str]] = {}
        for line in lines[:-1]:
            for c in json.loads(line[6:])["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                finishes.setdefault(c["index"], []).extend(filter(None, [c["finish_reason"]]))
        return {i: (texts[i], finishes[i]) for i in sorted(texts)}

    try:
        whole, read_back = await asyncio.gather(streamed(stack.url), streamed(bounded.url))
        assert read_back == whole
        assert [finishes for _, finishes in whole.values()] == [["length"], ["length"]]
    finally:
        await bounded.close()


async def test_a_whole_response_of_more_ids_than_headers_hold_is_answered(
    tmp_path: Path, stack: Stack
) -> None:
    """20,000 output tokens, not streamed: their IDs listed in one ledger message's headers
    were past JetStream's 64 KiB header limit, and the request got a 502 "could not commit"."""
    settings = make_settings(tmp_path, sim_chunk_size=1000, sim_itl=1e-5, sim_output_len=100_000,
                             served_model_name="long-answer")  # fmt: skip
    names = ["ingress", "render", "schedule", "sim"]
    long = await start_stack(stack.settings.nats, settings, names)
    try:
        body = {"prompt": "hi", "max_tokens": 20_000, "ignore_eos": True, "return_token_ids": True}
        async with httpx.AsyncClient(base_url=long.url, timeout=60) as http:
            answer = await http.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        [choice] = answer.json()["choices"]
        assert len(choice["token_ids"]) == 20_000
        assert answer.json()["usage"]["completion_tokens"] == 20_000
    finally:
        await long.close()
