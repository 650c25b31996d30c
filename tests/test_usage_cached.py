"""Prefix-cache hits in usage, on every API, as vLLM reports them: a prompt sent again finds
its blocks in the engine's cache, and usage says how many of its tokens were read from it
(chat and completions `prompt_tokens_details.cached_tokens`, Responses'
`input_tokens_details.cached_tokens`, Messages' `cache_read_input_tokens`). The simulated
engine keeps a prefix cache of whole KV blocks, as vLLM's does."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anthropic
import openai
import pytest
import pytest_asyncio

from tests.conftest import Stack

pytestmark = pytest.mark.asyncio(loop_scope="session")

# Long enough for several KV blocks; a fresh id up front, so no other test's prompt shares
# more than the template's opening with it.
TEXT = (
    "Write a careful description of a harbour town at dawn: the boats, the gulls, the "
    "fishmongers setting out their stalls, the smell of salt and diesel, the light on the "
    "water, the church bell, and the first bus climbing the hill out of town."
)


def prompt() -> str:
    return f"[{uuid.uuid4().hex}] {TEXT}"


@dataclass
class Apis:
    openai: openai.AsyncOpenAI
    anthropic: anthropic.AsyncAnthropic


@pytest_asyncio.fixture(loop_scope="session")
async def apis(stack: Stack) -> AsyncIterator[Apis]:
    """The SDKs' clients of the stack, as an agent's would be."""
    async with (
        openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="-", max_retries=0) as oa,
        anthropic.AsyncAnthropic(base_url=stack.url, api_key="-", max_retries=0) as an,
    ):
        yield Apis(oa, an)


def assert_hit(first: int, again: int, prompt_tokens: int) -> None:
    """The prompt again: every whole block but the one holding its last token (which the
    engine computes anew, as vLLM does) comes from the cache; the first time, at most the
    template's opening did."""
    block = 16  # the KV block size the stack runs with
    assert again > first, (first, again)
    assert prompt_tokens - block <= again < prompt_tokens, (again, prompt_tokens)


async def sent_twice_then_streamed(create: Callable[..., Any], ask: dict[str, Any]) -> None:
    """Chat or completions: the same request twice, then streamed with include_usage."""
    first = await create(**ask)
    again = await create(**ask)
    assert first.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens or 0
    assert_hit(first.usage.prompt_tokens_details.cached_tokens or 0, cached,
               again.usage.prompt_tokens)  # fmt: skip
    stream = await create(**ask, stream=True, stream_options={"include_usage": True})
    usages = [chunk.usage async for chunk in stream if chunk.usage is not None]
    assert len(usages) == 1 and usages[0].prompt_tokens_details is not None
    assert usages[0].prompt_tokens_details.cached_tokens == cached


async def test_chat_reports_cached_prompt_tokens(apis: Apis, stack: Stack) -> None:
    ask = {"model": stack.model, "max_tokens": 4,
           "messages": [{"role": "user", "content": prompt()}]}  # fmt: skip
    await sent_twice_then_streamed(apis.openai.chat.completions.create, ask)


async def test_completions_report_cached_prompt_tokens(apis: Apis, stack: Stack) -> None:
    ask = {"model": stack.model, "max_tokens": 4, "prompt": prompt()}
    await sent_twice_then_streamed(apis.openai.completions.create, ask)


async def test_responses_report_cached_input_tokens(apis: Apis, stack: Stack) -> None:
    client = apis.openai
    ask = {"model": stack.model, "max_output_tokens": 16, "input": prompt(), "store": False}
    first = await client.responses.create(**ask)  # type: ignore[call-overload]
    again = await client.responses.create(**ask)  # type: ignore[call-overload]
    assert first.usage and again.usage
    cached = again.usage.input_tokens_details.cached_tokens
    assert_hit(first.usage.input_tokens_details.cached_tokens, cached, again.usage.input_tokens)
    stream = await client.responses.create(**ask, stream=True)  # type: ignore[call-overload]
    done = [e.response for e in [e async for e in stream] if e.type == "response.completed"]
    assert len(done) == 1 and done[0].usage is not None
    assert done[0].usage.input_tokens_details.cached_tokens == cached


async def test_messages_report_cache_reads_apart_from_input_tokens(
    apis: Apis, stack: Stack
) -> None:
    """Anthropic counts `input_tokens` after the cache: the prompt is the sum of the two."""
    claude = apis.anthropic
    ask = {"model": stack.model, "max_tokens": 4,
           "messages": [{"role": "user", "content": prompt()}]}  # fmt: skip
    first = await claude.messages.create(**ask)  # type: ignore[arg-type]
    again = await claude.messages.create(**ask)  # type: ignore[arg-type]
    whole = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    cached = again.usage.cache_read_input_tokens or 0
    assert_hit(first.usage.cache_read_input_tokens or 0, cached, whole)
    assert again.usage.input_tokens == whole - cached
    assert again.usage.cache_creation_input_tokens == 0
    async with claude.messages.stream(**ask) as stream:  # type: ignore[arg-type]
        started = [e.message.usage async for e in stream if e.type == "message_start"]
        final = await stream.get_final_message()
    for usage in (started[0], final.usage):
        assert usage.cache_read_input_tokens == cached
        assert usage.input_tokens == whole - cached


async def test_a_completion_of_several_prompts_sums_their_cached_tokens(
    apis: Apis, stack: Stack
) -> None:
    client = apis.openai
    prompts = [prompt(), prompt()]
    sizes = []
    for p in prompts:
        alone = await client.completions.create(model=stack.model, max_tokens=2, prompt=p)
        assert alone.usage
        sizes.append(alone.usage.prompt_tokens)
    both = await client.completions.create(model=stack.model, max_tokens=2, prompt=prompts)
    assert both.usage and both.usage.prompt_tokens_details
    whole_blocks = sum((size - 1) // 16 * 16 for size in sizes)
    assert both.usage.prompt_tokens_details.cached_tokens == whole_blocks
