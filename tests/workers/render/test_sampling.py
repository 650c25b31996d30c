"""OpenAI request fields → sampling parameters, the context budget, and refused features."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from tokenway.api.openai import ChatCompletionRequest, CompletionRequest
from tokenway.errors import InvalidRequest
from tokenway.sampling import budget
from tokenway.wire import SamplingParams
from workers.render.sampling import (
    reject_unsupported,
    requested_max_tokens,
    sampling_params,
)

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> ChatCompletionRequest:
    return msgspec.convert({"messages": MESSAGES, **fields}, ChatCompletionRequest)


def completion(**fields: Any) -> CompletionRequest:
    return msgspec.convert({"prompt": "hi", **fields}, CompletionRequest)


def test_budget_without_max_tokens_is_the_rest_of_the_context() -> None:
    assert budget(100, None, 4096) == 3996
    assert budget(4095, None, 4096) == 1


def test_budget_keeps_a_max_tokens_that_fits() -> None:
    assert budget(100, 50, 4096) == 50
    assert budget(100, 3996, 4096) == 3996  # exactly the context


@pytest.mark.parametrize("prompt", [4096, 5000])
def test_a_prompt_filling_the_context_is_400_naming_both_numbers(prompt: int) -> None:
    with pytest.raises(InvalidRequest) as info:
        budget(prompt, None, 4096)
    assert "4096" in info.value.message and str(prompt) in info.value.message
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequest):
        budget(prompt, 1, 4096)


def test_prompt_plus_max_tokens_over_the_context_is_400_on_max_tokens() -> None:
    with pytest.raises(InvalidRequest) as info:
        budget(100, 3997, 4096)
    error = info.value
    assert error.param == "max_tokens" and error.code == "context_length_exceeded"
    for number in ("4096", "4097", "100", "3997"):
        assert number in error.message


def test_chat_max_completion_tokens_wins_over_max_tokens() -> None:
    assert requested_max_tokens(chat(max_tokens=5, max_completion_tokens=7)) == 7
    assert requested_max_tokens(chat(max_tokens=5)) == 5
    assert requested_max_tokens(chat()) is None
    assert requested_max_tokens(completion()) == 16  # OpenAI's completions default
    assert requested_max_tokens(completion(max_tokens=None)) is None


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (chat(stop=["x", ""]), "stop"),
        (chat(echo=True), "echo"),
        (completion(suffix="!"), "suffix"),
        (completion(best_of=3), "best_of"),
    ],
)
def test_unsupported_or_malformed_features_are_refused_naming_the_param(
    request_: ChatCompletionRequest | CompletionRequest, param: str
) -> None:
    with pytest.raises(InvalidRequest) as info:
        reject_unsupported(request_)
    assert info.value.param == param and info.value.status == 400


@pytest.mark.parametrize(
    "request_",
    [chat(), chat(n=1, stop=None, logprobs=False), chat(stop=[]), completion(best_of=1)],
)
def test_absent_or_neutral_values_are_accepted(
    request_: ChatCompletionRequest | CompletionRequest,
) -> None:
    reject_unsupported(request_)


def test_unset_fields_take_vllms_neutral_values() -> None:
    params = sampling_params(chat(), 100)
    assert params == SamplingParams(max_tokens=100)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1.0, 1.0, 0, 0.0)
    assert params.repetition_penalty == 1.0 and params.stop == []


def test_request_fields_are_carried_into_sampling_params() -> None:
    req = completion(
        temperature=0.0,
        top_p=0.9,
        top_k=20,
        min_p=0.1,
        seed=42,
        min_tokens=2,
        stop="END",
        stop_token_ids=[7, 8],
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        include_stop_str_in_output=True,
        logit_bias={"6366": -100.0},
    )
    assert sampling_params(req, 33) == SamplingParams(
        temperature=0.0,
        top_p=0.9,
        top_k=20,
        min_p=0.1,
        seed=42,
        max_tokens=33,
        min_tokens=2,
        stop=["END"],
        stop_token_ids=[7, 8],
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        include_stop_str_in_output=True,
        logit_bias={"6366": -100.0},
    )


def test_context_budget_on_clips_max_tokens_to_what_fits() -> None:
    assert budget(100, 5000, 4096, clip=True) == 3996
    assert budget(100, 50, 4096, clip=True) == 50
    with pytest.raises(InvalidRequest, match="4096"):
        budget(4096, 1, 4096, clip=True)  # a prompt that fills the context still cannot run
