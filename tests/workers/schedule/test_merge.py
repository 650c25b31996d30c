"""The multi-prompt merge core: when sub-stream output goes out, and how the output closes."""

from __future__ import annotations

import json

from tokenway import headers as h
from tokenway.errors import EngineFailed, error_body
from tokenway.output_router import Event
from tokenway.wire import OUTPUTS, Failed, OutputContext
from workers.schedule.merge import Merge, retryable

CTX = OutputContext(response_id="cmpl-x", model="m", stream=True, include_usage=True)


def event(seq: int, kind: str, payload: bytes, tokens: int = 0, status: int = 200) -> Event:
    if kind == h.KIND_ERROR:
        return Failed(rid="sub", seq=seq, payload=payload, status=status)
    return OUTPUTS[kind](rid="sub", seq=seq, payload=payload, tokens=tokens)


def chunk(seq: int, text: str, kind: str = h.KIND_CHUNK, tokens: int = 1) -> Event:
    return event(seq, kind, f"data: {text}\n\n".encode(), tokens=tokens)


def test_nothing_goes_out_until_every_prompt_has_begun_then_all_in_order() -> None:
    merge = Merge(CTX, prompt_tokens=9, prompts=2, limit=10)
    merge.add(0, chunk(1, "a"))
    merge.add(0, chunk(2, "b"))
    assert merge.take() is None
    merge.add(1, chunk(1, "c"))
    out = merge.take()
    assert out is not None and out.kind == h.KIND_CHUNK
    assert out.payload == b"data: a\n\ndata: b\n\ndata: c\n\n"
    assert merge.take() is None  # nothing new


def test_the_last_end_closes_with_one_usage_summing_every_prompt() -> None:
    merge = Merge(CTX, prompt_tokens=9, prompts=2, limit=10)
    merge.add(0, chunk(1, "a", h.KIND_END, tokens=3))
    merge.add(1, chunk(1, "b"))
    assert merge.take().kind == h.KIND_CHUNK  # prompt 0's end is not the request's
    merge.add(1, chunk(2, "c", h.KIND_END, tokens=1))
    out = merge.take()
    assert out.kind == h.KIND_END and merge.ended
    usage = json.loads(out.payload.split(b"data: ")[-1])["usage"]
    assert usage == {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}


def test_a_prompts_error_names_the_prompt_and_stops_output() -> None:
    merge = Merge(CTX, prompt_tokens=9, prompts=2, limit=10)
    body = error_body(EngineFailed("engine e: boom").info())
    merge.add(1, event(1, h.KIND_ERROR, body, status=502))
    merge.add(0, chunk(1, "a"))
    assert merge.take() is None
    assert merge.error.message == "prompt 1: engine e: boom" and merge.error.status == 502
    assert retryable(merge.error)


def test_a_prompt_holding_more_than_the_limit_fails_the_request() -> None:
    merge = Merge(CTX, prompt_tokens=9, prompts=2, limit=2)
    for seq in (1, 2, 3):
        merge.add(0, chunk(seq, "a"))
    assert merge.error is not None and "more than 2 output events" in merge.error.message


def test_non_streamed_responses_merge_by_index_with_usage_summed() -> None:
    def response(index: int, prompt: int, completion: int) -> Event:
        doc = {"id": "x", "choices": [{"index": index, "text": str(index)}],
               "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                         "total_tokens": prompt + completion}}  # fmt: skip
        return event(1, h.KIND_RESPONSE, json.dumps(doc).encode())

    merge = Merge(OutputContext(), prompt_tokens=7, prompts=2, limit=10)
    merge.add(1, response(1, 4, 6))
    assert merge.take() is None
    merge.add(0, response(0, 3, 2))
    doc = json.loads(merge.take().payload)
    assert [c["index"] for c in doc["choices"]] == [0, 1]
    assert doc["usage"] == {"prompt_tokens": 7, "completion_tokens": 8, "total_tokens": 15}


def test_deadlines_and_client_errors_are_not_retried() -> None:
    merge = Merge(CTX, prompt_tokens=1, prompts=1, limit=1)
    merge.add(0, event(1, h.KIND_ERROR, b"{}", status=504))
    assert not retryable(merge.error)
