"""What one request may make the process build is bounded, on every API, and no bound hurts
an honest large request (issue 30, item 3): through the whole pipeline with the real SDKs.

A chat body whose one tool had 80,000 string properties (7 MB) was templated into a 7 MB
prompt and tokenized (about 1 GB at the peak, 600 MB of it kept) before its 400 said the
prompt was past the context."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import openai
import pytest
import pytest_asyncio

from tests.conftest import Stack

pytestmark = pytest.mark.asyncio(loop_scope="session")

HELLO = [{"role": "user", "content": "Describe a city."}]


def wide_schema(properties: int) -> dict[str, Any]:
    props = {f"property_{i:06d}": {"type": "string",
                                   "description": f"The string property number {i}."}
             for i in range(properties)}  # fmt: skip
    return {"type": "object", "properties": props}


WIDE = wide_schema(80_000)


def ordinary_tool(i: int) -> dict[str, Any]:
    """A tool as real tool sets have them: a few typed, described arguments."""
    return {"type": "function", "function": {
        "name": f"tool_{i}", "description": f"Looks up record kind {i} by its key.",
        "parameters": {"type": "object", "required": ["key"], "properties": {
            "key": {"type": "string", "description": "The record's key."},
            "fields": {"type": "array", "items": {"type": "string"},
                       "description": "Which fields to return."},
            "limit": {"type": "integer", "minimum": 1, "maximum": 100},
            "order": {"type": "string", "enum": ["asc", "desc"]},
        }},
    }}  # fmt: skip


@pytest_asyncio.fixture(loop_scope="session")
async def client(stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=f"{stack.url}/v1", api_key="-", max_retries=0, timeout=120
    ) as c:
        yield c


def names_the_schema_limit(message: str) -> None:
    """The limit, its value and the schemas' size (about 7 MB, as the SDK writes it)."""
    assert "--max-schema-bytes" in message and "1048576" in message, message
    assert re.search(r"schemas come to \d{7} bytes", message), message


async def test_a_tool_of_80000_properties_is_a_400_naming_the_limit_on_chat(
    client: openai.AsyncOpenAI, stack: Stack
) -> None:
    tools: Any = [{"type": "function", "function": {"name": "fill", "parameters": WIDE}}]
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(model=stack.model, messages=HELLO, tools=tools)
    error: Any = bad.value.body
    names_the_schema_limit(error["message"])
    assert error["param"] == "tools[0].function.parameters", error


async def test_a_tool_of_80000_properties_is_a_400_naming_the_limit_on_responses(
    client: openai.AsyncOpenAI, stack: Stack
) -> None:
    tools: Any = [{"type": "function", "name": "fill", "parameters": WIDE, "strict": False}]
    with pytest.raises(openai.BadRequestError) as bad:
        await client.responses.create(model=stack.model, input="hi", tools=tools, store=False)
    error: Any = bad.value.body
    names_the_schema_limit(error["message"])
    assert error["param"] == "tools[0].parameters", error


async def test_a_tool_of_80000_properties_is_a_400_naming_the_limit_on_messages(
    stack: Stack,
) -> None:
    async with anthropic.AsyncAnthropic(
        base_url=stack.url, api_key="-", max_retries=0, timeout=120
    ) as claude:
        with pytest.raises(anthropic.BadRequestError) as bad:
            await claude.messages.create(
                model=stack.model, max_tokens=16, messages=HELLO,  # type: ignore[arg-type]
                tools=[{"name": "fill", "input_schema": WIDE}],  # type: ignore[list-item]
            )  # fmt: skip
    body: Any = bad.value.body
    assert body["error"]["type"] == "invalid_request_error", body
    names_the_schema_limit(body["error"]["message"])


async def test_a_prompt_certainly_past_the_context_is_refused_before_it_is_tokenized(
    client: openai.AsyncOpenAI, stack: Stack
) -> None:
    """7 MB of words is at least 290,000 tokens by what the vocabulary's longest tokens
    could cover: refused without tokenizing it (which took 5 s and a gigabyte)."""
    context = stack.ingress.models[0].info.context_length
    with pytest.raises(openai.BadRequestError) as bad:
        await client.completions.create(model=stack.model, prompt="word " * 1_400_000)
    error: Any = bad.value.body
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt", error
    assert f"maximum context length is {context} tokens" in error["message"], error
    assert "at least" in error["message"], error


async def test_128_ordinary_tools_are_served(client: openai.AsyncOpenAI, stack: Stack) -> None:
    tools: Any = [ordinary_tool(i) for i in range(128)]
    auto = await client.chat.completions.create(
        model=stack.model, messages=HELLO, tools=tools, max_tokens=16
    )
    assert auto.choices[0].finish_reason in ("stop", "length"), auto
    forced = await client.chat.completions.create(
        model=stack.model, messages=HELLO, tools=tools, tool_choice="required", max_tokens=400
    )
    calls = forced.choices[0].message.tool_calls
    assert calls and all(c.function.name.startswith("tool_") for c in calls), forced  # type: ignore[union-attr]
    for call in calls:
        assert "key" in json.loads(call.function.arguments)  # type: ignore[union-attr]


async def test_a_100k_token_prompt_with_a_long_stream_is_served(
    client: openai.AsyncOpenAI, stack: Stack
) -> None:
    """ " hi" is one token: the prompt is 100,000 of them and the template's few."""
    prompt = [{"role": "user", "content": "hi" + " hi" * 99_999}]
    stream = await client.chat.completions.create(
        model=stack.model, messages=prompt, stream=True, max_tokens=3000,  # type: ignore[arg-type]
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
    assert usage is not None
    assert 100_000 <= usage.prompt_tokens < 100_020, usage
    assert usage.completion_tokens == 3000, usage
