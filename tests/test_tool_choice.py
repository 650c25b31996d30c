"""A `tool_choice` the request's `tools` cannot meet is the client's 400 on all three APIs,
streamed or not, through the whole pipeline with the real SDKs (it was a 500: the structural
tag of a named tool that is not among the tools indexed an empty list). What vLLM 0.33
refuses is refused, and what it takes is taken."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import openai
import pytest
import pytest_asyncio

from tests.conftest import Stack

pytestmark = pytest.mark.asyncio(loop_scope="session")

HELLO = [{"role": "user", "content": "Describe a city."}]
F = {"type": "function", "function": {"name": "f", "parameters": {}}}
STRICT = {"type": "function", "function": {"name": "f", "strict": True,
          "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}  # fmt: skip


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


@pytest_asyncio.fixture(loop_scope="session")
async def client(stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="-", max_retries=0) as c:
        yield c


@pytest_asyncio.fixture(loop_scope="session")
async def claude(stack: Stack) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(base_url=stack.url, api_key="-", max_retries=0) as c:
        yield c


async def _chat(client: openai.AsyncOpenAI, stack: Stack, stream: bool, **extra: Any) -> Any:
    made = await client.chat.completions.create(
        model=stack.model, messages=HELLO, max_tokens=8, stream=stream, **extra
    )
    if stream:
        return [chunk async for chunk in made]
    return made


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"tools": [F], "tool_choice": named("nope")}, "tool_choice", "'nope'"),
        ({"tools": [STRICT], "tool_choice": named("nope")}, "tool_choice", "'nope'"),
        ({"tools": [F], "tool_choice": named("nope"),
          "extra_body": {"structured_outputs": {"grammar": 'root ::= "a"'}}},
         "tool_choice", "'nope'"),
        ({"tools": [F], "tool_choice": named("")}, "tool_choice.function.name", "empty"),
        ({"tool_choice": named("f")}, "tool_choice", "`tools` must be set"),
        ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
        ({"tools": [], "tool_choice": "required"}, "tools", "empty array"),
        ({"tools": [], "tool_choice": named("f")}, "tools", "empty array"),
        # "auto" with a strict tool ORs the calls with the request's own constraint, which
        # was read before it was checked
        ({"tools": [STRICT], "extra_body": {"structured_outputs": {"structural_tag": "{}"}}},
         "structured_outputs", "structural_tag"),
        ({"tools": [STRICT], "extra_body": {"structured_outputs": {"structural_tag": "[]"}}},
         "structured_outputs", "structural_tag"),
        ({"tools": [STRICT], "extra_body": {"structured_outputs": {"structural_tag": "no"}}},
         "structured_outputs", "structural tag"),
        ({"tools": [STRICT], "extra_body": {"structured_outputs": {"structural_tag":
          '{"structures": [{}], "triggers": ["<a>"]}'}}}, "structured_outputs", "structural"),
        ({"tools": [STRICT], "extra_body": {"structured_outputs": {"json": "{not json"}}},
         "structured_outputs", "json"),
        ({"tools": [STRICT], "extra_body": {"guided_json": "{not json"}}, "guided_json", "json"),
    ],
    ids=["named-not-a-tool", "named-not-a-strict-tool", "named-not-a-tool-with-grammar",
         "named-no-name", "named-no-tools", "required-no-tools", "required-empty-tools",
         "named-empty-tools", "auto-tag-without-format", "auto-tag-a-list",
         "auto-tag-not-json", "auto-tag-old-form-without-begin", "auto-json-not-json",
         "auto-guided-json-not-json"],
)  # fmt: skip
async def test_a_chat_tool_choice_the_tools_cannot_meet_is_a_400_naming_it(
    client: openai.AsyncOpenAI, stack: Stack, stream: bool, extra: dict, param: str, says: str
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        await _chat(client, stack, stream, **extra)
    error = bad.value.body
    assert error["param"] == param, error
    assert says in error["message"], error


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"tools": [{"name": "f", "input_schema": {"type": "object"}}],
          "tool_choice": {"type": "tool", "name": "nope"}}, "'nope'"),
        ({"tool_choice": {"type": "tool", "name": "f"}}, "`tools` must be set"),
        ({"tool_choice": {"type": "any"}}, "`tools` must be set"),
    ],
    ids=["named-not-a-tool", "named-no-tools", "any-no-tools"],
)  # fmt: skip
async def test_a_messages_tool_choice_the_tools_cannot_meet_is_a_400_in_anthropics_shape(
    claude: anthropic.AsyncAnthropic, stack: Stack, stream: bool, extra: dict, says: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        made = await claude.messages.create(model=stack.model, max_tokens=8, messages=HELLO,
                                            stream=stream, **extra)  # fmt: skip
        if stream:
            [event async for event in made]
    body = bad.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert says in body["error"]["message"], body


async def test_a_messages_auto_tool_choice_without_tools_answers(
    claude: anthropic.AsyncAnthropic, stack: Stack
) -> None:
    done = await claude.messages.create(model=stack.model, max_tokens=8, messages=HELLO,
                                        tool_choice={"type": "auto"})  # fmt: skip
    assert done.content and done.stop_reason in ("end_turn", "max_tokens")


async def _respond(client: openai.AsyncOpenAI, stack: Stack, stream: bool, **extra: Any) -> Any:
    made = await client.responses.create(
        model=stack.model, input="Describe a city.", max_output_tokens=16, store=False,
        stream=stream, **extra,
    )  # fmt: skip
    if stream:
        return [event async for event in made]
    return made


RESPONSES_F = {"type": "function", "name": "f", "parameters": {"type": "object"}}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"tools": [RESPONSES_F], "tool_choice": {"type": "function", "name": "nope"}},
         "'nope'"),
        ({"tool_choice": {"type": "function", "name": "f"}}, "'f'"),
        ({"tools": [], "tool_choice": {"type": "function", "name": "f"}}, "'f'"),
        ({"tool_choice": "required"}, "required"),
        ({"tools": [], "tool_choice": "required"}, "required"),
    ],
    ids=["named-not-a-tool", "named-no-tools", "named-empty-tools", "required-no-tools",
         "required-empty-tools"],
)  # fmt: skip
async def test_a_responses_tool_choice_the_tools_cannot_meet_is_a_400_naming_it(
    client: openai.AsyncOpenAI, stack: Stack, stream: bool, extra: dict, says: str
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        await _respond(client, stack, stream, **extra)
    error = bad.value.body
    assert error["param"] == "tool_choice", error
    assert says in error["message"], error


@pytest.mark.parametrize(
    "extra",
    [{"tool_choice": "auto"}, {"tools": [], "tool_choice": "auto"}, {"tools": []},
     {"tool_choice": "none"}],
    ids=["auto-no-tools", "auto-empty-tools", "empty-tools", "none-no-tools"],
)  # fmt: skip
async def test_a_responses_tool_choice_with_nothing_to_call_answers_as_none(
    client: openai.AsyncOpenAI, stack: Stack, extra: dict
) -> None:
    """OpenAI and vLLM take `auto` (or `none`) without tools: there is nothing to call."""
    done = await _respond(client, stack, False, **extra)
    assert done.output_text and not [i for i in done.output if i.type == "function_call"]
