"""What a client of `tokenway up` sees the simulated engine answer, through the whole
pipeline with the real SDKs: a forced call of an ordinary (non-strict) tool whose arguments
parse into the tool's parameters, as a real model reads them from its prompt, and thinking
that ends by itself before the answer's text."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import openai
import pytest
import pytest_asyncio

from tests.conftest import Stack

pytestmark = pytest.mark.asyncio(loop_scope="session")

HELLO = [{"role": "user", "content": "Describe a city."}]
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"],
}}}  # fmt: skip


@pytest_asyncio.fixture(loop_scope="session")
async def client(stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="-", max_retries=0) as c:
        yield c


@pytest_asyncio.fixture(loop_scope="session")
async def claude(stack: Stack) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(base_url=stack.url, api_key="-", max_retries=0) as c:
        yield c


def assert_weather(arguments: object) -> None:
    assert isinstance(arguments, dict), arguments
    assert isinstance(arguments.get("city"), str) and arguments.get("unit") in ("c", "f"), arguments


@pytest.mark.parametrize(
    ("choice", "tools"),
    [("required", [WEATHER]),
     ({"type": "function", "function": {"name": "get_weather"}}, [TIME, WEATHER]),
     ("required", [TIME, WEATHER])],
    ids=["required", "named", "required-of-two"],
)  # fmt: skip
@pytest.mark.parametrize("seed", [None, 3])
async def test_a_forced_call_of_an_ordinary_tool_has_arguments_of_its_parameters(
    client: openai.AsyncOpenAI, stack: Stack, choice: Any, tools: list[Any], seed: int | None
) -> None:
    """The constraint leaves a non-strict tool's arguments any JSON (as vLLM's does); the
    model writes an object of the parameters its prompt lists for the tool it calls."""
    done = await client.chat.completions.create(
        model=stack.model, messages=HELLO, max_tokens=200, tools=tools, tool_choice=choice,
        seed=seed,
    )  # fmt: skip
    calls = done.choices[0].message.tool_calls
    assert calls, done.choices[0]
    for call in calls:
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_time":
            assert isinstance(arguments, dict) and isinstance(arguments.get("zone"), str)
        else:
            assert call.function.name == "get_weather", call
            assert_weather(arguments)
    if choice != "required" or len(tools) == 1:
        assert [call.function.name for call in calls] == ["get_weather"]


async def test_a_messages_tool_use_of_an_ordinary_tool_has_an_input_of_its_schema(
    claude: anthropic.AsyncAnthropic, stack: Stack
) -> None:
    tool = {"name": "get_weather", "description": "The weather in a city.",
            "input_schema": PARAMETERS}  # fmt: skip
    done = await claude.messages.create(
        model=stack.model, max_tokens=200, messages=HELLO, tools=[tool],
        tool_choice={"type": "any"},
    )  # type: ignore[list-item]  # fmt: skip
    (use,) = [b for b in done.content if b.type == "tool_use"]
    assert use.name == "get_weather" and done.stop_reason == "tool_use"
    assert_weather(use.input)


@pytest.mark.parametrize("seed", [None, 1, 2, 5])
async def test_chat_thinking_without_a_budget_ends_before_the_answer(
    client: openai.AsyncOpenAI, stack: Stack, seed: int | None
) -> None:
    done = await client.chat.completions.create(
        model=stack.model, messages=HELLO, max_tokens=400, seed=seed,
        extra_body={"chat_template_kwargs": {"thinking": True}},
    )  # fmt: skip
    message = done.choices[0].message
    assert getattr(message, "reasoning", None) and message.content, message
    assert done.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "ask",
    [{"thinking": {"type": "enabled", "budget_tokens": 1024}},
     {"thinking": {"type": "adaptive"}},
     {"thinking": {"type": "adaptive"}, "extra_body": {"output_config": {"effort": "high"}}}],
    ids=["budget", "adaptive", "effort"],
)  # fmt: skip
async def test_messages_thinking_comes_before_a_text_block(
    claude: anthropic.AsyncAnthropic, stack: Stack, ask: dict[str, Any]
) -> None:
    done = await claude.messages.create(model=stack.model, max_tokens=1100, messages=HELLO, **ask)
    assert [b.type for b in done.content] == ["thinking", "text"], done.content
    assert done.content[0].thinking and done.content[1].text  # type: ignore[union-attr]
    assert done.stop_reason == "end_turn"
