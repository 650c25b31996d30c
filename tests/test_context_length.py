"""A prompt past the model's context, or a budget past what is left of it, is a 400 naming
the parameter as the client's API spells it (a completion's prompt was named `messages`),
through the whole pipeline with the real SDKs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import openai
import pytest
import pytest_asyncio

from tests.conftest import Stack

pytestmark = pytest.mark.asyncio(loop_scope="session")

HELLO = [{"role": "user", "content": "hi"}]


@pytest_asyncio.fixture(loop_scope="session")
async def client(stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="-", max_retries=0) as c:
        yield c


def context(stack: Stack) -> int:
    return stack.ingress.models[0].info.context_length


def past_context(stack: Stack) -> str:
    """A text of more tokens than the context holds (" hi" is one token)."""
    return "hi" + " hi" * context(stack)


async def refused(call: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as bad:
        await call
    error = bad.value.body
    assert error["code"] == "context_length_exceeded", error
    return error


@pytest.mark.parametrize("prompt", ["ids", "text", "several"])
async def test_a_completion_prompt_past_the_context_names_the_prompt(
    client: openai.AsyncOpenAI, stack: Stack, prompt: str
) -> None:
    ids = [100] * (context(stack) + 1)
    given: Any = {"ids": ids, "text": past_context(stack), "several": [[100, 101], ids]}[prompt]
    error = await refused(client.completions.create(model=stack.model, prompt=given,
                                                    max_tokens=1))  # fmt: skip
    assert error["param"] == "prompt" and str(context(stack)) in error["message"], error


async def test_a_completion_budget_past_the_context_names_max_tokens(
    client: openai.AsyncOpenAI, stack: Stack
) -> None:
    error = await refused(client.completions.create(model=stack.model, prompt="hi",
                                                    max_tokens=context(stack)))  # fmt: skip
    assert error["param"] == "max_tokens", error


async def test_a_chat_prompt_past_the_context_names_the_messages(
    client: openai.AsyncOpenAI, stack: Stack
) -> None:
    messages = [{"role": "user", "content": past_context(stack)}]
    error = await refused(client.chat.completions.create(model=stack.model, messages=messages,
                                                         max_tokens=1))  # fmt: skip
    assert error["param"] == "messages", error


async def test_a_chat_budget_past_the_context_names_the_field_given(
    client: openai.AsyncOpenAI, stack: Stack
) -> None:
    error = await refused(client.chat.completions.create(
        model=stack.model, messages=HELLO, max_completion_tokens=context(stack)))  # fmt: skip
    assert error["param"] == "max_completion_tokens", error
    error = await refused(client.chat.completions.create(
        model=stack.model, messages=HELLO, max_tokens=context(stack)))  # fmt: skip
    assert error["param"] == "max_tokens", error


async def test_a_responses_prompt_past_the_context_names_the_input(
    client: openai.AsyncOpenAI, stack: Stack
) -> None:
    error = await refused(client.responses.create(model=stack.model, input=past_context(stack),
                                                  max_output_tokens=16, store=False))  # fmt: skip
    assert error["param"] == "input", error
    error = await refused(client.responses.create(model=stack.model, input="hi", store=False,
                                                  max_output_tokens=context(stack)))  # fmt: skip
    assert error["param"] == "max_output_tokens", error


async def test_a_messages_prompt_past_the_context_is_anthropics_400(stack: Stack) -> None:
    async with anthropic.AsyncAnthropic(base_url=stack.url, api_key="-", max_retries=0) as claude:
        with pytest.raises(anthropic.BadRequestError) as bad:
            await claude.messages.create(
                model=stack.model, max_tokens=16,
                messages=[{"role": "user", "content": past_context(stack)}],
            )  # fmt: skip
    body = bad.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert str(context(stack)) in body["error"]["message"], body
