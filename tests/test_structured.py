"""Structured outputs and forced tools, through the openai SDK against the whole pipeline:
the constraint reaches the engine in its sampling parameters, and the simulated engine
decodes under it, so what comes back parses."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import httpx
import openai
import pytest
import pytest_asyncio
from pydantic import BaseModel

from engines.sim import SimEngine
from tests.conftest import Stack
from tests.test_errors import assert_error
from tests.test_multi_prompt import leftovers_gone, post_stream, sse, texts
from tests.test_scheduling import model, pipeline, sim
from tokenway.wire import EngineWork
from workers.derender import tools

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHAT = [{"role": "user", "content": "Describe a city."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                       "days": {"type": "integer"}}, "required": ["city", "days"]},
    },
}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"],
}}}  # fmt: skip


class City(BaseModel):
    name: str
    population: int
    landmarks: list[str]


@pytest_asyncio.fixture(loop_scope="session")
async def client(stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="-", max_retries=0) as c:
        yield c


def strict(tool: dict) -> dict:
    return {**tool, "function": {**tool["function"], "strict": True}}


def tag_of(stack: Stack, response_id: str) -> dict:
    """The structural tag's format the engine was held to for the response."""
    so = work_of(stack, response_id).sampling_params.structured_outputs
    assert so is not None and so.structural_tag is not None, so
    tag = json.loads(so.structural_tag)
    assert tag["type"] == "structural_tag"
    return tag["format"]


def work_of(stack: Stack, response_id: str, engines: Sequence[SimEngine] = ()) -> EngineWork:
    """What the engine was asked to run for the response (its id ends in the request's);
    `engines`: where the stack's own bridges are not the ones that ran it."""
    rid = response_id.split("-", 1)[1]
    engines = engines or [b.engine for b in stack.by_name["engine"]]
    (work,) = [w for e in engines for w in e.received if w.request_id == rid]
    return work


async def test_a_pydantic_response_format_parses(client: openai.AsyncOpenAI, stack: Stack) -> None:
    done = await client.chat.completions.parse(
        model=stack.model, messages=CHAT, response_format=City, max_tokens=200
    )
    city = done.choices[0].message.parsed
    assert isinstance(city, City), done.choices[0].message.content
    assert done.choices[0].finish_reason == "stop"
    so = work_of(stack, done.id).sampling_params.structured_outputs
    assert so is not None and so.kinds() == ["json"]
    assert set(so.json["properties"]) == {"name", "population", "landmarks"}  # type: ignore[index]


async def test_a_streamed_json_schema_is_valid_json_of_it(
    client: openai.AsyncOpenAI, stack: Stack
) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
              "items": {"type": "array", "items": {"type": "integer"}}},
              "required": ["ok", "items"]}  # fmt: skip
    stream = await client.chat.completions.create(
        model=stack.model, messages=CHAT, max_tokens=200, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )  # fmt: skip
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    doc = json.loads(text)
    assert isinstance(doc["ok"], bool) and all(isinstance(i, int) for i in doc["items"])


async def test_choice_regex_and_json_object_on_both_routes(
    client: openai.AsyncOpenAI, stack: Stack
) -> None:
    options = ["alpha", "beta", "gamma"]
    chosen = await client.chat.completions.create(
        model=stack.model, messages=CHAT, max_tokens=20,
        extra_body={"structured_outputs": {"choice": options}},
    )  # fmt: skip
    assert chosen.choices[0].message.content in options
    # the older spelling still constrains
    coded = await client.completions.create(
        model=stack.model, prompt="A code:", max_tokens=20,
        extra_body={"guided_regex": r"[A-Z]{3}-\d{4}"},
    )  # fmt: skip
    assert re.fullmatch(r"[A-Z]{3}-\d{4}", coded.choices[0].text), coded.choices[0].text
    obj = await client.completions.create(
        model=stack.model, prompt="JSON:", max_tokens=100,
        extra_body={"response_format": {"type": "json_object"}},
    )  # fmt: skip
    assert isinstance(json.loads(obj.choices[0].text), dict)


async def test_a_required_tool_call_always_parses(client: openai.AsyncOpenAI, stack: Stack) -> None:
    """The bundled model's tool parser has a structural tag: the engine is held to its call
    syntax, strict tools' arguments to their schemas, and the parser reads the calls."""
    done = await client.chat.completions.create(
        model=stack.model, messages=CHAT, max_tokens=200, tools=[strict(WEATHER), TIME],
        tool_choice="required",
    )  # fmt: skip
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        args = json.loads(call.function.arguments)  # get_time's: any JSON (not strict)
        assert call.function.name in ("get_weather", "get_time"), call
        if call.function.name == "get_weather":
            assert set(args) == {"city", "days"} and isinstance(args["days"], int)
    fmt = tag_of(stack, done.id)
    assert fmt["type"] == "tag" and fmt["begin"] == tools.DS_CALLS_BEGIN
    calls = fmt["content"]["tags"]
    begins = [f"{tools.DS_CALL_BEGIN}{name}{tools.DS_SEP}" for name in ("get_weather", "get_time")]
    assert [c["begin"] for c in calls] == begins
    assert [c["content"]["json_schema"] for c in calls] == [WEATHER["function"]["parameters"], True]


async def test_a_named_tool_gets_its_arguments(client: openai.AsyncOpenAI, stack: Stack) -> None:
    done = await client.chat.completions.create(
        model=stack.model, messages=CHAT, max_tokens=200, tools=[strict(WEATHER), TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    (call,) = done.choices[0].message.tool_calls or []
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(args) == {"city", "days"}
    assert isinstance(args["days"], int) and done.choices[0].finish_reason == "stop"
    fmt = tag_of(stack, done.id)
    assert fmt["begin"] == f"{tools.DS_CALLS_BEGIN}{tools.DS_CALL_BEGIN}get_weather{tools.DS_SEP}"
    assert fmt["content"]["json_schema"] == WEATHER["function"]["parameters"]


async def test_without_strict_tool_calling_forced_calls_are_json_of_the_tools_schemas(
    nats_url: str, tmp_path: Path
) -> None:
    """As vLLM with VLLM_ENFORCE_STRICT_TOOL_CALLING=0: "required" is a JSON list of
    name/parameters objects, a named tool its parameters object."""
    async with pipeline(nats_url, tmp_path, [sim("json-calls")], strict_tool_calling=False) as (
        stack, engines,
    ):  # fmt: skip
        async with openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="-") as client:
            done = await client.chat.completions.create(
                model=model(stack), messages=CHAT, max_tokens=200, tools=[WEATHER, TIME],
                tool_choice="required",
            )  # fmt: skip
            named = await client.chat.completions.create(
                model=model(stack), messages=CHAT, max_tokens=200, tools=[WEATHER, TIME],
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
            )  # fmt: skip
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            assert call.function.name in ("get_weather", "get_time")
            assert isinstance(json.loads(call.function.arguments), dict)
        schema = work_of(stack, done.id, engines).sampling_params.structured_outputs.json  # type: ignore[union-attr]
        assert schema["type"] == "array" and schema["minItems"] == 1
        names = [o["properties"]["name"]["enum"] for o in schema["items"]["anyOf"]]
        assert names == [["get_weather"], ["get_time"]]
        (call,) = named.choices[0].message.tool_calls or []
        assert call.function.name == "get_weather"
        assert set(json.loads(call.function.arguments)) == {"city", "days"}
        so = work_of(stack, named.id, engines).sampling_params.structured_outputs
        assert so is not None and so.json == WEATHER["function"]["parameters"]


async def test_with_reasoning_open_the_grammar_starts_after_it(
    client: openai.AsyncOpenAI, stack: Stack
) -> None:
    """The bundled template with thinking on leaves reasoning open: the engine is told so,
    reasons freely, and only the answer after it is held to the constraint."""
    done = await client.chat.completions.create(
        model=stack.model, messages=CHAT, max_tokens=200,
        response_format={"type": "json_object"},
        extra_body={"chat_template_kwargs": {"thinking": True}},
    )  # fmt: skip
    message = done.choices[0].message
    assert getattr(message, "reasoning", None), message  # free text, kept apart
    assert isinstance(json.loads(message.content or ""), dict), message.content
    assert work_of(stack, done.id).reasoning_ended is False
    closed = await client.chat.completions.create(
        model=stack.model, messages=CHAT, max_tokens=200, response_format={"type": "json_object"}
    )
    assert work_of(stack, closed.id).reasoning_ended is True  # thinking off: none is open
    assert isinstance(json.loads(closed.choices[0].message.content or ""), dict)


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"response_format": {"type": "bogus"}}, "response_format.type", "bogus"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "regex is not valid"),
        ({"structured_outputs": {"regex": "[a-"}, "response_format": {"type": "text"}},
         "structured_outputs", "regex is not valid"),
        ({"structured_outputs": {"json": {"type": "bogus"}}}, "structured_outputs",
         "json is not valid"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}},
         "response_format", "regex, json_object"),
        ({"structured_outputs": {}}, "structured_outputs", "no constraint"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "empty list"),
        ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "structured_outputs",
         "not both"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "'json_schema' field"),
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": True,
          "parameters": {"type": "bogus"}}}], "tool_choice": "required"},
         "tools", "structural_tag is not valid"),
        ({"structured_outputs": {"structural_tag": json.dumps(
          {"type": "structural_tag", "format": {"type": "tag", "begin": "{"}})}},
         "structured_outputs", "structural_tag is not valid: format needs a content format"),
        ({"tools": [WEATHER], "structured_outputs": {"regex": "a+"},
          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
         "tool_choice", "not both"),
    ],
    ids=["unknown-format", "bad-regex", "bad-regex-text-format", "not-a-schema", "two-kinds",
         "no-kind", "no-choices", "guided-and-structured", "schema-missing", "bad-tool-schema",
         "half-a-tag",
         "tools-and-constraint"],
)  # fmt: skip
async def test_a_constraint_asked_for_wrongly_is_a_400_naming_it(
    stack: Stack, extra: dict, param: str, says: str
) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        resp = await http.post(f"{stack.url}/v1/chat/completions", json={
            "model": stack.model, "messages": CHAT, "max_tokens": 5, **extra})  # fmt: skip
    assert assert_error(resp, 400, says)["param"] == param


@pytest.mark.parametrize(
    ("ask", "why"),
    [({"structured_outputs": {"json": {"type": "array", "items": {"type": "integer"},
                                        "minItems": 60}}},
      "a request with structured outputs cannot be relayed after output was sent: the engine "
      "would start its grammar over mid-document"),
     ({"n": 2}, "a request with n=2 cannot be relayed after output was sent")],
    ids=["structured", "n=2"],
)  # fmt: skip
async def test_an_engine_failing_after_output_of_a_constrained_request_ends_it_with_the_reason(
    nats_url: str, tmp_path: Path, ask: dict, why: str
) -> None:
    """A new engine would start the grammar over mid-document (or could not continue two
    diverged choices): the stream ends with an error event saying so, never relayed."""
    engines = [dataclasses.replace(sim("fails-later", fail_after=30), itl=0.005)]
    async with pipeline(nats_url, tmp_path, engines) as (stack, (engine,)):
        body = {"model": model(stack), "prompt": "Numbers:", "max_tokens": 400, "stream": True,
                "ignore_eos": True, **ask}  # fmt: skip
        raw, _ = await post_stream(stack.url, body)
        *chunks, last = sse(raw)
        assert last["error"]["message"] == (
            f"engine fails-later: RuntimeError: simulated failure after 30 tokens; {why}"
        )
        assert raw.count("data: [DONE]") == 1
        assert engine.started == 1  # not started again on any engine
        sent = texts(raw)
        assert chunks and all(sent.values())
        if "structured_outputs" in ask:  # one document begun, never a second one
            assert sent[0].startswith("[") and sent[0].count("[") == 1
        await leftovers_gone(stack)


async def test_an_engine_failing_before_output_of_a_constrained_request_is_retried(
    nats_url: str, tmp_path: Path
) -> None:
    engines = [sim("fails-at-once", fail_first=1)]
    async with pipeline(nats_url, tmp_path, engines) as (stack, (engine,)):
        schema = {"type": "array", "items": {"type": "integer"}, "maxItems": 5}
        body = {"model": model(stack), "prompt": "Numbers:", "max_tokens": 100, "stream": True,
                "structured_outputs": {"json": schema}}  # fmt: skip
        raw, _ = await post_stream(stack.url, body)
        assert not any("error" in doc for doc in sse(raw))
        doc = json.loads(texts(raw)[0])
        assert isinstance(doc, list) and all(isinstance(i, int) for i in doc)
        assert engine.started == 2
