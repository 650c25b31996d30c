"""OpenAI's Responses API through the whole pipeline, with the `openai` SDK: a response, a
function-calling loop that sends the output items back as input, reasoning, a JSON schema
format, and what is not built yet refused by name."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import openai
import pytest
import pytest_asyncio

from tests.conftest import Stack

pytestmark = pytest.mark.asyncio(loop_scope="session")

WEATHER = {
    "type": "function", "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                   "days": {"type": "integer"}}, "required": ["city", "days"],
                   "additionalProperties": False},
    "strict": True,
}  # fmt: skip


@pytest_asyncio.fixture(loop_scope="session")
async def client(stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="-", max_retries=0) as c:
        yield c


async def test_a_response_of_text(client: openai.AsyncOpenAI, stack: Stack) -> None:
    done = await client.responses.create(
        model=stack.model, input="Describe a city.", instructions="Be brief.",
        max_output_tokens=24, store=False,
    )  # fmt: skip
    assert done.id.startswith("resp_") and done.object == "response"
    assert done.output_text and done.status in ("completed", "incomplete")
    (message,) = done.output
    assert message.type == "message" and message.role == "assistant"
    assert done.usage.input_tokens > 0 and 0 < done.usage.output_tokens <= 24
    if done.status == "incomplete":
        assert done.incomplete_details.reason == "max_output_tokens"


async def test_a_function_calling_loop(client: openai.AsyncOpenAI, stack: Stack) -> None:
    asked = [{"role": "user", "content": "Weather in Paris for two days?"}]
    called = await client.responses.create(
        model=stack.model, input=asked, tools=[WEATHER], store=False,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200,
    )  # fmt: skip
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city", "days"}
    answered = await client.responses.create(
        model=stack.model, tools=[WEATHER], store=False, max_output_tokens=24,
        input=[*asked, *called.output,
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}],
    )  # fmt: skip
    assert answered.output_text


async def test_reasoning_comes_as_its_own_item(client: openai.AsyncOpenAI, stack: Stack) -> None:
    done = await client.responses.create(
        model=stack.model, input="Describe a city.", reasoning={"effort": "high"},
        max_output_tokens=300, store=False,
    )  # fmt: skip
    first = done.output[0]
    assert first.type == "reasoning" and first.content and first.content[0].text
    again = await client.responses.create(  # its reasoning sent back, as agents do
        model=stack.model, store=False, max_output_tokens=8,
        input=[{"role": "user", "content": "Describe a city."}, *done.output,
               {"role": "user", "content": "Shorter."}],
    )  # fmt: skip
    assert again.output_text


async def test_a_json_schema_format_gives_json_of_it(
    client: openai.AsyncOpenAI, stack: Stack
) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}},
              "required": ["name"], "additionalProperties": False}  # fmt: skip
    done = await client.responses.create(
        model=stack.model, input="Name a city.", max_output_tokens=100, store=False,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema}},
    )  # fmt: skip
    assert set(json.loads(done.output_text)) == {"name"}


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"stream": True}, "stream"), ({"previous_response_id": "resp_0123"},
                                    "previous_response_id")],
    ids=["stream", "stored"],
)  # fmt: skip
async def test_what_is_not_built_yet_is_refused_by_name(
    client: openai.AsyncOpenAI, stack: Stack, extra: dict, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(model=stack.model, input="Hi", **extra)
    assert refused.value.body["param"] == param and "not built yet" in refused.value.message
