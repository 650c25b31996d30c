"""vLLM's render routes (issue 35, first part): `POST /v1/chat/completions/render` and
`/v1/completions/render` answer the token-only `GenerateRequest` a request renders to, in
vLLM's JSON shape, from tokenway's render stage over the bus: the prompt IDs a request of
the same body is given, and its sampling parameters with the budget resolved."""

from __future__ import annotations

import httpx
import pytest

from tests.test_errors import assert_error

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
# Every field vLLM's render server writes in its answer.
FIELDS = {
    "request_id", "token_ids", "token_offsets", "features", "content_parts", "sampling_params",
    "model", "reasoning_ended", "reasoning_parser_kwargs", "return_token_ids", "output_mode",
    "stream", "stream_options", "cache_salt", "priority", "kv_transfer_params",
    "ec_transfer_params",
}  # fmt: skip


async def test_a_chat_renders_to_the_prompt_and_parameters_its_request_is_given(
    http: httpx.AsyncClient,
) -> None:
    body = {"model": "deepseek-v4", "messages": CHAT, "max_tokens": 5, "temperature": 0,
            "seed": 3, "stop": ["x"], "stream": True, "stream_options": {"include_usage": True},
            "logprobs": True, "top_logprobs": 2}  # fmt: skip
    resp = await http.post("/v1/chat/completions/render", json=body,
                           headers={"X-Request-Id": "abc"})  # fmt: skip
    assert resp.status_code == 200, resp.text
    doc = resp.json()
    assert set(doc) == FIELDS
    tokenized = await http.post("/tokenize", json={"model": "deepseek-v4", "messages": CHAT})
    assert doc["token_ids"] == tokenized.json()["tokens"]
    assert doc["request_id"] == "chatcmpl-abc" and resp.headers["x-request-id"] == "abc"
    assert doc["model"] == "deepseek-v4" and doc["output_mode"] == "tokens"
    assert doc["stream"] is True and doc["stream_options"]["include_usage"] is True
    params = doc["sampling_params"]
    assert params["max_tokens"] == 5 and params["temperature"] == 0 and params["seed"] == 3
    assert params["stop"] == ["x"] and params["logprobs"] == 2
    # as vLLM serializes them: its floats always, but those greedy sampling resets; the
    # fields its generate route overwrites
    assert "top_p" not in params and params["presence_penalty"] == 0.0
    assert (params["output_kind"], params["skip_clone"], params["bad_words"]) == (1, True, [])
    assert doc["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    unnamed = await http.post("/v1/chat/completions/render", json={"messages": CHAT})
    assert unnamed.json()["model"] is None  # as sent, as vLLM answers it
    assert unnamed.json()["request_id"].startswith("chatcmpl-")


async def test_a_completion_renders_one_request_per_prompt_each_with_its_budget(
    http: httpx.AsyncClient,
) -> None:
    body = {"prompt": ["Hello", "The quick brown fox"], "request_id": "mine", "n": 2}
    resp = await http.post("/v1/completions/render", json=body)
    assert resp.status_code == 200, resp.text
    first, second = resp.json()
    assert (first["request_id"], second["request_id"]) == ("cmpl-mine-0", "cmpl-mine-1")
    for doc, prompt in zip((first, second), body["prompt"], strict=True):
        tokenized = await http.post("/tokenize", json={"prompt": prompt})
        assert doc["token_ids"] == tokenized.json()["tokens"]
        # vLLM 0.32 leaves the default 16 out, and its generate server then fills the
        # context: here it is always written
        assert doc["sampling_params"]["max_tokens"] == 16
        assert doc["sampling_params"]["n"] == 2
    (one,) = (await http.post("/v1/completions/render", json={"prompt": "Hi"})).json()
    assert "-" not in one["request_id"].removeprefix("cmpl-")  # one prompt: no index


async def test_what_render_refuses_is_vllms_error_for_it(http: httpx.AsyncClient) -> None:
    unknown = {"model": "no-such-model", "messages": CHAT}
    assert_error(await http.post("/v1/chat/completions/render", json=unknown), 404)
    assert_error(await http.post("/v1/chat/completions/render", json={"messages": []}), 400)
    too_many = {"prompt": "Hi", "max_tokens": 10**7}
    error = assert_error(await http.post("/v1/completions/render", json=too_many), 400,
                         "cannot be greater than max_model_len")  # fmt: skip
    assert error["param"] == "max_tokens"
    # vLLM's render server cuts a budget past what the context leaves (not past the context)
    counted = (await http.post("/tokenize", json={"messages": CHAT})).json()
    context, prompt = counted["max_model_len"], counted["count"]
    near = {"messages": CHAT, "max_completion_tokens": context - 1}
    resp = await http.post("/v1/chat/completions/render", json=near)
    assert resp.status_code == 200, resp.text
    assert resp.json()["sampling_params"]["max_tokens"] == context - prompt
    assert_error(await http.post("/v1/completions/render", json={"prompt": []}), 400)
    assert_error(await http.post("/v1/completions/render", content=b"{not json"), 400, "JSON")
    assert_error(await http.get("/v1/completions/render"), 405)


async def test_a_messages_request_renders_as_vllm_renders_it(http: httpx.AsyncClient) -> None:
    """As the chat request it is: a chat's id, usage on every chunk of its stream, its stop
    sequences as stop strings; the prompt its own request is given."""
    body = {"model": "deepseek-v4", "max_tokens": 30, "system": "Be brief.", "temperature": 0.5,
            "stop_sequences": ["END"], "stream": True,
            "messages": [{"role": "user", "content": "Hello there"}]}  # fmt: skip
    resp = await http.post("/v1/messages/render", json=body, headers={"X-Request-Id": "m1"})
    assert resp.status_code == 200, resp.text
    doc = resp.json()
    assert set(doc) == FIELDS and doc["request_id"] == "chatcmpl-m1"
    assert doc["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    params = doc["sampling_params"]
    assert params["max_tokens"] == 30 and params["stop"] == ["END"]
    assert params["temperature"] == 0.5
    counted = await http.post("/v1/messages/count_tokens", json=body)
    assert len(doc["token_ids"]) == counted.json()["input_tokens"]
    # its errors are OpenAI's shape, as vLLM's render server answers them
    no_budget = {k: v for k, v in body.items() if k != "max_tokens"}
    assert_error(await http.post("/v1/messages/render", json=no_budget), 400, "max_tokens")


async def test_a_responses_request_renders_under_its_own_id_statelessly(
    http: httpx.AsyncClient,
) -> None:
    body = {"model": "deepseek-v4", "input": "Hello there", "instructions": "Be brief.",
            "max_output_tokens": 20, "stream": True, "request_id": "resp_mine"}  # fmt: skip
    resp = await http.post("/v1/responses/render", json=body, headers={"X-Request-Id": "no"})
    assert resp.status_code == 200, resp.text
    doc = resp.json()
    assert set(doc) == FIELDS and doc["request_id"] == "resp_mine"
    assert doc["stream"] is True and doc["stream_options"] is None
    assert doc["sampling_params"]["max_tokens"] == 20
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Hello there"}]}  # fmt: skip
    tokenized = await http.post("/tokenize", json=chat)
    assert doc["token_ids"] == tokenized.json()["tokens"]
    fresh = await http.post("/v1/responses/render", json={"input": "Hi"})
    assert fresh.json()["request_id"].startswith("resp_")
    going_on = {"input": "Hi", "previous_response_id": "resp_earlier"}
    error = assert_error(await http.post("/v1/responses/render", json=going_on), 400,
                         "not supported by the stateless render endpoint")  # fmt: skip
    assert error["param"] == "previous_response_id"


async def test_a_chat_render_says_whether_its_prompt_leaves_reasoning_open(
    http: httpx.AsyncClient,
) -> None:
    """The bundled model has a reasoning parser: vLLM's `reasoning_ended` on every chat
    render (thinking on: the prompt leaves reasoning open), and the template kwargs the
    prompt was rendered with for the engine's reasoning parser."""
    thinking = {"messages": CHAT, "chat_template_kwargs": {"thinking": True}}
    doc = (await http.post("/v1/chat/completions/render", json=thinking)).json()
    assert doc["reasoning_ended"] is False
    rendered_with = {"thinking": True, "add_generation_prompt": True,
                     "continue_final_message": False}  # fmt: skip
    assert doc["reasoning_parser_kwargs"] == {"chat_template_kwargs": rendered_with}
    plain = (await http.post("/v1/chat/completions/render", json={"messages": CHAT})).json()
    assert plain["reasoning_ended"] is True
    hidden = thinking | {"include_reasoning": False}
    assert (await http.post("/v1/chat/completions/render", json=hidden)).json()["reasoning_ended"]
    responses = (await http.post("/v1/responses/render", json={"input": "Hi"})).json()
    assert responses["reasoning_ended"] is None  # left to the engine, as vLLM's
