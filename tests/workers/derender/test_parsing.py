"""The derender core with its stages wired: stops, reasoning, tool calls and logprobs, streamed
over any chunking and assembled by a client, equal the non-streaming response."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from tests.workers.derender.texts import split
from tokenway.wire import (
    DerenderEntry,
    LogprobEntry,
    OutputContext,
    ParseContext,
    TokenLogprob,
)
from workers.derender.core import derender
from workers.derender.detok import Detokenizer
from workers.derender.state import StreamState

THINK_OPEN = ParseContext(reasoning_parser="deepseek_v3", reasoning_start="open")
TOOLS = ParseContext(tool_choice="auto", tool_parser="deepseek_v31")
BOTH = ParseContext(
    reasoning_parser="deepseek_v3",
    reasoning_start="open",
    tool_choice="auto",
    tool_parser="deepseek_v31",
)
CALL = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    '{"city": "Zürich", "unit": {"deg": "C"}, "note": "say \\"hi\\""}'
    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
)


def ctx(api: str = "chat", **fields: Any) -> OutputContext:
    return OutputContext(
        api=api, response_id="chatcmpl-r1", model="m", created=1, prompt_tokens=3, **fields
    )


def run(
    detok: Detokenizer,
    context: OutputContext,
    chunks: list[list[int]],
    finish: str = "stop",
    logprobs: list[LogprobEntry] | None = None,
) -> tuple[list[dict[str, Any]], list[Any]]:
    """Derender chunk by chunk as an owner does; returns the docs and each result."""
    docs, results, state, at = [], [], None, 0
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        entry = DerenderEntry(
            context=context,
            state=state,
            token_ids=chunk,
            finish_reason=finish if last else None,  # type: ignore[arg-type]
            logprobs=logprobs[at : at + len(chunk)] if logprobs else None,
        )
        at += len(chunk)
        result = derender(detok, entry)
        docs += [json.loads(d) for d in result.chunks]
        results.append(result)
        state = result.state
        if result.finish_reason is not None:
            break
    return docs, results


def assemble(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """What a client builds from the stream, in the non-stream message's shape."""
    content, reasoning, calls, finish = "", "", {}, None
    for doc in docs:
        for choice in doc["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning") or ""
            for call in delta.get("tool_calls", []):
                slot = calls.setdefault(call["index"], {"arguments": ""})
                if "id" in call:
                    slot["id"], slot["name"] = call["id"], call["function"]["name"]
                slot["arguments"] += call.get("function", {}).get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return {"content": content, "reasoning": reasoning, "calls": calls, "finish": finish}


def whole(detok: Detokenizer, context: OutputContext, ids: list[int]) -> dict[str, Any]:
    stream_off = msgspec.structs.replace(context, stream=False)
    docs, _ = run(detok, stream_off, [ids])
    return docs[0]


def test_reasoning_then_content_streams_and_matches_non_stream(
    detok: Detokenizer, tokenizer: Tokenizer
) -> None:
    text = "Let me think.</think>The answer is 4."
    ids = [*tokenizer.encode(text, add_special_tokens=False).ids, 1]
    context = ctx(stream=True, parse=THINK_OPEN)
    got = assemble(run(detok, context, [[i] for i in ids])[0])
    assert (got["reasoning"], got["content"]) == ("Let me think.", "The answer is 4.")
    message = whole(detok, context, ids)["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("Let me think.", "The answer is 4.")


def test_include_reasoning_false_drops_the_reasoning_only(
    detok: Detokenizer, tokenizer: Tokenizer
) -> None:
    ids = [*tokenizer.encode("hidden</think>shown", add_special_tokens=False).ids, 1]
    parse = msgspec.structs.replace(THINK_OPEN, include_reasoning=False)
    got = assemble(run(detok, ctx(stream=True, parse=parse), split(ids, [2, 1]))[0])
    assert (got["reasoning"], got["content"]) == ("", "shown")


def test_a_tool_call_streams_deltas_that_assemble_to_the_non_stream_call(
    detok: Detokenizer, tokenizer: Tokenizer
) -> None:
    ids = [*tokenizer.encode("Checking." + CALL, add_special_tokens=False).ids, 1]
    context = ctx(stream=True, parse=TOOLS)
    got = assemble(run(detok, context, [[i] for i in ids])[0])
    message = whole(detok, context, ids)["choices"][0]
    call = message["message"]["tool_calls"][0]
    assert got["content"] == message["message"]["content"] == "Checking."
    assert got["finish"] == message["finish_reason"] == "tool_calls"
    streamed = got["calls"][0]
    assert (streamed["id"], streamed["name"]) == (call["id"], call["function"]["name"])
    assert (
        json.loads(streamed["arguments"])
        == json.loads(call["function"]["arguments"])
        == {
            "city": "Zürich",
            "unit": {"deg": "C"},
            "note": 'say "hi"',
        }
    )


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 6), min_size=1, max_size=40))
def test_reasoning_and_tool_calls_survive_any_chunking(
    detok: Detokenizer, tokenizer: Tokenizer, sizes: list[int]
) -> None:
    text = "plan: 天気を調べる 🌦️</think>On it." + CALL
    ids = [*tokenizer.encode(text, add_special_tokens=False).ids, 1]
    context = ctx(stream=True, parse=BOTH)
    got = assemble(run(detok, context, split(ids, sizes))[0])
    one = whole(detok, context, ids)["choices"][0]
    assert got["reasoning"] == one["message"]["reasoning"] == "plan: 天気を調べる 🌦️"
    assert got["content"] == one["message"]["content"] == "On it."
    args = one["message"]["tool_calls"][0]["function"]["arguments"]
    assert json.loads(got["calls"][0]["arguments"]) == json.loads(args)
    assert got["finish"] == one["finish_reason"] == "tool_calls"


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=30))
def test_a_stop_string_split_across_chunks_ends_the_output_there(
    detok: Detokenizer, tokenizer: Tokenizer, sizes: list[int]
) -> None:
    ids = tokenizer.encode("one two THE END three four", add_special_tokens=False).ids
    context = ctx("completion", stream=True, stop=["THE END"])
    docs, results = run(detok, context, split(ids, sizes), finish="length")
    text = "".join(c["text"] for d in docs for c in d["choices"])
    assert text == "one two "
    assert docs[-1]["choices"][0]["finish_reason"] == "stop"
    assert docs[-1]["choices"][0]["stop_reason"] == "THE END"
    ended = results[-1]
    assert ended.finish_reason == "stop" and ended.stop_reason == "THE END"
    chunks = split(ids, sizes)
    last = chunks[len(results) - 1]
    kept = sum(len(c) for c in chunks[: len(results) - 1])
    kept += len(last) if ended.kept is None else ended.kept
    assert tokenizer.decode(ids[:kept]).endswith("THE END")
    assert not tokenizer.decode(ids[: kept - 1]).endswith("THE END")
    usage_state = msgspec.msgpack.decode(ended.state, type=StreamState)
    assert usage_state.completion_tokens == kept


def test_logprobs_come_with_each_chunk_in_both_shapes(
    detok: Detokenizer, tokenizer: Tokenizer
) -> None:
    ids = tokenizer.encode("Hi there", add_special_tokens=False).ids
    entries = [
        LogprobEntry(
            token_id=t,
            logprob=-0.5,
            rank=1,
            top=[
                TokenLogprob(token_id=t, logprob=-0.5, rank=1),
                TokenLogprob(token_id=0, logprob=-2),
            ],
        )
        for t in ids
    ]
    chat_docs, _ = run(detok, ctx(stream=True, logprobs=1), [[i] for i in ids], logprobs=entries)
    content = [
        e for d in chat_docs for c in d["choices"] for e in (c["logprobs"] or {}).get("content", [])
    ]
    assert "".join(e["token"] for e in content) == "Hi there"
    assert all(len(e["top_logprobs"]) == 1 and e["logprob"] == -0.5 for e in content)
    comp_docs, _ = run(
        detok, ctx("completion", stream=True, logprobs=1), [[i] for i in ids], logprobs=entries
    )
    shaped = [c["logprobs"] for d in comp_docs for c in d["choices"] if c["logprobs"]]
    offsets = [o for s in shaped for o in s["text_offset"]]
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert "".join(t for s in shaped for t in s["tokens"]) == "Hi there"


FORCED = ParseContext(tool_choice="named", tool_name="get_weather")
PLAIN_TOOLS = ParseContext(tool_choice="auto", tool_parser="deepseek_v31")


@pytest.mark.parametrize(
    ("parse", "text", "content"),
    [
        (THINK_OPEN, "Still thinking", None),  # all reasoning: no content (vLLM's null)
        (FORCED, '{"city": "Oslo"}', ""),  # a forced call: content "" (vLLM: content or "")
        (PLAIN_TOOLS, CALL, None),  # an auto call without text: null
        (None, "", ""),  # no parser: the text, empty
    ],
    ids=["all-reasoning", "forced-call", "auto-call", "no-parser"],
)
def test_a_whole_message_says_no_content_as_vllm_does(
    detok: Detokenizer, tokenizer: Tokenizer, parse: ParseContext | None, text: str,
    content: str | None,
) -> None:  # fmt: skip
    """As vLLM 0.32/0.33's chat serving builds the message: content is null where a
    reasoning parser took all the output or an auto call has no text, "" under a forced
    tool choice and where nothing parses the (empty) output."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids if text else []
    context = ctx(parse=parse) if parse is not None else ctx()
    docs, _ = run(detok, context, [ids], finish="length")
    assert docs[0]["choices"][0]["message"]["content"] == content
