"""The vLLM derender backend's pure part: the calls it builds and how it reads the answers."""

from __future__ import annotations

import json

import msgspec
import pytest

from tokenway.errors import InvalidRequest, StageUnavailable
from tokenway.wire import DerenderEntry, LogprobEntry, OutputContext, TokenLogprob
from workers.derender import vllm_http as v

CTX = OutputContext(
    api="chat", response_id="chatcmpl-1", model="m", created=42, prompt_tokens=5,
    prompt_tail=[1, 2, 3], stream=True, n=2, index_base=2, request_body=b'{"model":"m"}',
)  # fmt: skip


def reply(chunk: dict, state: dict | None = None) -> bytes:
    return json.dumps({"chunk": chunk, "stream_state": state or {"prev_tokens": []}}).encode()


def chunk(**choice: object) -> dict:
    return {"id": "chatcmpl-1", "created": 9, "choices": [{"index": 2, **choice}], "usage": None}


def test_a_stream_call_carries_the_delta_the_state_and_the_clients_body() -> None:
    entry = DerenderEntry(
        context=CTX, token_ids=[7, 8], index=1, finish_reason="stop", stop_reason=0,
        logprobs=[LogprobEntry(7, -0.5, 1, [TokenLogprob(7, -0.5, 1)]), LogprobEntry(8, -1.0)],
    )  # fmt: skip
    call = json.loads(v.stream_call(CTX, v.generate_chunk(entry), msgspec.Raw(b'{"a":1}')))
    assert call["stream"] is True and call["stream_state"] == {"a": 1}
    assert call["chat_request"] == {"model": "m"} and "completion_request" not in call
    assert call["prompt_token_ids"] == [1, 2, 3] and call["prompt_tokens"] == 5
    [choice] = call["generate_chunk"]["choices"]
    assert choice["index"] == 3  # global: index_base + the entry's choice
    assert choice["token_ids"] == [7, 8] and choice["stop_reason"] == 0
    assert choice["logprobs"]["content"][0] == {
        "token_id": 7, "logprob": -0.5, "rank": 1,
        "top_logprobs": [{"token_id": 7, "logprob": -0.5, "rank": 1}],
    }  # fmt: skip


def test_an_answer_showing_nothing_is_dropped_and_the_rest_get_the_requests_created() -> None:
    empty = chunk(delta={"role": None, "content": None, "tool_calls": []}, finish_reason=None)
    doc, state = v.read_stream_reply(CTX, reply(empty, {"x": 1}))
    assert doc is None and bytes(state) == b'{"x": 1}'
    doc, _ = v.read_stream_reply(CTX, reply(chunk(delta={"role": "assistant", "content": ""})))
    assert doc is not None and json.loads(doc)["created"] == 42


@pytest.mark.parametrize(
    "content",
    [b"<html>", b'{"chunk": {}}', b'{"stream_state": {}}', b'{"chunk": 1, "stream_state": {}}'],
)
def test_an_unusable_answer_is_the_stage_failing(content: bytes) -> None:
    with pytest.raises(StageUnavailable, match="unusable"):
        v.read_stream_reply(CTX, content)


def test_the_state_is_refused_past_the_header_bound_and_when_it_is_not_ours() -> None:
    raw = v.carry(3, msgspec.Raw(b'{"prev_tokens": ["a"]}'))
    assert v.carried(raw).tokens == 3
    with pytest.raises(StageUnavailable, match="stream_state grew"):
        v.carry(3, msgspec.Raw(json.dumps({"output_token_ids": [1] * 5000}).encode()))
    with pytest.raises(InvalidRequest, match="not one the vLLM derender backend made"):
        v.carried(msgspec.msgpack.encode([[1, 2], 0, 0]))  # the local backend's state
