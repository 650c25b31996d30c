"""`/metrics` as a vLLM operator reads it: vLLM's request families under `tokenway:` with
its `model_name` label, counting exactly what was served; and every ingress answer."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Stack, dead_letter_one

pytestmark = pytest.mark.asyncio(loop_scope="session")

MODEL = {"model_name": "deepseek-v4"}


async def scrape(stack: Stack) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with httpx.AsyncClient() as http:
        page = (await http.get(f"{stack.url}/metrics")).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
    }


def value(page: dict, name: str, **labels: str) -> float:
    return page.get((name, tuple(sorted({**MODEL, **labels}.items()))), 0.0)


async def test_the_request_families_count_what_was_served(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="-", max_retries=0)
    before = await scrape(stack)
    chat = [{"role": "user", "content": "count me"}]
    done = [
        await client.chat.completions.create(model="deepseek-v4", messages=chat, max_tokens=5),
        await client.completions.create(model="deepseek-v4", prompt="and me", max_tokens=3, n=2),
    ]
    stream = await client.chat.completions.create(
        model="deepseek-v4", messages=chat, max_tokens=4, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    usage = [chunk.usage async for chunk in stream if chunk.usage][-1]
    after = await scrape(stack)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    prompts = sum(d.usage.prompt_tokens for d in done) + usage.prompt_tokens
    outputs = sum(d.usage.completion_tokens for d in done) + usage.completion_tokens
    assert grew("tokenway:prompt_tokens_total") == prompts
    assert grew("tokenway:generation_tokens_total") == outputs
    for family in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert grew(f"tokenway:{family}_seconds_count") == 3, family
    # every output token but each request's first follows another engine step
    assert grew("tokenway:inter_token_latency_seconds_count") > 0
    finished = sum(grew("tokenway:request_success_total", finished_reason=r)
                   for r in ("length", "stop"))  # fmt: skip
    assert finished == 4  # one per choice: 1 + 2 + 1
    assert value(after, "tokenway:num_requests_running") == 0
    assert value(after, "tokenway:num_requests_waiting") == 0
    names = ("render", "engine_first_token", "derender", "commit", "sse_write")
    key = "tokenway_stage_seconds_count"
    stages = {stage: after.get((key, (("stage", stage),)), 0)
              - before.get((key, (("stage", stage),)), 0) for stage in names}  # fmt: skip
    assert stages["render"] == stages["engine_first_token"] == 3, stages
    assert stages["derender"] >= 3 and stages["commit"] >= 3 and stages["sse_write"] >= 1, stages


async def test_dead_letters_are_counted_by_stage(stack: Stack) -> None:
    key = ("tokenway_dead_letters_total", (("stage", "render"),))
    before = (await scrape(stack)).get(key, 0.0)
    await dead_letter_one(stack.observer)
    assert (await scrape(stack)).get(key, 0.0) == before + 1


async def test_every_ingress_answer_counts_its_own_refusals_too(stack: Stack) -> None:
    before = await scrape(stack)
    async with httpx.AsyncClient(base_url=stack.url) as http:
        await http.get("/v1/nowhere")  # FastAPI's 404
        await http.get("/v1/models")
        await http.post("/v1/completions", json={"prompt": "hi", "model": "nope"})  # 404
        await http.get("/v1/models", headers={"X-Request-Id": "not valid"})  # 400
    after = await scrape(stack)

    def grew(api: str, status: str) -> float:
        key = ("tokenway_requests_total", (("api", api), ("status", status)))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("other", "404") == 1 and grew("other", "400") == 1
    assert grew("completion", "404") == 1
    assert grew("other", "200") >= 1  # the models list (and the scrapes themselves)
