"""A grammar that does not parse is the client's 400 naming the parameter that gave it, on
every API and wherever the grammar stands (top level, the older guided_grammar, inside a
structural tag), streamed or not; it was a 500 (GbnfToLarkError) or, inside a tag, an
engine failure. Through the whole pipeline with the real SDKs."""

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
# What llguidance's GBNF converter cannot read, by each way it fails: its own error, a bare
# Exception (a missing rule, no root), an IndexError (an escape cut off by the end).
BAD = {"unclosed": "root ::= ((", "missing-rule": "root ::= foo", "no-root": 'a ::= "x"',
       "cut-escape": 'root ::= "\\', "bad-range": "root ::= [z-a]"}  # fmt: skip


def tagged(grammar: str) -> dict[str, Any]:
    """A structural tag whose call content is a grammar."""
    content = {"type": "grammar", "grammar": grammar}
    return {"type": "triggered_tags", "triggers": ["<a>"], "tags": [
        {"type": "tag", "begin": "<a>", "content": content, "end": "</a>"}]}  # fmt: skip


@pytest_asyncio.fixture(loop_scope="session")
async def client(stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="-", max_retries=0) as c:
        yield c


async def refused(call: Any, stream: bool) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as bad:
        made = await call
        if stream:
            [chunk async for chunk in made]
    return bad.value.body


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("grammar", BAD.values(), ids=BAD.keys())
@pytest.mark.parametrize(
    ("given", "param"),
    [
        (lambda g: {"structured_outputs": {"grammar": g}}, "structured_outputs"),
        (lambda g: {"guided_grammar": g}, "guided_grammar"),
        (lambda g: {"response_format": {"type": "structural_tag", "format": tagged(g)}},
         "response_format"),
        (lambda g: {"structured_outputs": {"structural_tag": json.dumps(
            {"type": "structural_tag", "format": tagged(g)})}}, "structured_outputs"),
    ],
    ids=["structured-outputs", "guided-grammar", "response-format-tag", "structured-outputs-tag"],
)  # fmt: skip
async def test_a_chat_grammar_that_does_not_parse_is_a_400_naming_it(
    client: openai.AsyncOpenAI, stack: Stack, stream: bool, grammar: str, given: Any, param: str
) -> None:
    error = await refused(client.chat.completions.create(
        model=stack.model, messages=HELLO, max_tokens=8, stream=stream,
        extra_body=given(grammar)), stream)  # fmt: skip
    assert error["param"] == param and "grammar" in error["message"], error


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    ("extra", "param"),
    [({"structured_outputs": {"grammar": BAD["unclosed"]}}, "structured_outputs"),
     ({"guided_grammar": BAD["missing-rule"]}, "guided_grammar")],
    ids=["structured-outputs", "guided-grammar"],
)  # fmt: skip
async def test_a_completion_grammar_that_does_not_parse_is_a_400_naming_it(
    client: openai.AsyncOpenAI, stack: Stack, stream: bool, extra: dict, param: str
) -> None:
    error = await refused(client.completions.create(
        model=stack.model, prompt="A city:", max_tokens=8, stream=stream,
        extra_body=extra), stream)  # fmt: skip
    assert error["param"] == param and "grammar" in error["message"], error


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_responses_grammar_that_does_not_parse_is_a_400_naming_it(
    client: openai.AsyncOpenAI, stack: Stack, stream: bool
) -> None:
    error = await refused(client.responses.create(
        model=stack.model, input="Describe a city.", max_output_tokens=8, store=False,
        stream=stream, extra_body={"structured_outputs": {"grammar": BAD["cut-escape"]}},
    ), stream)  # fmt: skip
    assert error["param"] == "structured_outputs" and "grammar" in error["message"], error


async def test_a_responses_text_format_that_does_not_compile_names_text_format(
    client: openai.AsyncOpenAI, stack: Stack
) -> None:
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}
    error = await refused(client.responses.create(
        model=stack.model, input="Describe a city.", max_output_tokens=8, store=False,
        text=fmt), False)  # type: ignore[arg-type]  # fmt: skip
    assert error["param"] == "text.format" and "json" in error["message"], error


@pytest.mark.parametrize("schema", [{"type": 5}, {"$ref": "#/nowhere"}],
                         ids=["bad-type", "dangling-ref"])  # fmt: skip
async def test_a_messages_output_format_that_does_not_compile_is_anthropics_400(
    stack: Stack, schema: dict
) -> None:
    async with anthropic.AsyncAnthropic(base_url=stack.url, api_key="-", max_retries=0) as claude:
        with pytest.raises(anthropic.BadRequestError) as bad:
            await claude.messages.create(
                model=stack.model, max_tokens=8, messages=HELLO,
                extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}},
            )  # fmt: skip
    body = bad.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert "json" in body["error"]["message"], body
