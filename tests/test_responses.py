"""OpenAI's Responses API through the whole pipeline, with the `openai` SDK: a response, a
function-calling loop that sends the output items back as input, reasoning, a JSON schema
format, and what is not served refused by name."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest
import pytest_asyncio

from tests.conftest import Stack, make_settings, start_stack

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


async def test_a_function_calling_loop_goes_on_from_the_stored_call_on_another_ingress(
    client: openai.AsyncOpenAI, stack: Stack, tmp_path: Path
) -> None:
    """The Codex way: the next turn names the response that called the tool and sends only
    the tool's output; another ingress finds the call in the store."""
    called = await client.responses.create(
        model=stack.model, input="Weather in Paris for two days?", tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200,
    )  # fmt: skip
    (call,) = [item for item in called.output if item.type == "function_call"]
    other = await start_stack(stack.settings.nats, make_settings(tmp_path), ["ingress"])
    try:
        async with openai.AsyncOpenAI(base_url=f"{other.url}/v1", api_key="-",
                                      max_retries=0) as there:  # fmt: skip
            answered = await there.responses.create(
                model=stack.model, tools=[WEATHER], previous_response_id=called.id,
                input=[{"type": "function_call_output", "call_id": call.call_id,
                        "output": "Sunny, 21C"}], max_output_tokens=24,
            )  # fmt: skip
            assert answered.output_text and answered.previous_response_id == called.id
            listed = there.responses.input_items.list(answered.id, order="asc")
            items = [i async for i in listed]
        kinds = [i.type for i in items]
        assert kinds == ["message", "function_call", "function_call_output"], kinds
        assert items[1].call_id == items[2].call_id == call.call_id
    finally:
        await other.close()


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


async def test_reasoning_cut_by_the_budget_has_no_empty_message(
    client: openai.AsyncOpenAI, stack: Stack
) -> None:
    """Output that ends while still reasoning is a reasoning item alone, whole or streamed,
    as vLLM answers it (a message item holds text, and there is none)."""
    asks = {"model": stack.model, "input": "Describe a city.", "reasoning": {"effort": "high"},
            "max_output_tokens": 4, "store": False}  # fmt: skip
    whole = await client.responses.create(**asks)
    async with client.responses.stream(**asks) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    for done in (whole, final):
        assert [item.type for item in done.output] == ["reasoning"], done.output
        assert done.status == "incomplete" and done.output_text == ""
    assert "response.output_text.done" not in kinds


async def test_vllms_sampling_extras_reach_the_engine(
    client: openai.AsyncOpenAI, stack: Stack
) -> None:
    """What vLLM's `/v1/responses` takes beyond OpenAI's fields (a regex, template switches,
    seeds and penalties) works here too, rather than being dropped."""
    extras = {"structured_outputs": {"regex": "Sunny, 2[0-9] degrees"}, "top_k": 5,
              "seed": 7, "repetition_penalty": 1.1, "stop_token_ids": [3]}  # fmt: skip
    done = await client.responses.create(
        model=stack.model, input="Weather?", max_output_tokens=60, store=False,
        extra_body=extras,
    )  # fmt: skip
    (work,) = [w for b in stack.by_name["engine"] for w in b.engine.received
               if w.request_id == done.id.removeprefix("resp_")]  # fmt: skip
    params = work.sampling_params
    assert (params.top_k, params.seed, params.repetition_penalty) == (5, 7, 1.1)
    assert params.stop_token_ids == [3] and params.structured_outputs is not None
    assert re.fullmatch("Sunny, 2[0-9] degrees", done.output_text), done.output_text
    thinking = await client.responses.create(  # the template's switch, as the client says
        model=stack.model, input="Weather?", max_output_tokens=60, store=False,
        extra_body={"chat_template_kwargs": {"thinking": True}},
    )  # fmt: skip
    assert thinking.output[0].type == "reasoning"


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


async def test_a_stream_ends_with_the_response_it_would_be_whole(
    client: openai.AsyncOpenAI, stack: Stack
) -> None:
    """Reasoning, text and a function call streamed: the events the SDK reads, numbered in
    order, and a final response equal to the one the same request gets unstreamed."""
    asks = {"model": stack.model, "input": "Describe a city.", "reasoning": {"effort": "high"},
            "tools": [WEATHER], "tool_choice": "required", "max_output_tokens": 300,
            "store": False}  # fmt: skip
    whole = await client.responses.create(**asks)
    async with client.responses.stream(**asks) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and "response.reasoning_text.delta" in kinds
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    calls = [item for item in final.output if item.type == "function_call"]
    assert calls and deltas == "".join(c.arguments for c in calls)
    # every delta names the item it adds to, as the item is added and done
    added = {e.item.id for e in events if e.type == "response.output_item.added"}
    named = {e.item_id for e in events if e.type.endswith(".delta")}
    assert named <= added == {i.id for i in final.output}, (named, added)
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done")
    own = {"id", "call_id", "parsed_arguments"}  # each request's ids; the SDK's parse
    assert [i.model_dump(exclude=own) for i in final.output] == [
        i.model_dump(exclude=own) for i in whole.output
    ]  # fmt: skip
    assert final.usage == whole.usage and final.status == whole.status


async def test_a_text_stream_says_the_same_as_the_whole(
    client: openai.AsyncOpenAI, stack: Stack
) -> None:
    asks = {"model": stack.model, "input": "Describe a city.", "max_output_tokens": 16,
            "store": False}  # fmt: skip
    whole = await client.responses.create(**asks)
    texts = []
    async for event in await client.responses.create(**asks, stream=True):
        if event.type == "response.output_text.delta":
            texts.append(event.delta)
        last = event
    assert "".join(texts) == whole.output_text
    assert last.type == "response.completed" and last.response.status == whole.status
    assert last.response.output_text == whole.output_text


async def test_a_conversation_goes_on_from_its_stored_response_on_another_ingress(
    client: openai.AsyncOpenAI, stack: Stack, tmp_path: Path
) -> None:
    first = await client.responses.create(model=stack.model, input="My name is Ada. Say hi.",
                                          max_output_tokens=8)  # fmt: skip
    assert first.store is True
    other = await start_stack(stack.settings.nats, make_settings(tmp_path / "other"), ["ingress"])
    keyed = await start_stack(stack.settings.nats, make_settings(tmp_path / "keyed",
                              api_key="sk-another-tenant-0123456789"), ["ingress"])  # fmt: skip
    try:
        async with openai.AsyncOpenAI(base_url=f"{other.url}/v1", api_key="-",
                                      max_retries=0) as there:  # fmt: skip
            second = await there.responses.create(
                model=stack.model, previous_response_id=first.id, input="What is my name?",
                max_output_tokens=8,
            )  # fmt: skip
            assert second.previous_response_id == first.id
            # the whole conversation was its prompt
            assert second.usage.input_tokens > first.usage.input_tokens + 8
            items = [i async for i in there.responses.input_items.list(second.id, order="asc")]
            said = [(i.role, i.content[0].text) for i in items if i.type == "message"]
            assert said[0] == ("user", "My name is Ada. Say hi.")
            assert said[1] == ("assistant", first.output_text)
            assert said[-1] == ("user", "What is my name?")
            again = await there.responses.retrieve(first.id)
            assert again.id == first.id and again.output_text == first.output_text
            await there.responses.delete(first.id)
            with pytest.raises(openai.NotFoundError):
                await there.responses.retrieve(first.id)
            with pytest.raises(openai.NotFoundError):
                await there.responses.create(model=stack.model, input="And?",
                                             previous_response_id=first.id)  # fmt: skip
        unkept = await client.responses.create(model=stack.model, input="Hi", store=False,
                                               max_output_tokens=4)  # fmt: skip
        assert unkept.store is False
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unkept.id)
        key = "sk-another-tenant-0123456789"
        async with openai.AsyncOpenAI(base_url=f"{keyed.url}/v1", max_retries=0,
                                      api_key=key) as stranger:  # fmt: skip
            with pytest.raises(openai.NotFoundError):  # another tenant's: as if it never was
                await stranger.responses.retrieve(second.id)
    finally:
        await other.close()
        await keyed.close()


async def test_input_items_are_listed_as_openai_pages_them(
    client: openai.AsyncOpenAI, stack: Stack
) -> None:
    """Newest first unless `order` says asc, `limit` to a page (20 where unsaid), `after`
    an item the next page starts past: the SDK's pagination walks them all."""
    said = [{"role": "user", "content": f"Line {i}."} for i in range(25)]
    done = await client.responses.create(model=stack.model, input=said, max_output_tokens=4)
    texts = [f"Line {i}." for i in range(25)]
    items = client.responses.input_items

    newest = await items.list(done.id)
    assert [i.content[0].text for i in newest.data] == texts[::-1][:20] and newest.has_more
    assert [i.content[0].text async for i in items.list(done.id)] == texts[::-1]
    oldest = [i async for i in items.list(done.id, order="asc", limit=7)]
    assert [i.content[0].text for i in oldest] == texts

    page = await items.list(done.id, order="asc", limit=3, after=oldest[20].id)
    assert [i.content[0].text for i in page.data] == texts[21:24] and page.has_more
    assert (page.first_id, page.last_id) == (oldest[21].id, oldest[23].id)
    last = await items.list(done.id, order="desc", limit=3, after=oldest[2].id)
    assert [i.content[0].text for i in last.data] == ["Line 1.", "Line 0."]
    assert not last.has_more
    hinted = await items.list(done.id, order="asc", include=["message.input_image.image_url"])
    assert len(hinted.data) == 20


@pytest.mark.parametrize(
    ("query", "param"),
    [({"order": "sideways"}, "order"), ({"limit": 0}, "limit"), ({"limit": 101}, "limit"),
     ({"limit": "ten"}, "limit"), ({"after": "msg_nowhere"}, "after"),
     ({"include": ["everything"]}, "include")],
    ids=["order", "limit-0", "limit-101", "limit-not-a-number", "after-unknown", "include"],
)  # fmt: skip
async def test_an_input_items_query_openai_refuses_is_a_400_naming_it(
    client: openai.AsyncOpenAI, stack: Stack, query: dict, param: str
) -> None:
    done = await client.responses.create(model=stack.model, input="Hi.", max_output_tokens=4)
    with pytest.raises(openai.BadRequestError) as bad:
        await client.responses.input_items.list(done.id, **query)
    error = bad.value.body
    assert error["param"] == param and param in error["message"], error


async def test_a_stream_resumes_as_it_was_sent(stack: Stack) -> None:
    """Read back from the ledger, a Responses stream is the same events, without the
    [DONE] a chat stream ends with (and so is a Messages stream)."""
    bodies = {"/v1/responses": {"model": stack.model, "input": "Hi", "stream": True,
                                "max_output_tokens": 8},
              "/v1/messages": {"model": stack.model, "max_tokens": 8, "stream": True,
                               "messages": [{"role": "user", "content": "Hi"}]}}  # fmt: skip
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        for path, body in bodies.items():
            async with http.stream("POST", path, json=body) as resp:
                sent = (await resp.aread()).decode()
                rid = resp.headers["x-tokenway-stream-id"]
            resumed = await http.get(f"/v1/streams/{rid}")
            assert resumed.text == sent and sent.startswith("event: ")
            assert "[DONE]" not in sent


@pytest.mark.parametrize(("extra", "param"), [
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"truncation": "auto"}, "truncation"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"max_tool_calls": 1}, "max_tool_calls"),
    ({"tools": [{"type": "local_shell"}]}, "tools"),
])  # fmt: skip
async def test_what_is_not_served_is_refused_by_name(
    client: openai.AsyncOpenAI, stack: Stack, extra: dict[str, object], param: str
) -> None:
    """A field that would change the answer, if served, is a 400 naming it rather than
    being dropped; hints that change nothing (`include` of encrypted reasoning, as Codex
    sends it with `store: false`; `service_tier`; `prompt_cache_key`) are taken."""
    with pytest.raises(openai.BadRequestError) as bad:
        await client.responses.create(model=stack.model, input="Hi", max_output_tokens=4,
                                      store=False, extra_body=extra)  # fmt: skip
    assert bad.value.body["param"] == param, bad.value.body
    hints = {"include": ["reasoning.encrypted_content"], "service_tier": "auto",
             "prompt_cache_key": "k", "background": False, "truncation": "disabled",
             "top_logprobs": 0}  # fmt: skip
    done = await client.responses.create(model=stack.model, input="Hi", max_output_tokens=4,
                                         store=False, extra_body=hints)  # fmt: skip
    assert done.output_text
