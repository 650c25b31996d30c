"""Anthropic's Messages API through the whole pipeline, with the `anthropic` SDK: a message
and its stream, thinking, a tool-use loop, stop sequences, token counts, keys sent as
`x-api-key`, and errors in Anthropic's shape."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import pytest_asyncio

from tests.conftest import Stack, make_settings, start_stack

pytestmark = pytest.mark.asyncio(loop_scope="session")

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                     "days": {"type": "integer"}}, "required": ["city", "days"]},
    "strict": True,  # its input always follows the schema (else any JSON may come)
}  # fmt: skip
HELLO = [{"role": "user", "content": "Describe a city."}]


@pytest_asyncio.fixture(loop_scope="session")
async def claude(stack: Stack) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(base_url=stack.url, api_key="-", max_retries=0) as c:
        yield c


async def test_a_message_and_its_stream_say_the_same(
    claude: anthropic.AsyncAnthropic, stack: Stack
) -> None:
    # the SDK no longer has the sampling fields: the server still takes them
    greedy = {"temperature": 0, "top_k": 1}
    done = await claude.messages.create(
        model=stack.model, max_tokens=24, messages=HELLO, system="Be brief.", extra_body=greedy
    )
    assert done.type == "message" and done.role == "assistant" and done.id.startswith("msg_")
    assert done.model == stack.model
    (block,) = done.content
    assert block.type == "text" and block.text
    assert done.stop_reason in ("end_turn", "max_tokens")
    assert done.usage.input_tokens > 0 and 0 < done.usage.output_tokens <= 24

    async with claude.messages.stream(
        model=stack.model, max_tokens=24, messages=HELLO, system="Be brief.", extra_body=greedy
    ) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    async with httpx.AsyncClient(base_url=stack.url) as http:  # what the SDK does not show
        raw = await http.post("/v1/messages", json={"model": stack.model, "max_tokens": 4,
                                                    "messages": HELLO, "stream": True})  # fmt: skip
    assert raw.text.startswith("event: message_start\n") and "\nevent: ping\n" in raw.text
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert [b.text for b in final.content] == [block.text]  # greedy: the same text
    assert final.stop_reason == done.stop_reason
    assert final.usage.output_tokens == done.usage.output_tokens


async def test_thinking_comes_as_thinking_blocks_before_the_text(
    claude: anthropic.AsyncAnthropic, stack: Stack
) -> None:
    thinking = {"type": "enabled", "budget_tokens": 1024}
    done = await claude.messages.create(
        model=stack.model, max_tokens=1100, messages=HELLO, thinking=thinking
    )
    kinds = [b.type for b in done.content]
    assert kinds[0] == "thinking" and done.content[0].thinking, done.content
    async with claude.messages.stream(
        model=stack.model, max_tokens=1100, messages=HELLO, thinking=thinking
    ) as stream:
        deltas = [e.delta.type async for e in stream if e.type == "content_block_delta"]
        final = await stream.get_final_message()
    assert deltas[0] == "thinking_delta"
    assert final.content[0].type == "thinking" and final.content[0].thinking
    # blocks are numbered in order, each opened once
    assert [b.type for b in final.content] == sorted(
        {b.type for b in final.content}, key=[b.type for b in final.content].index
    )


async def test_a_thinking_blocks_signature_is_checked_when_it_comes_back(
    claude: anthropic.AsyncAnthropic, stack: Stack
) -> None:
    """Each thinking block is signed with a digest of its thinking (streamed as a
    `signature_delta` before the block's stop): sent back as it came, it is taken; with its
    thinking changed, it is a 400 naming the block."""
    thinking = {"type": "enabled", "budget_tokens": 1024}
    done = await claude.messages.create(model=stack.model, max_tokens=1100, messages=HELLO,
                                        thinking=thinking)  # fmt: skip
    async with claude.messages.stream(model=stack.model, max_tokens=1100, messages=HELLO,
                                      thinking=thinking) as stream:  # fmt: skip
        deltas = [e.delta.type async for e in stream if e.type == "content_block_delta"]
        streamed = await stream.get_final_message()
    assert "signature_delta" in deltas
    for message in (done, streamed):
        block = message.content[0]
        assert block.type == "thinking" and block.signature, block
        turn = [block.model_dump(), *(b.model_dump() for b in message.content[1:])]
        again = [*HELLO, {"role": "assistant", "content": turn},
                 {"role": "user", "content": "And another?"}]  # fmt: skip
        assert (await claude.messages.count_tokens(model=stack.model, messages=again)).input_tokens
        turn[0] = {**turn[0], "thinking": block.thinking + " Or not."}
        with pytest.raises(anthropic.BadRequestError) as bad:
            await claude.messages.count_tokens(model=stack.model, messages=again)
        message = bad.value.body["error"]["message"]
        assert message.startswith("messages[1].content[0].signature"), message


async def test_a_thinking_budget_ends_the_thinking_where_it_says(
    claude: anthropic.AsyncAnthropic, stack: Stack
) -> None:
    """The budget reaches the engine (vLLM's `thinking_token_budget`), which ends the
    reasoning after that many tokens: the same thinking, cut, then the answer's text. A
    chat request names the budget itself (a vLLM extra), below Messages' least of 1024."""
    thinking = {"type": "enabled", "budget_tokens": 1024}
    done = await claude.messages.create(model=stack.model, max_tokens=1025, messages=HELLO,
                                        thinking=thinking)  # fmt: skip
    (work,) = [w for b in stack.by_name["engine"] for w in b.engine.received
               if w.request_id == done.id.removeprefix("msg_")]  # fmt: skip
    assert work.sampling_params.thinking_token_budget == 1024
    async with openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="-") as chat:
        ask = {"model": stack.model, "max_tokens": 60, "messages": HELLO}
        on = {"chat_template_kwargs": {"thinking": True}}
        free = await chat.chat.completions.create(**ask, extra_body=on)
        cut = await chat.chat.completions.create(
            **ask, extra_body={**on, "thinking_token_budget": 5}
        )
    thought, cut_thought = free.choices[0].message.reasoning, cut.choices[0].message.reasoning
    assert thought.startswith(cut_thought) and len(cut_thought) < len(thought)
    assert cut.choices[0].message.content


@pytest.mark.parametrize(("thinking", "why"), [
    ({"type": "enabled", "budget_tokens": 1023}, "at least 1024"),
    ({"type": "enabled", "budget_tokens": 2000}, "less than max_tokens"),
    ({"type": "enabled"}, "budget_tokens"),
])  # fmt: skip
async def test_a_thinking_budget_anthropic_refuses_is_refused(
    claude: anthropic.AsyncAnthropic, stack: Stack, thinking: dict[str, object], why: str
) -> None:
    """Anthropic's rules for the budget, which vLLM's `/v1/messages` keeps too: 1024 or
    more, and less than `max_tokens`."""
    with pytest.raises(anthropic.BadRequestError) as bad:
        await claude.messages.create(model=stack.model, max_tokens=2000, messages=HELLO,
                                     thinking=thinking)  # type: ignore[arg-type]  # fmt: skip
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert why in bad.value.body["error"]["message"]


async def test_the_clients_template_kwargs_are_the_templates(
    claude: anthropic.AsyncAnthropic, stack: Stack
) -> None:
    """vLLM's extra `chat_template_kwargs` turns the template's thinking on as it does on
    vLLM's own route, and wins over what `thinking` would set."""
    on = await claude.messages.create(
        model=stack.model,
        max_tokens=40,
        messages=HELLO,
        extra_body={"chat_template_kwargs": {"thinking": True}},
    )
    assert on.content[0].type == "thinking"
    off = {"thinking": False, "enable_thinking": False}
    said = await claude.messages.create(
        model=stack.model, max_tokens=1100, messages=HELLO,
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"chat_template_kwargs": off},
    )  # fmt: skip
    assert [b.type for b in said.content] == ["text"]


async def test_an_output_format_holds_the_text_to_its_schema(
    claude: anthropic.AsyncAnthropic, stack: Stack
) -> None:
    """Anthropic's structured outputs (`output_config.format`), held to by the engine as a
    JSON schema."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}},
              "required": ["name"], "additionalProperties": False}  # fmt: skip
    output = {"format": {"type": "json_schema", "schema": schema}}
    done = await claude.messages.create(model=stack.model, max_tokens=100, messages=HELLO,
                                        extra_body={"output_config": output})  # fmt: skip
    assert [b.type for b in done.content] == ["text"]
    assert set(json.loads(done.content[0].text)) == {"name"}


# What Claude Code sends with thinking off: an effort, its betas, and no `thinking` (or a
# disabled one).
CLAUDE_CODE_BETAS = {"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
                     "effort-2025-11-24", "anthropic-version": "2023-06-01"}  # fmt: skip


@pytest.mark.parametrize("thinking", [None, {"type": "disabled"}], ids=["unsaid", "disabled"])
async def test_an_effort_without_thinking_asks_for_no_thinking(
    claude: anthropic.AsyncAnthropic, stack: Stack, thinking: dict[str, str] | None
) -> None:
    """Anthropic's `effort` shapes how much a model spends; thinking blocks come only where
    `thinking` turns them on. (Reading effort as "think", a thinking-only reply left Claude
    Code with nothing to show.)"""
    ask = {"thinking": thinking} if thinking else {}
    async with claude.messages.stream(
        model=stack.model,
        max_tokens=200,
        messages=HELLO,
        extra_headers=CLAUDE_CODE_BETAS,
        extra_body={"output_config": {"effort": "high"}},
        **ask,  # type: ignore[arg-type]
    ) as stream:
        deltas = {e.delta.type async for e in stream if e.type == "content_block_delta"}
        final = await stream.get_final_message()
    assert deltas == {"text_delta"}, deltas
    assert [b.type for b in final.content] == ["text"] and final.content[0].text


async def test_an_effort_with_thinking_on_thinks(
    claude: anthropic.AsyncAnthropic, stack: Stack
) -> None:
    done = await claude.messages.create(
        model=stack.model, max_tokens=1100, messages=HELLO, thinking={"type": "adaptive"},
        extra_headers=CLAUDE_CODE_BETAS, extra_body={"output_config": {"effort": "low"}},
    )  # fmt: skip
    assert [b.type for b in done.content] == ["thinking", "text"], done.content


async def test_a_tool_use_loop(claude: anthropic.AsyncAnthropic, stack: Stack) -> None:
    """A forced tool's call comes back as a tool_use block (stop_reason tool_use), streamed
    as input_json deltas too; its result goes back as a tool_result and the model answers."""
    forced = {"type": "tool", "name": "get_weather"}
    done = await claude.messages.create(
        model=stack.model, max_tokens=200, messages=HELLO, tools=[WEATHER], tool_choice=forced
    )
    assert done.stop_reason == "tool_use", done
    (call,) = [b for b in done.content if b.type == "tool_use"]
    assert call.name == "get_weather" and set(call.input) == {"city", "days"}
    async with claude.messages.stream(
        model=stack.model, max_tokens=200, messages=HELLO, tools=[WEATHER], tool_choice=forced
    ) as stream:
        partial = [e.delta.partial_json async for e in stream if e.type == "content_block_delta"
                   and e.delta.type == "input_json_delta"]  # fmt: skip
        streamed = await stream.get_final_message()
    (streamed_call,) = [b for b in streamed.content if b.type == "tool_use"]
    assert (
        json.loads("".join(partial)) == streamed_call.input and streamed.stop_reason == "tool_use"
    )

    answer = await claude.messages.create(
        model=stack.model, max_tokens=24, tools=[WEATHER],
        messages=[*HELLO, {"role": "assistant", "content": done.content},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21C"},
                      {"type": "text", "text": "And so?"}]}],
    )  # fmt: skip
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # what the template saw: the call and its result, as a chat would carry them
    counted = await claude.messages.count_tokens(
        model=stack.model, tools=[WEATHER],
        messages=[*HELLO, {"role": "assistant", "content": done.content},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21C"}]}],
    )  # fmt: skip
    short = await claude.messages.count_tokens(model=stack.model, messages=HELLO)
    assert counted.input_tokens > short.input_tokens > 0


@pytest.mark.parametrize("tool", [
    {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
    {"type": "web_fetch_20250910", "name": "web_fetch", "max_uses": 3},
    {"type": "code_execution_20250825", "name": "code_execution"},
    {"type": "computer_20250124", "name": "computer", "display_width_px": 1024,
     "display_height_px": 768},
])  # fmt: skip
async def test_a_tool_anthropic_runs_is_refused_by_name(
    claude: anthropic.AsyncAnthropic, stack: Stack, tool: dict[str, object]
) -> None:
    """Server tools run on Anthropic's side, and a computer needs screenshots: a deployment
    of a text model runs neither, so the request says which tool, in Anthropic's shape,
    rather than a model answering as if it had searched."""
    for ask in (claude.messages.create, claude.messages.count_tokens):
        extra = {"max_tokens": 20} if ask == claude.messages.create else {}
        with pytest.raises(anthropic.BadRequestError) as bad:
            await ask(model=stack.model, messages=HELLO, tools=[WEATHER, tool],  # type: ignore[list-item]
                      extra_headers=CLAUDE_CODE_BETAS, **extra)  # fmt: skip
        assert bad.value.body["type"] == "error"
        assert bad.value.body["error"]["type"] == "invalid_request_error"
        message = bad.value.body["error"]["message"]
        assert "tools[1]" in message and repr(tool["type"]) in message, message
        assert "not served" in message, message


@pytest.mark.parametrize(("tool", "wants"), [
    ({"type": "bash_20250124", "name": "bash"}, {"command"}),
    ({"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
     {"command", "path"}),
])  # fmt: skip
async def test_anthropics_client_tools_are_served_with_their_schema(
    claude: anthropic.AsyncAnthropic, stack: Stack, tool: dict[str, str], wants: set[str]
) -> None:
    """Anthropic's client tools (run by the client, as any tool) come without a schema,
    which Anthropic knows: tokenway gives the template the same, so the model's call has
    the input the client expects."""
    forced = {"type": "tool", "name": tool["name"]}
    done = await claude.messages.create(model=stack.model, max_tokens=300, messages=HELLO,
                                        tools=[tool], tool_choice=forced)  # type: ignore[list-item]  # fmt: skip
    (call,) = [b for b in done.content if b.type == "tool_use"]
    assert call.name == tool["name"] and wants <= set(call.input), call.input
    assert isinstance(call.input["command"], str)
    counted = await claude.messages.count_tokens(model=stack.model, messages=HELLO,
                                                 tools=[tool])  # type: ignore[list-item]  # fmt: skip
    bare = await claude.messages.count_tokens(model=stack.model, messages=HELLO)
    assert counted.input_tokens > bare.input_tokens


def _after_a_call(result: dict[str, object]) -> list[dict[str, object]]:
    """A conversation whose last turn is a tool_result, as Claude Code sends one back."""
    call = {"type": "tool_use", "id": "toolu_01", "name": "get_weather",
            "input": {"city": "Paris", "days": 1}}  # fmt: skip
    return [*HELLO, {"role": "assistant", "content": [call]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                          **result}]}]  # fmt: skip


async def test_a_tool_result_of_text_blocks_is_their_lines(
    claude: anthropic.AsyncAnthropic, stack: Stack
) -> None:
    """Claude Code sends a tool's output as text blocks: the tool message is their text, a
    block a line (as vLLM's route joins them), not the blocks run together."""
    blocks = [{"type": "text", "text": "Sunny"}, {"type": "text", "text": "21C"}]
    as_blocks = await claude.messages.count_tokens(
        model=stack.model, tools=[WEATHER], messages=_after_a_call({"content": blocks})
    )
    as_lines = await claude.messages.count_tokens(
        model=stack.model, tools=[WEATHER], messages=_after_a_call({"content": "Sunny\n21C"})
    )
    assert as_blocks.input_tokens == as_lines.input_tokens
    done = await claude.messages.create(model=stack.model, max_tokens=10, tools=[WEATHER],
                                        messages=_after_a_call({"content": blocks}))  # fmt: skip
    assert done.content


async def test_a_failed_tool_call_reaches_the_model_as_a_failure(
    claude: anthropic.AsyncAnthropic, stack: Stack
) -> None:
    """`is_error: true` is a line the template shows: the tool message reads `Error: ...`,
    so the model knows its call failed rather than that the tool said so."""
    said = "city not found"
    failed = await claude.messages.count_tokens(model=stack.model, tools=[WEATHER],
        messages=_after_a_call({"content": said, "is_error": True}))  # fmt: skip
    marked = await claude.messages.count_tokens(model=stack.model, tools=[WEATHER],
        messages=_after_a_call({"content": f"Error: {said}"}))  # fmt: skip
    plain = await claude.messages.count_tokens(model=stack.model, tools=[WEATHER],
        messages=_after_a_call({"content": said, "is_error": False}))  # fmt: skip
    assert failed.input_tokens == marked.input_tokens > plain.input_tokens


async def test_cache_control_is_taken_and_usage_says_what_was_cached(
    claude: anthropic.AsyncAnthropic, stack: Stack
) -> None:
    """Claude Code marks its system, tools and last turn with `cache_control`: a hint here
    (the engine caches prefixes by itself), and `usage` carries Anthropic's cache fields:
    the same request again reads its prompt's blocks from the engine's prefix cache, none
    counted as written (`input_tokens`: the rest of the prompt)."""
    ephemeral = {"type": "ephemeral"}
    ask = {
        "model": stack.model, "max_tokens": 16, "extra_headers": CLAUDE_CODE_BETAS,
        "system": [{"type": "text", "text": "You are a coding agent."},
                   {"type": "text", "text": "Be brief.", "cache_control": ephemeral}],
        "tools": [{**WEATHER, "cache_control": ephemeral}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Describe a city.", "cache_control": ephemeral}]}],
    }  # fmt: skip
    done = await claude.messages.create(**ask)  # type: ignore[arg-type]
    async with claude.messages.stream(**ask) as stream:  # type: ignore[arg-type]
        started = [e.message.usage async for e in stream if e.type == "message_start"]
    prompt = done.usage.input_tokens + (done.usage.cache_read_input_tokens or 0)
    (again,) = started
    assert (again.cache_read_input_tokens or 0) > (done.usage.cache_read_input_tokens or 0)
    for usage in (done.usage, again):
        assert usage.cache_creation_input_tokens == 0 and usage.input_tokens > 0
        assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == prompt


async def test_redacted_thinking_sent_back_is_taken_and_left_out(
    claude: anthropic.AsyncAnthropic, stack: Stack
) -> None:
    """A `redacted_thinking` block's data is opaque: a client may send it back with the
    turn it came in, and the prompt is the turn without it."""
    turn = [{"type": "thinking", "thinking": "Paris is a city.", "signature": ""},
            {"type": "text", "text": "Paris."}]  # fmt: skip
    redacted = [turn[0], {"type": "redacted_thinking", "data": "EmwKAhgBEgy3"}, turn[1]]
    counts = [
        (await claude.messages.count_tokens(model=stack.model, messages=[
            *HELLO, {"role": "assistant", "content": content},
            {"role": "user", "content": "And another?"}])).input_tokens  # type: ignore[misc]
        for content in (turn, redacted)
    ]  # fmt: skip
    assert counts[0] == counts[1] > 0


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}
DOCUMENT = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                           "data": "JVBE"}, "title": "spec.pdf"}  # fmt: skip


@pytest.mark.parametrize("block", [IMAGE, DOCUMENT], ids=["image", "document"])
async def test_an_image_or_document_is_refused_by_name_where_it_stands(
    claude: anthropic.AsyncAnthropic, stack: Stack, block: dict[str, object]
) -> None:
    """Images and documents need a multimodal render (not yet): a 400 in Anthropic's shape
    that names the block and where it is, in a tool's result or in the user's turn."""
    text = {"type": "text", "text": "Here it is."}
    for messages, where in (
        (_after_a_call({"content": [text, block]}), "messages[2].content[0].content[1]"),
        ([{"role": "user", "content": [text, block]}], "messages[0].content[1]"),
    ):
        with pytest.raises(anthropic.BadRequestError) as bad:
            await claude.messages.create(model=stack.model, max_tokens=10, tools=[WEATHER],
                                         messages=messages)  # type: ignore[arg-type]  # fmt: skip
        assert bad.value.body["error"]["type"] == "invalid_request_error"
        message = bad.value.body["error"]["message"]
        assert message.startswith(f"{where}: ") and repr(block["type"]) in message, message
        assert "text only" in message, message


async def test_a_stop_sequence_ends_the_message_and_is_named(
    claude: anthropic.AsyncAnthropic, stack: Stack
) -> None:
    free = await claude.messages.create(model=stack.model, max_tokens=40, messages=HELLO)
    text = free.content[0].text
    word = text.split()[2]  # a word the greedy answer says, not at its very start
    done = await claude.messages.create(model=stack.model, max_tokens=40, messages=HELLO,
                                        stop_sequences=[word])  # fmt: skip
    assert done.stop_reason == "stop_sequence" and done.stop_sequence == word
    assert done.content[0].text == text[: text.index(word)]


async def test_errors_come_in_anthropics_shape(
    claude: anthropic.AsyncAnthropic, stack: Stack
) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        await claude.messages.create(model=stack.model, max_tokens=10,
                                     messages=[{"role": "user", "content": [
                                         {"type": "image", "source": {}}]}])  # fmt: skip
    assert bad.value.body["type"] == "error"
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        await claude.messages.create(model="no-such-model", max_tokens=10, messages=HELLO)
    assert missing.value.body["error"]["type"] == "not_found_error"
    async with httpx.AsyncClient(base_url=stack.url) as http:
        no_max = await http.post("/v1/messages", json={"model": stack.model, "messages": HELLO})
    assert no_max.status_code == 400 and no_max.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as schemaless:
        await claude.messages.create(model=stack.model, max_tokens=10, messages=HELLO,
                                     tools=[{"name": "look"}])  # type: ignore[typeddict-item]  # fmt: skip
    assert "tools[0].input_schema" in schemaless.value.body["error"]["message"]


async def test_a_key_is_taken_from_x_api_key(stack: Stack, tmp_path: Path) -> None:
    key = "sk-anthropic-0123456789abcdef"
    settings = make_settings(tmp_path, api_key=key)
    keyed = await start_stack(stack.settings.nats, settings, ["ingress"])
    try:
        async with anthropic.AsyncAnthropic(base_url=keyed.url, api_key=key,
                                            max_retries=0) as ok:  # fmt: skip
            done = await ok.messages.create(model=stack.model, max_tokens=4, messages=HELLO)
        assert done.content
        async with anthropic.AsyncAnthropic(base_url=keyed.url, api_key="sk-wrong",
                                            max_retries=0) as wrong:  # fmt: skip
            with pytest.raises(anthropic.AuthenticationError) as refused:
                await wrong.messages.create(model=stack.model, max_tokens=4, messages=HELLO)
        assert refused.value.body["error"]["type"] == "authentication_error"
    finally:
        await keyed.close()


async def test_claude_codes_billing_header_block_leaves_the_prompt_as_it_was(
    claude: anthropic.AsyncAnthropic, stack: Stack
) -> None:
    """Claude Code leads its system prompt with a block `x-anthropic-billing-header: …;
    cch=<a hash of this request>;`: in the prompt it would make every request's prefix its
    own, so no turn would ever hit the prefix cache (vLLM's route drops it too)."""
    system = [{"type": "text", "text": "You are terse."}]
    billed = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.0.abc; "
               "cc_entrypoint=sdk-cli; cch=0f3a9;"}, *system]  # fmt: skip
    counts = [await claude.messages.count_tokens(model=stack.model, system=s, messages=HELLO)
              for s in (system, billed)]  # type: ignore[arg-type]  # fmt: skip
    assert counts[0].input_tokens == counts[1].input_tokens, counts
    inline = [{"role": "system", "content": billed[:1]}, *HELLO]
    alone = await claude.messages.count_tokens(model=stack.model, messages=HELLO)
    with_inline = await claude.messages.count_tokens(model=stack.model, messages=inline)  # type: ignore[arg-type]
    assert with_inline.input_tokens == alone.input_tokens
