"""End to end through the openai SDK: `tokenway up`'s stages against a real nats-server."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.conftest import Stack

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHAT = [{"role": "user", "content": "Tell me about token streams."}]


@pytest.fixture
def client(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)


async def test_chat_non_stream_returns_text_and_usage(client: openai.AsyncOpenAI) -> None:
    resp = await client.chat.completions.create(model="deepseek-v4", messages=CHAT, max_tokens=12)
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens <= 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.id.startswith("chatcmpl-")


async def test_chat_stream_assembles_to_the_non_stream_text(client: openai.AsyncOpenAI) -> None:
    kwargs = dict(model="deepseek-v4", messages=CHAT, max_tokens=30, seed=7)
    full = await client.chat.completions.create(**kwargs)
    stream = await client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    parts, usage, finish = [], None, None
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(parts) == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


async def test_completion_non_stream_and_stream_agree(client: openai.AsyncOpenAI) -> None:
    kwargs = dict(model="deepseek-v4", prompt="Once upon a time", max_tokens=25, seed=3)
    full = await client.completions.create(**kwargs)
    text = ""
    async for chunk in await client.completions.create(**kwargs, stream=True):
        text += "".join(c.text for c in chunk.choices)
    assert text == full.choices[0].text
    assert full.object == "text_completion"
    assert full.usage.completion_tokens <= 25


async def test_max_tokens_ends_with_length(client: openai.AsyncOpenAI) -> None:
    resp = await client.completions.create(
        model="deepseek-v4", prompt="x", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 5


async def raw_stream(stack: Stack, headers: dict[str, str] | None = None) -> str:
    body = {"messages": CHAT, "max_tokens": 8, "stream": True, "seed": 3,
            "stream_options": {"include_usage": True}}  # fmt: skip
    async with httpx.AsyncClient() as http:
        async with http.stream(
            "POST", f"{stack.url}/v1/chat/completions", json=body, headers=headers
        ) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            return b"".join([part async for part in resp.aiter_bytes()]).decode()


async def test_sse_is_framed_as_vllm_frames_it_data_events_then_one_done(stack: Stack) -> None:
    raw = await raw_stream(stack)
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and raw.count("data: [DONE]") == 1
    assert all(e.startswith("data: {") and "\n" not in e for e in events[:-2])  # nothing else
    docs = [json.loads(e[len("data: ") :]) for e in events[:-2]]
    assert docs[0]["choices"][0]["delta"]["role"] == "assistant"
    assert docs[-1]["choices"] == [] and docs[-1]["usage"]["completion_tokens"] <= 8


async def test_a_chat_stream_opens_with_a_role_chunk_per_choice_as_vllms(stack: Stack) -> None:
    """vLLM's framing: each choice's first event is the role alone (content "", no output,
    the prompt's ids on it); the output follows in chunks without the role, stop_reason on
    each choice's last chunk only. Resuming counts the role chunks as the events they are."""
    body = {"messages": CHAT, "max_tokens": 3, "stream": True, "seed": 5, "n": 2,
            "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    async with httpx.AsyncClient() as http:
        async with http.stream("POST", f"{stack.url}/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            raw = b"".join([part async for part in resp.aiter_bytes()]).decode()
    docs = [json.loads(e[len("data: ") :]) for e in raw.split("\n\n")[:-2]]
    by_choice: dict[int, list[dict]] = {}
    for doc in docs[:-1]:  # the last: the usage chunk
        [choice] = doc["choices"]
        by_choice.setdefault(choice["index"], []).append(doc)
    assert sorted(by_choice) == [0, 1]
    prompt = docs[0]["usage"]["prompt_tokens"]
    for index, (role, *output) in by_choice.items():
        assert role == {
            "id": role["id"], "object": "chat.completion.chunk", "created": role["created"],
            "model": "deepseek-v4",
            "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt},
            "prompt_token_ids": role["prompt_token_ids"], "prompt_text": None,
        }  # fmt: skip
        assert len(role["prompt_token_ids"]) == prompt
        assert output and all("role" not in d["choices"][0]["delta"] for d in output)
        assert all("prompt_token_ids" not in d for d in output)
        assert ["stop_reason" in d["choices"][0] for d in output] == [False] * (len(output) - 1) + [
            True
        ]
    async with httpx.AsyncClient() as http:  # the same request resumed after the first event
        rid = resp.headers["x-request-id"]
        rest = await http.get(f"{stack.url}/v1/streams/{rid}", headers={"Last-Event-ID": "1"})
    assert rest.text == raw.split("\n\n", 1)[1]


async def test_event_ids_on_request_number_every_data_event(stack: Stack) -> None:
    plain = await raw_stream(stack)
    numbered = await raw_stream(stack, {"X-Tokenway-Event-Ids": "1"})
    events = numbered.split("\n\n")[:-2]
    assert [e.split("\n")[0] for e in events] == [f"id: {n}" for n in range(1, len(events) + 1)]

    def text(docs: list[str]) -> str:
        return "".join(c["delta"].get("content") or "" for d in docs
                       for c in json.loads(d)["choices"])  # fmt: skip

    assert text([e.split("\ndata: ", 1)[1] for e in events]) == text(
        [e[6:] for e in plain.split("\n\n")[:-2]]
    )  # the same seed: the same answer
    assert numbered.endswith("\n\ndata: [DONE]\n\n")
    async with httpx.AsyncClient() as http:
        bad = await http.post(f"{stack.url}/v1/chat/completions", json={"messages": CHAT},
                              headers={"X-Tokenway-Event-Ids": "maybe"})  # fmt: skip
    assert bad.status_code == 400 and "X-Tokenway-Event-Ids" in bad.json()["error"]["message"]


async def test_fifty_concurrent_streams_complete_once_with_matching_usage(stack: Stack) -> None:
    async def one(i: int, http: httpx.AsyncClient) -> None:
        body = {
            "messages": [{"role": "user", "content": f"stream number {i}"}],
            "max_tokens": 40,
            "stream": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
        }
        async with http.stream("POST", f"{stack.url}/v1/chat/completions", json=body) as resp:
            raw = b"".join([part async for part in resp.aiter_bytes()]).decode()
        assert raw.count("data: [DONE]") == 1 and raw.endswith("data: [DONE]\n\n")
        docs = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
        docs += [
            json.loads(e.split("\ndata: ", 1)[1]) for e in raw.split("\n\n") if e.startswith("id: ")
        ]
        tokens = sum(len(c["token_ids"]) for d in docs for c in d["choices"] if c.get("token_ids"))
        usage = next(d["usage"] for d in docs if d.get("usage"))
        assert usage["completion_tokens"] == tokens

    limits = httpx.Limits(max_connections=60)
    async with httpx.AsyncClient(limits=limits, timeout=60) as http:
        await asyncio.gather(*(one(i, http) for i in range(50)))


async def test_streamed_completion_echoes_the_prompt_and_its_ids_once(stack: Stack) -> None:
    body = {"prompt": "Echo me:", "max_tokens": 6, "echo": True, "return_token_ids": True,
            "stream": True}  # fmt: skip
    async with httpx.AsyncClient(timeout=30) as http:
        async with http.stream("POST", f"{stack.url}/v1/completions", json=body) as resp:
            raw = b"".join([part async for part in resp.aiter_bytes()]).decode()
        full = await http.post(f"{stack.url}/v1/completions", json={**body, "stream": False})
    docs = [json.loads(e.split("data: ", 1)[1]) for e in raw.split("\n\n") if "data: {" in e]
    choices = [d["choices"][0] for d in docs]
    assert choices[0]["text"].startswith("Echo me:")
    assert choices[0]["prompt_token_ids"] and all(
        c["prompt_token_ids"] is None for c in choices[1:]
    )
    whole = full.json()["choices"][0]
    assert "".join(c["text"] for c in choices) == whole["text"]
    assert whole["prompt_token_ids"] == choices[0]["prompt_token_ids"]


async def test_stop_string_ends_the_stream_where_it_starts(client: openai.AsyncOpenAI) -> None:
    base = dict(model="deepseek-v4", prompt="Tell a story", max_tokens=60, seed=11)
    free = (await client.completions.create(**base, extra_body={"ignore_eos": True})).choices[0]
    stop = free.text[20:26]  # a stop string the engine will certainly produce
    cut = free.text[: free.text.index(stop)]
    full = await client.completions.create(**base, stop=[stop], extra_body={"ignore_eos": True})
    text = ""
    async for chunk in await client.completions.create(
        **base, stop=[stop], stream=True, extra_body={"ignore_eos": True}
    ):
        text += "".join(c.text for c in chunk.choices)
    assert full.choices[0].text == text == cut
    assert full.choices[0].finish_reason == "stop"
    assert full.usage.completion_tokens < 60


async def test_logprobs_arrive_per_token(client: openai.AsyncOpenAI) -> None:
    resp = await client.chat.completions.create(
        model="deepseek-v4", messages=CHAT, max_tokens=8, logprobs=True, top_logprobs=2
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens  # EOS has its logprob too, as in vLLM
    assert all(len(t.top_logprobs) == 2 for t in content)


async def test_thinking_output_arrives_as_reasoning(client: openai.AsyncOpenAI) -> None:
    """The sim never closes </think>: with thinking on, everything is reasoning."""
    kwargs = dict(model="deepseek-v4", messages=CHAT, max_tokens=10)
    thinking = {"chat_template_kwargs": {"thinking": True}}
    resp = await client.chat.completions.create(**kwargs, extra_body=thinking)
    message = resp.choices[0].message
    assert message.reasoning and not message.content
    plain = (await client.chat.completions.create(**kwargs)).choices[0].message
    assert plain.content and not getattr(plain, "reasoning", None)


async def test_n_choices_stream_and_assemble_like_the_non_stream_response(
    client: openai.AsyncOpenAI,
) -> None:
    kwargs = dict(model="deepseek-v4", messages=CHAT, max_tokens=15, seed=21, n=3)
    full = await client.chat.completions.create(**kwargs)
    assert [c.index for c in full.choices] == [0, 1, 2]
    texts: dict[int, str] = {}
    usage = None
    stream = await client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert [texts[i] for i in range(3)] == [c.message.content for c in full.choices]
    assert len(set(texts.values())) == 3
    assert usage.completion_tokens == full.usage.completion_tokens
    assert full.usage.completion_tokens > 15  # counted across all three choices
