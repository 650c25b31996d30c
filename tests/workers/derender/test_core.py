"""Derender's pure core: token deltas + state → OpenAI documents, streaming or not."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer

from tests.workers.derender.texts import (
    EOS,
    PROPERTY,
    chunkings,
    encode,
    prompts,
    segments,
    split,
)
from tokenway.errors import InvalidRequest
from tokenway.wire import (
    SEED_TOKENS,
    Api,
    Derendered,
    DerenderEntry,
    FinishReason,
    LogprobEntry,
    OutputContext,
    ParseContext,
)
from workers.derender import state as states
from workers.derender.core import derender, derender_call
from workers.derender.detok import Detokenizer
from workers.derender.state import MAX_WINDOW_TOKENS, DetokState, StreamState

EOS_TEXT = "<｜end▁of▁sentence｜>"
PROMPT = [0, 128803, 6366, 128804, 128822]  # BOS <｜User｜>hi<｜Assistant｜></think>


def context(api: Api = "chat", prompt: list[int] = PROMPT, **fields: Any) -> OutputContext:
    prefix = "chatcmpl" if api == "chat" else "cmpl"
    return OutputContext(
        api=api,
        response_id=f"{prefix}-r1",
        model="deepseek-v4",
        created=1,
        prompt_tokens=len(prompt),
        prompt_tail=prompt[-SEED_TOKENS:],
        **fields,
    )


def stream(
    detok: Detokenizer,
    ctx: OutputContext,
    chunks: list[list[int]],
    finish: FinishReason = "length",
    stop_reason: int | str | None = None,
    prompt_ids: list[int] | None = None,
) -> tuple[list[dict[str, Any]], StreamState]:
    """Derender chunk after chunk, threading the state; the finish comes with the last."""
    assert ctx.stream
    docs: list[dict[str, Any]] = []
    state = None
    for i, chunk in enumerate(chunks or [[]]):
        last = i == max(len(chunks), 1) - 1
        entry = DerenderEntry(
            context=ctx,
            state=state,
            token_ids=chunk,
            finish_reason=finish if last else None,
            stop_reason=stop_reason if last else None,
            prompt_token_ids=prompt_ids if state is None else None,
        )
        result = derender(detok, entry)
        assert isinstance(result, Derendered) and result.state is not None
        docs += [json.loads(doc) for doc in result.chunks]
        state = result.state
    assert state is not None
    return docs, msgspec.msgpack.decode(state, type=StreamState)


def whole(
    detok: Detokenizer,
    ctx: OutputContext,
    ids: list[int],
    finish: FinishReason = "length",
    stop_reason: int | str | None = None,
    prompt_ids: list[int] | None = None,
) -> dict[str, Any]:
    assert not ctx.stream
    entry = DerenderEntry(
        context=ctx,
        token_ids=ids,
        finish_reason=finish,
        stop_reason=stop_reason,
        prompt_token_ids=prompt_ids,
    )
    result = derender(detok, entry)
    assert len(result.chunks) == 1
    return json.loads(result.chunks[0])


def content_of(doc: dict[str, Any]) -> str:
    choice = doc["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def streamed_text(docs: list[dict[str, Any]]) -> str:
    out = []
    for doc in docs:
        for choice in doc["choices"]:
            if "delta" in choice:
                out.append(choice["delta"].get("content") or "")
            else:
                out.append(choice["text"])
    return "".join(out)


def as_stream(ctx: OutputContext) -> OutputContext:
    return OutputContext(**{**{f: getattr(ctx, f) for f in ctx.__struct_fields__}, "stream": True})


@PROPERTY
@given(
    api=st.sampled_from(["chat", "completion"]),
    prompt=prompts,
    parts=segments,
    sizes=chunkings,
    ending=st.sampled_from(["eos", "stop_token", "length"]),
    skip=st.booleans(),
    include_stop=st.booleans(),
)
def test_streaming_over_any_chunking_assembles_the_non_streaming_content(
    detok: Detokenizer,
    tokenizer: Tokenizer,
    api: Api,
    prompt: str,
    parts: list[str | int],
    sizes: list[int],
    ending: str,
    skip: bool,
    include_stop: bool,
) -> None:
    prompt_ids = encode(tokenizer, [prompt]) or [0]
    ids = encode(tokenizer, parts)
    finish: FinishReason = "length"
    stop_reason: int | None = None
    if ending == "eos":
        ids, finish = [*ids, EOS], "stop"
    elif ending == "stop_token":
        stop_reason = encode(tokenizer, ["!"])[0]
        ids, finish = [*ids, stop_reason], "stop"
    ctx = context(
        api, prompt_ids, skip_special_tokens=skip, include_stop_str_in_output=include_stop
    )
    response = whole(detok, ctx, ids, finish, stop_reason)
    docs, _ = stream(detok, as_stream(ctx), split(ids, sizes), finish, stop_reason)

    assert streamed_text(docs) == content_of(response)
    visible = ids[:-1] if finish == "stop" and not include_stop else ids
    before = tokenizer.decode(prompt_ids, skip_special_tokens=skip)
    full = tokenizer.decode(prompt_ids + visible, skip_special_tokens=skip)
    assert content_of(response) == full[len(before) :]
    assert response["usage"]["completion_tokens"] == len(ids)
    finishes = [c["finish_reason"] for d in docs for c in d["choices"]]
    assert finishes[-1] == finish == response["choices"][0]["finish_reason"]
    assert all(f is None for f in finishes[:-1])
    assert docs[-1]["choices"][0]["stop_reason"] == stop_reason


def test_the_first_chat_chunk_carries_the_assistant_role_once(
    detok: Detokenizer, tokenizer: Tokenizer
) -> None:
    ids = encode(tokenizer, ["Hello, ", "世界", "!"])
    docs, state = stream(detok, context(stream=True), [[i] for i in ids])
    roles = [d["choices"][0]["delta"].get("role") for d in docs]
    assert roles[0] == "assistant"
    assert roles[1:] == [None] * (len(roles) - 1)
    assert state.role_sent
    assert all(d["object"] == "chat.completion.chunk" and d["id"] == "chatcmpl-r1" for d in docs)


def test_the_role_chunk_goes_out_even_before_any_text_is_visible(
    detok: Detokenizer, tokenizer: Tokenizer
) -> None:
    partial = encode(tokenizer, ["👩"])[:1]  # the first byte of a four-byte character
    result = derender(detok, DerenderEntry(context=context(stream=True), token_ids=partial))
    [doc] = [json.loads(c) for c in result.chunks]
    assert doc["choices"][0]["delta"] == {"role": "assistant", "content": ""}


# vLLM's role chunk (0.32 and 0.33 alike): every field it sets, nulls too; no stop_reason or
# token_ids on its choice, the prompt's ids (with return_token_ids) on it alone.
ROLE_CHOICE = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
               "finish_reason": None}  # fmt: skip


def role_chunk(prompt_ids: list[int] | None = None, **fields: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-r1", "object": "chat.completion.chunk", "created": 1,
            "model": "deepseek-v4", "choices": [ROLE_CHOICE], **fields,
            "prompt_token_ids": prompt_ids, "prompt_text": None}  # fmt: skip


def test_a_chat_stream_opens_with_vllms_role_chunk_then_the_content(
    detok: Detokenizer, tokenizer: Tokenizer
) -> None:
    ids = encode(tokenizer, ["Hello", ", world"])
    docs, _ = stream(detok, context(stream=True), [[i] for i in ids])
    assert docs[0] == role_chunk()
    assert list(docs[0]) == list(role_chunk())  # vLLM's order of fields, too
    assert all(list(d["choices"][0]["delta"]) == ["content"] for d in docs[1:])
    assert streamed_text(docs) == "Hello, world"
    assert all("prompt_token_ids" not in d for d in docs[1:])


def test_the_role_chunk_carries_the_prompt_ids_and_no_token_ids_or_logprobs(
    detok: Detokenizer, tokenizer: Tokenizer
) -> None:
    ids = encode(tokenizer, ["Hi", " there"])
    entries = [LogprobEntry(token_id=i, logprob=-0.5) for i in ids]
    ctx = context(stream=True, return_token_ids=True, logprobs=0)
    first = derender(detok, DerenderEntry(context=ctx, token_ids=ids[:1], logprobs=entries[:1],
                                          prompt_token_ids=PROMPT))  # fmt: skip
    role, content = [json.loads(c) for c in first.chunks]
    assert role == role_chunk(PROMPT)
    assert content["choices"][0]["token_ids"] == ids[:1]
    assert content["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.5
    assert "prompt_token_ids" not in content and "role" not in content["choices"][0]["delta"]


def test_with_continuous_usage_the_role_chunk_counts_no_output_yet(
    detok: Detokenizer, tokenizer: Tokenizer
) -> None:
    ctx = context(stream=True, include_usage=True, continuous_usage_stats=True)
    docs, _ = stream(detok, ctx, [encode(tokenizer, ["Hi"])])
    usage = {"prompt_tokens": len(PROMPT), "completion_tokens": 0, "total_tokens": len(PROMPT)}
    assert docs[0] == role_chunk(usage=usage)


def test_each_choice_opens_with_its_own_role_chunk(
    detok: Detokenizer, tokenizer: Tokenizer
) -> None:
    """n > 1, and a prompt's choices numbered from its `index_base` (multi-prompt)."""
    ctx = context(stream=True, n=2, index_base=4)
    ids = encode(tokenizer, ["Hi"])
    for index in (0, 1):
        result = derender(detok, DerenderEntry(context=ctx, token_ids=ids, index=index))
        role, content = [json.loads(c) for c in result.chunks]
        assert role["choices"] == [{**ROLE_CHOICE, "index": 4 + index}]
        assert content["choices"][0]["index"] == 4 + index


def test_the_first_reasoning_goes_out_after_the_role_chunk_as_vllm_sends_it(
    detok: Detokenizer, tokenizer: Tokenizer
) -> None:
    parse = ParseContext(reasoning_parser="deepseek_v3", reasoning_start="open")
    docs, _ = stream(detok, context(stream=True, parse=parse), [encode(tokenizer, ["Hmm"])])
    assert docs[0] == role_chunk()
    assert docs[1]["choices"][0]["delta"] == {"reasoning": "Hmm"}


def test_stop_reason_is_on_the_last_chunk_alone(detok: Detokenizer, tokenizer: Tokenizer) -> None:
    """vLLM sets it on a choice's finishing chunk only (null when nothing stopped it)."""
    ids = encode(tokenizer, ["One", " two", " three"])
    docs, _ = stream(detok, context(stream=True), [[i] for i in ids], "length")
    assert ["stop_reason" in d["choices"][0] for d in docs] == [False] * len(ids) + [True]
    assert docs[-1]["choices"][0]["stop_reason"] is None


def test_a_completion_chunk_without_visible_text_is_not_sent(
    detok: Detokenizer, tokenizer: Tokenizer
) -> None:
    partial = encode(tokenizer, ["👩"])[:1]
    ctx = context("completion", stream=True)
    result = derender(detok, DerenderEntry(context=ctx, token_ids=partial))
    assert result.chunks == []
    assert result.state is not None
    assert msgspec.msgpack.decode(result.state, type=StreamState).completion_tokens == 1


@pytest.mark.parametrize("api", ["chat", "completion"])
def test_eos_is_not_in_the_text_but_counts_in_usage(
    detok: Detokenizer, tokenizer: Tokenizer, api: Api
) -> None:
    ids = [*encode(tokenizer, ["Hello"]), EOS]
    ctx = context(api, skip_special_tokens=False, include_usage=True)
    response = whole(detok, ctx, ids, "stop")
    assert content_of(response) == "Hello"
    assert response["choices"][0]["finish_reason"] == "stop"
    assert response["choices"][0]["stop_reason"] is None
    assert response["usage"] == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": len(ids),
        "total_tokens": len(PROMPT) + len(ids),
    }
    docs, state = stream(detok, as_stream(ctx), [[i] for i in ids], "stop")
    assert streamed_text(docs) == "Hello"
    assert docs[-1]["usage"]["completion_tokens"] == len(ids) == state.completion_tokens


def test_a_stop_token_id_is_excluded_from_the_text_but_counted(
    detok: Detokenizer, tokenizer: Tokenizer
) -> None:
    stop = encode(tokenizer, ["!"])[0]
    ids = [*encode(tokenizer, ["Hello"]), stop]
    response = whole(detok, context(), ids, "stop", stop)
    assert content_of(response) == "Hello"
    assert response["choices"][0]["stop_reason"] == stop
    assert response["usage"]["completion_tokens"] == len(ids)


def test_include_stop_str_in_output_keeps_the_stop_token(
    detok: Detokenizer, tokenizer: Tokenizer
) -> None:
    stop = encode(tokenizer, ["!"])[0]
    ids = [*encode(tokenizer, ["Hello"]), stop]
    ctx = context(include_stop_str_in_output=True, skip_special_tokens=False)
    assert content_of(whole(detok, ctx, ids, "stop", stop)) == "Hello!"
    eos_ids = [*encode(tokenizer, ["Hello"]), EOS]
    assert content_of(whole(detok, ctx, eos_ids, "stop")) == "Hello" + EOS_TEXT


def test_a_stop_string_reason_keeps_the_last_token(
    detok: Detokenizer, tokenizer: Tokenizer
) -> None:
    ids = encode(tokenizer, ["Hello!"])
    assert content_of(whole(detok, context(), ids, "stop", "!")) == "Hello!"


def test_a_length_finish_keeps_every_token(detok: Detokenizer, tokenizer: Tokenizer) -> None:
    ids = encode(tokenizer, ["Hello!"])
    response = whole(detok, context(), ids, "length")
    assert content_of(response) == "Hello!"
    assert response["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("api", ["chat", "completion"])
def test_include_usage_adds_a_final_chunk_with_empty_choices_and_the_usage(
    detok: Detokenizer, tokenizer: Tokenizer, api: Api
) -> None:
    ids = [*encode(tokenizer, ["One, two, three."]), EOS]
    docs, _ = stream(detok, context(api, stream=True, include_usage=True), split(ids, [2]), "stop")
    assert docs[-1]["choices"] == []
    assert docs[-1]["usage"] == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": len(ids),
        "total_tokens": len(PROMPT) + len(ids),
    }
    assert all(d.get("usage") is None for d in docs[:-1])
    assert streamed_text(docs) == "One, two, three."


def test_without_include_usage_no_usage_is_sent(detok: Detokenizer, tokenizer: Tokenizer) -> None:
    ids = [*encode(tokenizer, ["One, two."]), EOS]
    docs, _ = stream(detok, context(stream=True), split(ids, [2]), "stop")
    assert all(d.get("usage") is None and d["choices"] for d in docs)


def test_continuous_usage_stats_puts_the_running_usage_on_every_chunk(
    detok: Detokenizer, tokenizer: Tokenizer
) -> None:
    ids = [*encode(tokenizer, ["One, two, three, four."]), EOS]
    ctx = context(stream=True, include_usage=True, continuous_usage_stats=True)
    chunks = split(ids, [3])
    docs, _ = stream(detok, ctx, chunks, "stop")
    assert len(docs) == 1 + len(chunks) + 1  # the role chunk, the output, the usage
    assert docs[0]["usage"]["completion_tokens"] == 0
    running = [len(c) for c in chunks]
    for i, doc in enumerate(docs[1:-1]):
        assert doc["usage"]["completion_tokens"] == sum(running[: i + 1])
        assert doc["usage"]["total_tokens"] == len(PROMPT) + sum(running[: i + 1])
    assert docs[-1]["choices"] == [] and docs[-1]["usage"]["completion_tokens"] == len(ids)


def test_return_token_ids_puts_each_chunks_token_ids_on_it(
    detok: Detokenizer, tokenizer: Tokenizer
) -> None:
    # The emoji's first byte shows no text yet; its chunk is still sent, for its ids.
    ids = [*encode(tokenizer, ["Hi 👩", "!"]), EOS]
    chunks = [[i] for i in ids]
    ctx = context("completion", stream=True, return_token_ids=True)
    docs, _ = stream(detok, ctx, chunks, "stop", prompt_ids=PROMPT)
    assert [d["choices"][0]["token_ids"] for d in docs] == chunks
    assert docs[0]["choices"][0]["prompt_token_ids"] == PROMPT
    assert all(d["choices"][0]["prompt_token_ids"] is None for d in docs[1:])
    plain, _ = stream(detok, context("completion", stream=True), chunks, "stop")
    assert all(d["choices"][0]["token_ids"] is None for d in plain)
    ctx = context("completion", return_token_ids=True)
    response = whole(detok, ctx, ids, "stop", prompt_ids=PROMPT)
    assert response["choices"][0]["token_ids"] == ids
    assert response["choices"][0]["prompt_token_ids"] == PROMPT


def test_non_streaming_documents_have_the_openai_shape(
    detok: Detokenizer, tokenizer: Tokenizer
) -> None:
    ids = encode(tokenizer, ["Hello"])
    chat = whole(detok, context(), ids)
    assert chat["object"] == "chat.completion"
    assert (chat["id"], chat["model"], chat["created"]) == ("chatcmpl-r1", "deepseek-v4", 1)
    assert chat["choices"][0]["message"]["role"] == "assistant"
    completion = whole(detok, context("completion"), ids)
    assert completion["object"] == "text_completion" and completion["id"] == "cmpl-r1"


def test_completions_echo_text_is_prepended_in_non_stream(
    detok: Detokenizer, tokenizer: Tokenizer
) -> None:
    ids = encode(tokenizer, [" world"])
    prompt = encode(tokenizer, ["Hello"])
    ctx = context("completion", prompt=prompt, echo=True)
    response = whole(detok, ctx, ids, prompt_ids=prompt)
    assert content_of(response) == "Hello world"


def test_completions_echo_text_is_streamed_first(detok: Detokenizer, tokenizer: Tokenizer) -> None:
    ids = encode(tokenizer, [" world"])
    prompt = encode(tokenizer, ["Hello"])
    ctx = context("completion", prompt=prompt, echo=True)
    docs, _ = stream(detok, as_stream(ctx), [[i] for i in ids], prompt_ids=prompt)
    whole_text = content_of(whole(detok, ctx, ids, prompt_ids=prompt))
    assert streamed_text(docs) == whole_text == "Hello world"


def test_echo_or_token_ids_without_the_prompt_on_the_first_chunk_is_invalid(
    detok: Detokenizer, tokenizer: Tokenizer
) -> None:
    for flags in ({"echo": True}, {"return_token_ids": True}):
        with pytest.raises(InvalidRequest, match="prompt_token_ids"):
            whole(detok, context("completion", **flags), encode(tokenizer, ["x"]))


def test_a_finished_state_fed_again_is_invalid_request(
    detok: Detokenizer, tokenizer: Tokenizer
) -> None:
    ctx = context(stream=True)
    _, state = stream(detok, ctx, [encode(tokenizer, ["Hi"])], "length")
    assert state.finished
    with pytest.raises(InvalidRequest, match="finished"):
        derender(detok, DerenderEntry(context=ctx, state=states.encode(state), token_ids=[6366]))


def test_a_non_stream_entry_without_finish_is_invalid_request(
    detok: Detokenizer, tokenizer: Tokenizer
) -> None:
    entry = DerenderEntry(context=context(), token_ids=encode(tokenizer, ["Hi"]))
    with pytest.raises(InvalidRequest, match="finish"):
        derender(detok, entry)


@pytest.mark.parametrize("stream_", [True, False])
def test_a_token_id_outside_the_vocabulary_is_invalid_request(
    detok: Detokenizer, stream_: bool
) -> None:
    entry = DerenderEntry(
        context=context(stream=stream_), token_ids=[6366, 10**6], finish_reason="length"
    )
    with pytest.raises(InvalidRequest) as info:
        derender(detok, entry)
    assert info.value.param == "token_ids" and info.value.status == 400
    assert "1000000" in info.value.message


def test_a_state_window_over_the_limit_is_invalid_request(detok: Detokenizer) -> None:
    big = MAX_WINDOW_TOKENS + 1
    state = states.encode(
        StreamState(detok=DetokState(tokens=[6366] * big, prefix_offset=0, read_offset=big))
    )
    with pytest.raises(InvalidRequest, match=str(big)):
        derender(detok, DerenderEntry(context=context(stream=True), state=state, token_ids=[6366]))


def test_a_long_run_of_skipped_eos_tokens_does_not_fail_the_stream(
    detok: Detokenizer, tokenizer: Tokenizer
) -> None:
    ids = [*encode(tokenizer, ["Hi"]), *[EOS] * (MAX_WINDOW_TOKENS + 88), 6366]
    docs, state = stream(detok, context(stream=True), [[i] for i in ids], "length")
    assert streamed_text(docs) == "Hihi"
    assert state.completion_tokens == len(ids)


@pytest.mark.parametrize(
    "window",
    [
        DetokState(tokens=[-1], prefix_offset=0, read_offset=1),
        DetokState(tokens=[6366, 223], prefix_offset=5, read_offset=9),
        DetokState(tokens=[6366, 223], prefix_offset=2, read_offset=1),
    ],
    ids=["negative-token", "offsets-past-window", "prefix-after-read"],
)
def test_an_out_of_bounds_stream_state_is_invalid_request(
    detok: Detokenizer, window: DetokState
) -> None:
    entry = DerenderEntry(
        context=context(stream=True),
        state=states.encode(StreamState(detok=window)),
        token_ids=[6366],
    )
    with pytest.raises(InvalidRequest):
        derender(detok, entry)


def test_two_responses_sharing_a_client_chosen_id_keep_their_own_choices(
    detok: Detokenizer, tokenizer: Tokenizer
) -> None:
    """A response's id is the client's to choose (its X-Request-Id): two requests of n = 2
    that share one, whole in one call (an owner's round), are each answered with their own
    two choices, not one with four and the other with none."""
    ctx = context(n=2)
    texts = [["Alpha"], ["Beta"], ["Gamma"], ["Delta"]]  # two requests, two choices each
    entries = [DerenderEntry(context=ctx, token_ids=encode(tokenizer, text), index=i % 2,
                             finish_reason="length") for i, text in enumerate(texts)]  # fmt: skip
    results = derender_call(detok, entries)
    answered = [[c["message"]["content"] for c in json.loads(r.chunks[0])["choices"]]
                for r in results if r.chunks]  # fmt: skip
    assert answered == [["Alpha", "Beta"], ["Gamma", "Delta"]]
    assert [bool(r.chunks) for r in results] == [True, False, True, False]
