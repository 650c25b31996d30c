"""Derender for vLLM's generate route, the pure core: token deltas to vLLM's `tokens`-mode
documents, with nothing decoded, and a `stream_state` that is a count and nothing else."""

from __future__ import annotations

import json

import msgspec
import pytest

from tokenway.errors import InvalidRequest
from tokenway.wire import DerenderEntry, LogprobEntry, OutputContext, TokenLogprob
from workers.derender.core import tokens_out

CTX = OutputContext(api="generate", response_id="generate-tokens-x", model="m", created=7,
                    prompt_tokens=3, stream=True, include_usage=True)  # fmt: skip


def _docs(entry: DerenderEntry) -> tuple[list[dict], bytes | None]:
    out = tokens_out(entry)
    return [json.loads(c) for c in out.chunks], out.state


def test_a_stream_counts_its_tokens_across_calls_and_closes_with_vllms_sparse_usage() -> None:
    ctx = msgspec.structs.replace(CTX, continuous_usage_stats=True, cached_tokens=2)
    first, state = _docs(DerenderEntry(context=ctx, token_ids=[5, 6]))
    assert first[0]["usage"] == {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2,
                                 "prompt_tokens_details": None,
                                 "completion_tokens_details": None}  # fmt: skip
    last = DerenderEntry(context=ctx, state=state, token_ids=[1], finish_reason="stop")
    (event, closing), _ = _docs(last)
    assert event["choices"][0] == {
        "index": 0, "finish_reason": "stop", "stop_reason": None, "token_ids": [1],
        "routed_experts": None, "sampling_mask": None, "weight_versions": None,
        "logprobs": None,
    }  # fmt: skip
    assert event["usage"]["completion_tokens"] == 3
    # the closing event leaves its null keys out, as vLLM's does
    usage = {"prompt_tokens": 3, "total_tokens": 6, "completion_tokens": 3,
             "prompt_tokens_details": {"cached_tokens": 2}}  # fmt: skip
    assert closing == {"request_id": "generate-tokens-x", "output_mode": "tokens",
                       "choices": [], "usage": usage}  # fmt: skip


def test_logprobs_keep_every_candidate_and_floor_minus_infinity() -> None:
    top = [TokenLogprob(9, -0.5, 2), TokenLogprob(4, float("-inf"), 1)]
    entry = DerenderEntry(context=CTX, token_ids=[9],
                          logprobs=[LogprobEntry(9, -0.5, 2, top)])  # fmt: skip
    ((event,), _) = _docs(entry)
    (content,) = event["choices"][0]["logprobs"]["content"]
    assert content == {"token_id": 9, "logprob": -0.5, "rank": 2, "top_logprobs": [
        {"token_id": 9, "logprob": -0.5, "rank": 2},
        {"token_id": 4, "logprob": -9999.0, "rank": 1}]}  # fmt: skip


def test_a_whole_response_has_every_key_of_vllms() -> None:
    ctx = msgspec.structs.replace(CTX, stream=False, return_token_ids=True, cached_tokens=0)
    entry = DerenderEntry(context=ctx, token_ids=[5, 2], finish_reason="stop", stop_reason=2,
                          prompt_token_ids=[1, 2, 3])  # fmt: skip
    ((doc,), state) = _docs(entry)
    assert state is None and doc["prompt_token_ids"] == [1, 2, 3]
    assert doc["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 0, "created_cache_tokens": None, "multimodal_tokens": None}  # fmt: skip
    assert doc["choices"][0]["token_ids"] == [5, 2]  # the stop token included, as vLLM's


@pytest.mark.parametrize("state", [b"\x91\xff", b"\x91\xa1x", b"x" * 64, b"\xc1"])
def test_a_stream_state_no_derender_made_is_a_400(state: bytes) -> None:
    with pytest.raises(InvalidRequest) as caught:
        tokens_out(DerenderEntry(context=CTX, state=state, token_ids=[1]))
    assert caught.value.param == "stream_state"
