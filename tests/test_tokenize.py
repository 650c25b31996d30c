"""`POST /tokenize` and `/detokenize` in vLLM's shapes, answered by the render stage with the
tokenizer and template a request is rendered with."""

from __future__ import annotations

import httpx
import msgspec
import pytest

from tests.conftest import Stack, start_stack
from tests.test_errors import assert_error

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


async def test_chat_messages_tokenize_to_the_prompt_a_chat_request_is_given(
    http: httpx.AsyncClient,
) -> None:
    chat = await http.post("/v1/chat/completions", json={
        "model": "deepseek-v4", "messages": CHAT, "max_tokens": 2, "return_token_ids": True,
    })  # fmt: skip
    assert chat.status_code == 200, chat.text
    resp = await http.post("/tokenize", json={"model": "deepseek-v4", "messages": CHAT})
    assert resp.status_code == 200, resp.text
    doc = resp.json()
    assert doc["tokens"] == chat.json()["prompt_token_ids"]
    assert doc["count"] == len(doc["tokens"]) == chat.json()["usage"]["prompt_tokens"]
    models = (await http.get("/v1/models")).json()["data"][0]
    assert doc["max_model_len"] == models["max_model_len"] and doc["token_strs"] is None
    open_ended = await http.post(
        "/tokenize", json={"messages": CHAT, "add_generation_prompt": False}
    )
    assert open_ended.json()["count"] < doc["count"]  # no assistant turn begun


async def test_a_prompt_tokenizes_as_a_completion_and_round_trips(
    http: httpx.AsyncClient,
) -> None:
    text = "The quick brown fox jumps over the lazy dog. 12345 ünïcödé"
    done = await http.post("/v1/completions", json={
        "prompt": text, "max_tokens": 2, "return_token_ids": True,
    })  # fmt: skip
    resp = await http.post("/tokenize", json={"prompt": text, "return_token_strs": True})
    assert done.status_code == resp.status_code == 200, (done.text, resp.text)
    doc = resp.json()
    assert doc["tokens"] == done.json()["choices"][0]["prompt_token_ids"]
    assert len(doc["token_strs"]) == doc["count"] == len(doc["tokens"])
    assert all(isinstance(s, str) and s for s in doc["token_strs"])
    back = await http.post("/detokenize", json={"model": "deepseek-v4", "tokens": doc["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


async def test_bad_tokenize_calls_are_openai_errors(http: httpx.AsyncClient) -> None:
    error = assert_error(
        await http.post("/tokenize", json={"model": "no-such-model", "prompt": "hi"}), 404
    )
    assert error["code"] == "model_not_found"
    error = assert_error(await http.post("/detokenize", json={"tokens": [5, 2**31 - 1]}), 400,
                         "outside the vocabulary")  # fmt: skip
    assert error["param"] == "tokens"
    assert_error(await http.post("/detokenize", json={"tokens": [-1]}), 400)
    assert_error(await http.post("/tokenize", json={}), 400, "prompt")
    assert_error(await http.post("/tokenize", content=b"{not json"), 400, "JSON")
    # the ingress reads the model it routes by from a body nested past msgspec's stack
    deep = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert_error(await http.post("/tokenize", content=deep), 400, "prompt")
    both = {"messages": CHAT, "add_generation_prompt": True, "continue_final_message": True}
    assert_error(await http.post("/tokenize", json=both), 400, "continue_final_message")
    wrong = await http.get("/tokenize")
    assert_error(wrong, 405)
    assert wrong.headers["allow"] == "POST"


async def test_an_answer_too_big_for_the_bus_is_a_400_and_render_goes_on(
    http: httpx.AsyncClient,
) -> None:
    """900k token IDs and their strings are 9 MB: over the bus's 8 MiB for one answer."""
    big = {"prompt": " a" * 900_000, "return_token_strs": True, "add_special_tokens": False}
    assert_error(await http.post("/tokenize", json=big), 400, "bus payload limit")
    fine = await http.post("/tokenize", json={"prompt": "still here"})
    assert fine.status_code == 200 and fine.json()["count"] > 0


async def test_a_model_no_render_worker_serves_is_a_503(stack: Stack) -> None:
    settings = msgspec.structs.replace(stack.settings, served_model_name="nobody-renders-this")
    lonely = await start_stack(stack.settings.nats, settings, ["ingress"])
    try:
        async with httpx.AsyncClient(base_url=lonely.url, timeout=30) as http:
            resp = await http.post("/tokenize", json={"prompt": "hi"})
        assert_error(resp, 503, "no render worker")
        assert resp.headers["retry-after"]
    finally:
        await lonely.close()
