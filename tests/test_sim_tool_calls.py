"""The simulated engine's opt-in tool calls (`--sim-tool-calls`), through the whole pipeline
with the openai SDK: under `tool_choice: auto` and `--tool-strict-level function` (every
request then carries the tools' structural tag, as vLLM's engine gets it), a user's turn is
answered with a call whose arguments fit the tool's schema, and the tool's output with text.
So an agent client's tool loop runs against it: call, result, answer."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import openai
import pytest
import pytest_asyncio

from tests.conftest import Stack, make_settings, start_stack

pytestmark = pytest.mark.asyncio(loop_scope="session")

WEATHER = {"type": "function", "function": {"name": "weather", "description": "A city's weather.",
           "parameters": {"type": "object", "required": ["city", "unit"], "properties": {
               "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}}}}  # fmt: skip
MODEL = "tool-calling-sim"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    # a model of its own: the session's other stacks serve the default one on this bus
    settings = make_settings(tmp_path_factory.mktemp("sim-tools"), served_model_name=MODEL,
                             tool_strict_level="function", sim_tool_calls=True)  # fmt: skip
    s = await start_stack(nats_url, settings, ["ingress", "render", "schedule", "derender", "sim"])
    yield s
    await s.close()


@pytest_asyncio.fixture(loop_scope="session")
async def client(stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="-", max_retries=0) as c:
        yield c


async def test_a_users_turn_gets_a_call_and_the_tools_output_gets_text(
    client: openai.AsyncOpenAI, stack: Stack
) -> None:
    first = await client.chat.completions.create(
        model=stack.model, messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=200
    )
    [choice] = first.choices
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls or []
    assert call.function.name == "weather"
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments["city"], str) and arguments["unit"] in ("c", "f"), arguments
    said = [*ASK, choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees."}]  # fmt: skip
    second = await client.chat.completions.create(
        model=stack.model, messages=said, tools=[WEATHER], tool_choice="auto", max_tokens=200
    )
    [answer] = second.choices
    assert answer.finish_reason == "stop" and not answer.message.tool_calls, answer
    assert (answer.message.content or "").strip(), answer


async def test_without_tools_a_users_turn_gets_text(
    client: openai.AsyncOpenAI, stack: Stack
) -> None:
    made = await client.chat.completions.create(model=stack.model, messages=ASK, max_tokens=200)
    [choice] = made.choices
    assert choice.finish_reason in ("stop", "length") and (choice.message.content or "").strip()


CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("asked", "called"),
    [("Use weather for Oslo.", "weather"), ("What time is it?", "clock")],
    ids=["named", "first"],
)
async def test_the_tool_a_users_turn_names_is_called_else_the_first(
    client: openai.AsyncOpenAI, stack: Stack, asked: str, called: str
) -> None:
    made = await client.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": asked}], tools=[CLOCK, WEATHER],
        tool_choice="auto", max_tokens=200,
    )  # fmt: skip
    [call] = made.choices[0].message.tool_calls or []
    assert call.function.name == called, made
