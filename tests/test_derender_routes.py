"""vLLM's derender routes (issue 35): `POST /v1/chat/completions/derender` and
`/v1/completions/derender`, batch and streamed with `stream_state`, answered by the session
stack's render stage with tokenway's own derender core. The flow a coordinator runs: render,
generate (token IDs), derender; what it assembles is what tokenway's own route answers for the
same request (the simulated engine's output is a function of the prompt and seed)."""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx
import pytest

from tests.test_errors import assert_error

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHAT = {"model": "deepseek-v4", "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 24, "seed": 5, "temperature": 0.5}  # fmt: skip
DERENDER, COMPLETION_DERENDER = "/v1/chat/completions/derender", "/v1/completions/derender"


async def _generated(http: httpx.AsyncClient, rendered: dict, stream: bool = False) -> Any:
    """vLLM's generate route run on a render route's answer: the whole response, or the
    stream's events."""
    options = {"include_usage": True} if stream else None
    asked = rendered | {"stream": stream, "stream_options": options}
    resp = await http.post("/inference/v1/generate", json=asked)
    assert resp.status_code == 200, resp.text
    if not stream:
        return resp.json()
    lines = [ln for ln in resp.text.split("\n\n") if ln.startswith("data: {")]
    return [json.loads(ln[6:]) for ln in lines]


async def _rendered(http: httpx.AsyncClient, body: dict) -> dict:
    resp = await http.post("/v1/chat/completions/render", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


async def _carried(http: httpx.AsyncClient, events: list[dict], body: dict, ids: list[int],
                   path: str = DERENDER, key: str = "chat_request") -> list[dict]:  # fmt: skip
    """Each generate event derendered in turn, the stream_state of each answer carried into
    the next call (one per choice index): every call's chunk."""
    states: dict[int, Any] = {}
    chunks = []
    for event in events:
        index = event["choices"][0]["index"] if event["choices"] else 0
        call = {"stream": True, "generate_chunk": event, "stream_state": states.get(index),
                "prompt_token_ids": ids, "prompt_tokens": len(ids), key: body}  # fmt: skip
        resp = await http.post(path, json=call)
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        assert set(answer) == {"chunk", "stream_state"}
        chunks.append(answer["chunk"])
        states[index] = answer["stream_state"]
    return chunks


def _said(chunks: list[dict]) -> tuple[str, str, str | None]:
    content = "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks if c["choices"])
    reasoning = "".join(c["choices"][0]["delta"]["reasoning"] or "" for c in chunks
                        if c["choices"])  # fmt: skip
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    return content, reasoning, finishes[-1]


def _regrouped(events: list[dict], size: int) -> list[dict]:
    """The same output in events of `size` tokens (the last one finishing), and the usage."""
    *outputs, closing = events
    ids = [t for e in outputs for t in e["choices"][0]["token_ids"]]
    last = outputs[-1]["choices"][0]
    out = []
    for start in range(0, len(ids), size):
        final = start + size >= len(ids)
        choice = {"index": 0, "token_ids": ids[start : start + size],
                  "finish_reason": last["finish_reason"] if final else None,
                  "stop_reason": last["stop_reason"] if final else None}  # fmt: skip
        out.append({"request_id": outputs[0]["request_id"], "choices": [choice]})
    return [*out, closing]


async def test_a_whole_generate_response_derenders_to_the_chat_completion_tokenway_gives(
    http: httpx.AsyncClient,
) -> None:
    rendered = await _rendered(http, CHAT)
    generated = await _generated(http, rendered)
    ids = rendered["token_ids"]
    call = {"generate_response": generated, "prompt_token_ids": ids, "prompt_tokens": len(ids),
            "chat_request": CHAT}  # fmt: skip
    resp = await http.post(DERENDER, json=call)
    assert resp.status_code == 200, resp.text
    doc = resp.json()
    direct = (await http.post("/v1/chat/completions", json=CHAT)).json()
    assert doc["object"] == "chat.completion" and doc["id"] == generated["request_id"]
    said = {k: v for k, v in doc["choices"][0]["message"].items() if v is not None}
    assert said == direct["choices"][0]["message"]  # (vLLM's derender writes its nulls)
    assert doc["choices"][0]["finish_reason"] == direct["choices"][0]["finish_reason"]
    assert doc["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"]
    assert doc["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("size", [None, 1, 3, 7], ids=["as-generated", "1", "3", "7"])
async def test_a_stream_carried_call_by_call_says_what_the_whole_response_says(
    http: httpx.AsyncClient, size: int | None
) -> None:
    """At 1, 3 or 7 tokens per event, or as generate sent them: one chunk per call, the role
    on the first, and the text, reasoning and finish of the whole answer (tokenway's parsers
    are exact for every chunking; vLLM's replay theirs from the start on every call)."""
    body = CHAT | {"stream": True}
    rendered = await _rendered(http, body)
    events = await _generated(http, rendered, stream=True)
    if size is not None:
        events = _regrouped(events, size)
    chunks = await _carried(http, events, body, rendered["token_ids"])
    assert len(chunks) == len(events)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["choices"][0]["delta"]["role"] is None for c in chunks[1:] if c["choices"])
    whole = await _generated(http, rendered)
    call = {"generate_response": whole, "prompt_token_ids": rendered["token_ids"],
            "chat_request": CHAT}  # fmt: skip
    message = (await http.post(DERENDER, json=call)).json()["choices"][0]["message"]
    content, reasoning, finish = _said(chunks)
    assert content == (message["content"] or "") and reasoning == (message.get("reasoning") or "")
    assert finish == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 24


async def test_a_stop_string_ends_a_stream_where_it_begins(http: httpx.AsyncClient) -> None:
    """vLLM 0.33 refuses stop strings when streaming derender; here the chunk that meets one
    ends the output and says so, holding nothing of the string, and the finished state takes
    no more (the caller stops generating)."""
    plain = {"model": "deepseek-v4", "prompt": "Once upon a time", "max_tokens": 30, "seed": 3}
    text = (await http.post("/v1/completions", json=plain)).json()["choices"][0]["text"]
    stop = text.split()[3]
    body = plain | {"stop": [stop], "stream": True}
    (rendered,) = (await http.post("/v1/completions/render", json=plain)).json()
    events = await _generated(http, rendered, stream=True)
    state, said, call, ended = None, "", {}, False
    for event in events[:-1]:
        call = {"stream": True, "generate_chunk": event, "stream_state": state,
                "prompt_token_ids": rendered["token_ids"], "completion_request": body}  # fmt: skip
        resp = await http.post(COMPLETION_DERENDER, json=call)
        if resp.status_code != 200:
            assert_error(resp, 400, "finished")
            break
        answer = resp.json()
        (choice,) = answer["chunk"]["choices"]
        said += choice["text"]
        state = answer["stream_state"]
        if choice["finish_reason"] is not None:
            assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
            ended = True
    assert ended and said == text[: text.index(stop)]
    again = await http.post(COMPLETION_DERENDER, json=call | {"stream_state": state})
    assert_error(again, 400, "finished")


async def test_completions_of_several_prompts_derender_numbered_on_with_usage_summed(
    http: httpx.AsyncClient,
) -> None:
    body = {"model": "deepseek-v4", "prompt": ["Once upon a time", "Hello"], "max_tokens": 6,
            "seed": 1}  # fmt: skip
    rendered = (await http.post("/v1/completions/render", json=body)).json()
    whole = [await _generated(http, r) for r in rendered]
    call = {"generate_responses": whole, "completion_request": body,
            "prompt_tokens": [len(r["token_ids"]) for r in rendered],
            "prompt_token_ids": [r["token_ids"] for r in rendered]}  # fmt: skip
    resp = await http.post(COMPLETION_DERENDER, json=call)
    assert resp.status_code == 200, resp.text
    doc = resp.json()
    direct = (await http.post("/v1/completions", json=body)).json()
    assert [c["index"] for c in doc["choices"]] == [0, 1]
    assert [c["text"] for c in doc["choices"]] == [c["text"] for c in direct["choices"]]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [doc["usage"][k] for k in counts] == [direct["usage"][k] for k in counts]


async def test_a_stream_state_not_made_here_is_a_400_never_a_crash(
    http: httpx.AsyncClient,
) -> None:
    body = CHAT | {"stream": True}
    rendered = await _rendered(http, body)
    events = await _generated(http, rendered, stream=True)
    ids = rendered["token_ids"]
    first = {"stream": True, "generate_chunk": events[0], "prompt_token_ids": ids,
             "chat_request": body}  # fmt: skip
    good = (await http.post(DERENDER, json=first)).json()["stream_state"]
    vllms = {k: v for k, v in good.items() if k != "tokenway"}
    junk = base64.b64encode(b"\x93\x01\x02\x03" * 8).decode()
    for state, says in [
        (vllms, "not tokenway's"),
        (good | {"tokenway": "%%%"}, "malformed"),
        (good | {"tokenway": junk}, "stream_state"),
        (good | {"tokenway": "A" * 40_000}, "stream_state"),
    ]:
        error = assert_error(await http.post(DERENDER, json=first | {"stream_state": state}),
                             400, says)  # fmt: skip
        assert error["param"] in ("stream_state", "stream_state.tokenway"), error


async def test_what_derender_cannot_take_is_vllms_error_for_it(http: httpx.AsyncClient) -> None:
    rendered = await _rendered(http, CHAT)
    whole = await _generated(http, rendered)
    ids = rendered["token_ids"]
    assert_error(await http.post(DERENDER, json={"chat_request": CHAT}), 400, "generate_response")
    no_request = {"generate_response": whole, "prompt_token_ids": ids}
    assert_error(await http.post(DERENDER, json=no_request), 400, "chat_request is required")
    empty = whole | {"choices": [whole["choices"][0] | {"token_ids": []}]}
    call = {"generate_response": empty, "prompt_token_ids": ids, "chat_request": CHAT}
    assert_error(await http.post(DERENDER, json=call), 400, "empty or null token_ids")
    other = {"generate_response": whole, "model": "nope", "chat_request": CHAT}
    assert_error(await http.post(DERENDER, json=other), 404)
    assert_error(await http.post(COMPLETION_DERENDER, json={}), 400, "must not be empty")
