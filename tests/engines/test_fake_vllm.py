"""The fake vLLM speaks vLLM 0.33's token-in/token-out wire over real HTTP, knobs included."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from tests.fakes.vllm_engine import FakeVllm

pytestmark = pytest.mark.asyncio(loop_scope="session")

GENERATE = "/inference/v1/generate"
ABORT = "/inference/v1/abort_requests"
COMPLETIONS = "/v1/completions"
PROMPT = [11, 12, 13, 14]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def fake() -> AsyncIterator[FakeVllm]:
    async with FakeVllm() as server:
        yield server


@pytest_asyncio.fixture(loop_scope="session")
async def http(fake: FakeVllm) -> AsyncIterator[httpx.AsyncClient]:
    fake.reset()
    async with httpx.AsyncClient(base_url=fake.url, timeout=10, trust_env=False) as client:
        yield client


def body(rid: str, stream: bool = True, usage: bool = True, **params: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "request_id": rid,
        "token_ids": PROMPT,
        "sampling_params": params,
        "stream": stream,
        "output_mode": "tokens",
    }
    if stream and usage:
        doc["stream_options"] = {"include_usage": True}
    return doc


async def sse(
    http: httpx.AsyncClient, doc: dict[str, Any], path: str = GENERATE
) -> tuple[list[Any], str]:
    """The `data:` payloads of a stream (decoded, `[DONE]` kept as a string) and the raw text."""
    resp = await http.post(path, json=doc)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = [
        frame[len("data: ") :] for frame in resp.text.split("\n\n") if frame.startswith("data: ")
    ]
    return [e if e == "[DONE]" else json.loads(e) for e in events], resp.text


async def test_a_stream_is_one_choice_per_event_then_usage_then_done(
    fake: FakeVllm, http: httpx.AsyncClient
) -> None:
    fake.knobs.chunk_size = 3
    events, raw = await sse(http, body("s1", max_tokens=7, ignore_eos=True))
    assert raw.endswith("data: [DONE]\n\n") and events[-1] == "[DONE]"
    *tokens, usage, _ = events
    assert all(e["request_id"] == "generate-tokens-s1" for e in events[:-1])
    assert all(e["output_mode"] == "tokens" and len(e["choices"]) == 1 for e in tokens)
    choices = [e["choices"][0] for e in tokens]
    assert [len(c["token_ids"]) for c in choices] == [3, 3, 1]
    assert [c["finish_reason"] for c in choices] == [None, None, "length"]
    assert all(c["index"] == 0 and c["logprobs"] is None for c in choices)
    ids = [t for c in choices for t in c["token_ids"]]
    assert ids == fake.expected(PROMPT, {"max_tokens": 7, "ignore_eos": True})[0]
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 4, "total_tokens": 11, "completion_tokens": 7}


async def test_without_include_usage_there_is_no_usage_event(http: httpx.AsyncClient) -> None:
    events, _ = await sse(http, body("s2", usage=False, max_tokens=2, ignore_eos=True))
    assert events[-1] == "[DONE]"
    assert all(e["choices"] for e in events[:-1])


async def test_a_whole_response_is_a_generate_tokens_response(
    fake: FakeVllm, http: httpx.AsyncClient
) -> None:
    resp = await http.post(GENERATE, json=body("w1", stream=False, max_tokens=5, ignore_eos=True))
    doc = resp.json()
    assert resp.status_code == 200 and doc["request_id"] == "generate-tokens-w1"
    assert doc["output_mode"] == "tokens" and doc["kv_transfer_params"] is None
    (choice,) = doc["choices"]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 5
    assert choice["token_ids"] == fake.expected(PROMPT, {"max_tokens": 5, "ignore_eos": True})[0]
    assert doc["usage"]["completion_tokens"] == 5 and doc["usage"]["prompt_tokens"] == 4


async def test_eos_and_stop_token_ids_finish_with_stop(
    fake: FakeVllm, http: httpx.AsyncClient
) -> None:
    natural, finish, reason = fake.expected(PROMPT, {"seed": 3})
    assert (finish, reason) == ("stop", None) and natural[-1] == fake.eos_token_id
    events, _ = await sse(http, body("e1", seed=3))
    assert [t for e in events[:-2] for t in e["choices"][0]["token_ids"]] == natural
    stop = natural[2]
    events, _ = await sse(http, body("e2", seed=3, stop_token_ids=[stop]))
    last = events[-3]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop)
    assert fake.requests[-1].outputs[0] == natural[: natural.index(stop) + 1]


async def test_logprobs_carry_integer_token_ids_sampled_first(http: httpx.AsyncClient) -> None:
    events, _ = await sse(http, body("l1", max_tokens=4, ignore_eos=True, logprobs=3))
    for event in events[:-2]:
        choice = event["choices"][0]
        content = choice["logprobs"]["content"]
        assert [c["token_id"] for c in content] == choice["token_ids"]
        for c in content:
            assert isinstance(c["token_id"], int) and "token" not in c
            assert [t["rank"] for t in c["top_logprobs"]] == [1, 2, 3]
            assert c["top_logprobs"][0]["token_id"] == c["token_id"]


async def test_n_choices_stream_with_their_own_index(
    fake: FakeVllm, http: httpx.AsyncClient
) -> None:
    events, _ = await sse(http, body("n1", n=3, max_tokens=4, ignore_eos=True, seed=5))
    got: dict[int, list[int]] = {}
    for e in events[:-2]:
        (c,) = e["choices"]
        got.setdefault(c["index"], []).extend(c["token_ids"])
    params = {"max_tokens": 4, "ignore_eos": True, "seed": 5}
    assert got == {i: fake.expected(PROMPT, params, i)[0] for i in range(3)}
    assert len({tuple(v) for v in got.values()}) == 3
    assert events[-2]["usage"]["completion_tokens"] == 12


async def test_the_x_request_id_header_names_the_request(http: httpx.AsyncClient) -> None:
    doc = body("ignored", stream=False, max_tokens=1)
    resp = await http.post(GENERATE, json=doc, headers={"X-Request-Id": "from-header"})
    assert resp.json()["request_id"] == "generate-tokens-from-header"


async def test_abort_requests_ends_the_stream_with_finish_abort(
    fake: FakeVllm, http: httpx.AsyncClient
) -> None:
    fake.knobs.stall_after = 1
    doc = body("a1", max_tokens=100, ignore_eos=True)
    async with http.stream("POST", GENERATE, json=doc) as resp:
        lines = resp.aiter_lines()
        assert (await anext(lines)).startswith("data: ")
        await fake.wait_until(lambda: fake.running == 1)
        aborted = await http.post(ABORT, json={"request_ids": ["generate-tokens-a1"]})
        assert aborted.status_code == 200 and aborted.content == b""
        rest = [json.loads(x[6:]) if x != "data: [DONE]" else "[DONE]"
                async for x in lines if x]  # fmt: skip
    finish = rest[0]["choices"][0]
    assert (finish["finish_reason"], finish["token_ids"]) == ("abort", [])
    assert rest[1]["usage"]["completion_tokens"] == 1 and rest[-1] == "[DONE]"
    assert fake.aborted == ["generate-tokens-a1"] and fake.running == 0
    assert fake.disconnected == []


async def test_abort_requests_needs_request_ids(http: httpx.AsyncClient) -> None:
    resp = await http.post(ABORT, json={"ids": ["x"]})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "Missing 'request_ids' in request body"


async def test_a_client_that_leaves_is_recorded_and_its_stream_stops(
    fake: FakeVllm, http: httpx.AsyncClient
) -> None:
    fake.knobs.stall_after = 2
    async with http.stream("POST", GENERATE, json=body("d1", ignore_eos=True)) as resp:
        async for line in resp.aiter_lines():
            assert line.startswith("data: ")
            break
    await fake.wait_until(lambda: fake.disconnected == ["generate-tokens-d1"])
    assert fake.running == 0 and fake.aborted == []


async def test_fail_first_n_requests_with_a_5xx(fake: FakeVllm, http: httpx.AsyncClient) -> None:
    fake.knobs.fail_status, fake.knobs.fail_first = 503, 2
    statuses = []
    for i in range(3):
        resp = await http.post(GENERATE, json=body(f"f{i}", stream=False, max_tokens=1))
        statuses.append(resp.status_code)
    assert statuses == [503, 503, 200]
    assert [r.status for r in fake.requests] == [503, 503, 200]
    fake.knobs.fail_first = None  # always
    resp = await http.post(GENERATE, json=body("f10", max_tokens=1))
    assert resp.status_code == 503
    assert resp.json()["error"] == {
        "message": "fake engine failure 3",
        "type": "InternalServerError",
        "param": None,
        "code": 503,
    }


@pytest.mark.parametrize(
    ("status", "key"), [(404, "detail"), (501, "error"), (403, "error")], ids=str
)
async def test_a_missing_token_route_answers_like_vllm(
    fake: FakeVllm, http: httpx.AsyncClient, status: int, key: str
) -> None:
    fake.knobs.capability = status
    resp = await http.post(GENERATE, json=body("c1", max_tokens=1))
    assert resp.status_code == status and key in resp.json()


async def test_die_after_k_events_drops_the_connection_without_a_finish(
    fake: FakeVllm, http: httpx.AsyncClient
) -> None:
    fake.knobs.die_after = 2
    seen = []
    with pytest.raises(httpx.RemoteProtocolError):
        doc = body("k1", max_tokens=50, ignore_eos=True)
        async with http.stream("POST", GENERATE, json=doc) as resp:
            async for line in resp.aiter_lines():
                if line:
                    seen.append(json.loads(line[6:]))
    assert len(seen) == 2 and all(e["choices"][0]["finish_reason"] is None for e in seen)
    await fake.wait_until(lambda: fake.running == 0)


async def test_error_after_k_events_sends_an_error_event_then_done(
    fake: FakeVllm, http: httpx.AsyncClient
) -> None:
    fake.knobs.error_after = 1
    events, _ = await sse(http, body("x1", max_tokens=50, ignore_eos=True))
    assert len(events) == 3 and events[-1] == "[DONE]"
    assert events[1]["error"]["code"] == 500


async def test_ttft_and_itl_shape_the_timing(fake: FakeVllm, http: httpx.AsyncClient) -> None:
    fake.knobs.ttft, fake.knobs.itl = 0.15, 0.05
    started = time.monotonic()
    events, _ = await sse(http, body("t1", max_tokens=3, ignore_eos=True))
    assert time.monotonic() - started >= 0.15 + 2 * 0.05
    assert len(events) == 5


async def test_a_prefill_leg_answers_with_kv_transfer_params(
    fake: FakeVllm, http: httpx.AsyncClient
) -> None:
    doc = body("p1", stream=False, max_tokens=1)
    doc["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    kv = (await http.post(GENERATE, json=doc)).json()["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert kv["remote_engine_id"] == fake.engine_id
    assert kv["remote_request_id"] == "generate-tokens-p1"
    assert len(kv["remote_block_ids"]) == 1  # 4 prompt tokens, 16-token blocks
    assert {"remote_host", "remote_port", "tp_size"} <= kv.keys()
    # A decode leg is handed those; the fake records what it was given.
    decode = body("d2", stream=True, max_tokens=3, ignore_eos=True)
    decode["kv_transfer_params"] = kv
    events, _ = await sse(http, decode)
    assert "kv_transfer_params" not in events[0]  # vLLM's stream events have no such field
    assert fake.requests[-1].body["kv_transfer_params"] == kv
    assert fake.requests[-1].kv_transfer_params is None


async def test_a_tokens_only_server_refuses_what_it_cannot_do(http: httpx.AsyncClient) -> None:
    refused = [
        body("v1", stop=["\n"]),
        body("v2", bogus_param=1),
        {**body("v3"), "output_mode": "text"},
        {**body("v4"), "token_ids": []},
    ]
    for doc in refused:
        resp = await http.post(GENERATE, json=doc)
        assert resp.status_code == 400, doc
        assert resp.json()["error"]["code"] == 400
    resp = await http.post(GENERATE, content=json.dumps(body("v5")), headers={})
    assert resp.status_code == 400


async def test_an_aborted_whole_response_finishes_with_abort(
    fake: FakeVllm, http: httpx.AsyncClient
) -> None:
    fake.knobs.stall_after = 0
    task = asyncio.create_task(http.post(GENERATE, json=body("w9", stream=False, max_tokens=9)))
    await fake.wait_until(lambda: fake.running == 1)
    await http.post(ABORT, json={"request_ids": ["generate-tokens-w9"]})
    doc = (await task).json()
    assert doc["choices"][0]["finish_reason"] == "abort" and doc["choices"][0]["token_ids"] == []
    assert fake.running == 0


# -- the native completions route (the bridge's fallback) ----------------------------------


def completion(rid: str, stream: bool = True, **fields: Any) -> dict[str, Any]:
    doc = {"request_id": rid, "prompt": PROMPT, "stream": stream, "return_token_ids": True}
    if stream:
        doc["stream_options"] = {"include_usage": True}
    return doc | fields


async def test_the_native_route_streams_completion_chunks_with_token_ids(
    fake: FakeVllm, http: httpx.AsyncClient
) -> None:
    fake.knobs.capability = 404  # the token-only route is missing; the native one is not
    fake.knobs.chunk_size = 2
    events, _ = await sse(http, completion("n1", max_tokens=5, ignore_eos=True), COMPLETIONS)
    *chunks, usage, done = events
    assert done == "[DONE]" and usage["choices"] == [] and usage["object"] == "text_completion"
    assert usage["usage"] == {"prompt_tokens": 4, "total_tokens": 9, "completion_tokens": 5}
    assert all(e["id"] == "cmpl-n1" and e["object"] == "text_completion" for e in chunks)
    choices = [e["choices"][0] for e in chunks]
    assert [c["finish_reason"] for c in choices] == [None, None, "length"]
    assert [c["prompt_token_ids"] for c in choices] == [PROMPT, None, None]  # first only
    ids = [t for c in choices for t in c["token_ids"]]
    assert ids == fake.expected(PROMPT, {"max_tokens": 5, "ignore_eos": True})[0]
    assert all(c["text"] == "" and c["logprobs"] is None for c in choices)  # no tokenizer


async def test_the_native_route_answers_whole_with_16_tokens_by_default(
    fake: FakeVllm, http: httpx.AsyncClient
) -> None:
    resp = await http.post(COMPLETIONS, json=completion("n2", stream=False, ignore_eos=True))
    doc = resp.json()
    assert resp.status_code == 200 and doc["id"] == "cmpl-n2" and doc["usage"]["total_tokens"] == 20
    (choice,) = doc["choices"]
    assert choice["token_ids"] == fake.expected(PROMPT, {"max_tokens": 16, "ignore_eos": True})[0]
    assert choice["prompt_token_ids"] == PROMPT and choice["finish_reason"] == "length"
    plain = await http.post(COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 2})
    (choice,) = plain.json()["choices"]
    assert choice["token_ids"] is None and choice["prompt_token_ids"] is None  # not asked


async def test_native_logprobs_name_tokens_by_id_sampled_first(http: httpx.AsyncClient) -> None:
    doc = completion("n3", stream=False, max_tokens=3, ignore_eos=True, logprobs=2,
                     return_tokens_as_token_ids=True)  # fmt: skip
    (choice,) = (await http.post(COMPLETIONS, json=doc)).json()["choices"]
    lp = choice["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(len(top) == 3 for top in lp["top_logprobs"])  # logprobs + 1
    firsts = [next(iter(top.items())) for top in lp["top_logprobs"]]
    assert firsts == list(zip(lp["tokens"], lp["token_logprobs"], strict=True))


async def test_the_native_route_refuses_what_it_does_not_know(http: httpx.AsyncClient) -> None:
    for doc, needle in [
        (completion("b1", detokenize=False), "unknown field(s) ['detokenize']"),
        (completion("b2", prompt="text"), "token-ID prompts"),
        (completion("b3", prompt=[10**9]), "token IDs must lie in"),
    ]:
        resp = await http.post(COMPLETIONS, json=doc)
        assert resp.status_code == 400 and needle in resp.json()["error"]["message"]
