"""Bad input gets an OpenAI error body with the right status; a full queue answers 429."""

from __future__ import annotations

import asyncio
import logging

import httpx
import msgspec
import nats
import openai
import pytest

from tests.conftest import Stack, guarded_bus, make_settings, start_stack
from tests.workers.render.test_render_core import deep_json
from tokenway import bus

pytestmark = pytest.mark.asyncio(loop_scope="session")


def assert_error(resp: httpx.Response, status: int, *needles: str) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    for needle in needles:
        assert needle in error["message"]
    return error


async def post(stack: Stack, path: str, **kwargs) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.post(f"{stack.url}{path}", **kwargs)


async def test_malformed_json_is_400(stack: Stack) -> None:
    resp = await post(
        stack,
        "/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert_error(resp, 400, "not valid JSON")


async def test_schema_violation_is_400_naming_the_field(stack: Stack) -> None:
    resp = await post(
        stack,
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
    )
    assert_error(resp, 400, "temperature")
    resp = await post(stack, "/v1/chat/completions", json={"messages": []})
    assert_error(resp, 400, "messages")


async def test_unknown_model_is_404(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    assert "no-such-model" in str(info.value)


async def test_wrong_method_on_a_completion_route_is_405_with_an_error_body(stack: Stack) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        resp = await http.get(f"{stack.url}/v1/chat/completions")
    error = assert_error(resp, 405, "GET /v1/chat/completions", "POST")
    assert error["type"] == "MethodNotAllowed"
    assert resp.headers["allow"] == "POST"


async def test_prompt_longer_than_context_is_400_with_numbers(stack: Stack) -> None:
    context = stack.ingress.models[0].info.context_length
    resp = await post(
        stack, "/v1/completions", json={"prompt": [100] * (context + 1), "max_tokens": 1}
    )
    assert_error(resp, 400, str(context), str(context + 1))


async def test_prompt_plus_max_tokens_over_context_is_400(stack: Stack) -> None:
    context = stack.ingress.models[0].info.context_length
    resp = await post(
        stack, "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": context},
    )  # fmt: skip
    error = assert_error(resp, 400, str(context))
    assert error["param"] == "max_tokens"


async def test_streaming_request_errors_before_the_stream_starts(stack: Stack) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "stop": [""]}
    resp = await post(stack, "/v1/chat/completions", json=body)
    assert_error(resp, 400, "stop strings must not be empty")


async def test_full_render_queue_is_429_with_retry_after(tmp_path) -> None:
    """No render worker drains the queue; once it holds its limit, the next request is refused."""
    async with guarded_bus(tmp_path / "nats") as server:
        settings = make_settings(tmp_path / "data", queue_max_msgs=2, request_timeout=30)
        stack = await start_stack(server.url, settings, ["ingress"])
        body = {"messages": [{"role": "user", "content": "hi"}]}
        async with httpx.AsyncClient(timeout=30) as http:
            waiting = [
                asyncio.create_task(http.post(f"{stack.url}/v1/chat/completions", json=body))
                for _ in range(2)
            ]
            nc = await nats.connect(server.watch)
            js = nc.jetstream()
            queued = await js.subscribe(
                bus.render_subject("deepseek-v4"), stream=bus.RENDER_STREAM, manual_ack=True
            )
            # The two requests are stored once the stream shows them; wait on their delivery.
            for _ in range(2):
                await queued.next_msg(timeout=10)
            resp = await http.post(f"{stack.url}/v1/chat/completions", json=body)
            assert_error(resp, 429, "queue is full")
            assert resp.headers["retry-after"] == "1"
            for task in waiting:
                task.cancel()
            await nc.close()
        await stack.close()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seed", 2**70),
        ("seed", -(2**64)),
        ("priority", 2**63),
        ("top_k", 2**64),
        ("top_k", -5),
        ("min_tokens", 2**70),
        ("kv_transfer_params", {"remote_block_ids": [2**64]}),
    ],
)
async def test_a_number_the_wire_cannot_carry_is_400_naming_it(
    stack: Stack, field: str, value: object
) -> None:
    """vLLM's bounds (64-bit seeds, top_k of -1, 0 or more): a 400, never a 500 later."""
    body = {"prompt": "hi", "max_tokens": 2, field: value}
    resp = await post(stack, "/v1/completions", json=body)
    error = assert_error(resp, 400, field)
    assert error["type"] == "BadRequestError"


@pytest.mark.parametrize("given", [1.5, True, {"role": "user"}])
async def test_a_responses_input_of_the_wrong_type_is_400_naming_it(
    stack: Stack, given: object
) -> None:
    """The ingress reads the input for the conversation it keeps before it validates the
    body: an input that is neither text nor items is still the client's 400 (schemathesis
    found a 500 for a number)."""
    resp = await post(stack, "/v1/responses", json={"input": given, "store": True})
    assert_error(resp, 400, "input")


async def test_a_responses_number_the_wire_cannot_carry_is_400_naming_it(stack: Stack) -> None:
    """vLLM's extras on the Responses route are held to the same bounds."""
    body = {"input": "hi", "max_output_tokens": 2, "store": False,
            "kv_transfer_params": {"remote_block_ids": [2**64]}}  # fmt: skip
    resp = await post(stack, "/v1/responses", json=body)
    assert_error(resp, 400, "kv_transfer_params")


async def test_min_tokens_past_the_budget_is_400_as_vllm_says_it(stack: Stack) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "min_tokens": 3}
    resp = await post(stack, "/v1/completions", json=body)
    assert_error(resp, 400, "min_tokens must be less than or equal to max_tokens=2, got 3")


@pytest.mark.parametrize("field", ["chat_template_kwargs", "kv_transfer_params", "tools"])
async def test_json_nested_too_deep_is_400_not_500(stack: Stack, field: str) -> None:
    resp = await post(stack, "/v1/chat/completions", content=deep_json(field, 1000),
                      headers={"content-type": "application/json"})  # fmt: skip
    assert_error(resp, 400, "nests deeper than")


@pytest.mark.parametrize("sized", [True, False], ids=["content-length", "chunked"])
async def test_a_body_over_the_request_limit_is_413_before_it_is_read(
    stack: Stack, sized: bool
) -> None:
    limit = stack.settings.max_request_bytes
    chunk = b" " * 65536
    chunks = limit // len(chunk) + 2

    async def body():
        for _ in range(chunks):
            yield chunk

    headers = {"content-type": "application/json"}
    if sized:
        headers["content-length"] = str(chunks * len(chunk))
    resp = await post(stack, "/v1/completions", content=body(), headers=headers)
    error = assert_error(resp, 413, str(limit))
    assert error["param"] is None


async def test_a_body_that_stops_arriving_is_a_408_and_holds_nothing(stack: Stack) -> None:
    """Half-sent bodies were held open forever; each gets its 408 after the body timeout."""
    settings = msgspec.structs.replace(stack.settings, body_timeout=0.5)
    ingress = await start_stack(stack.settings.nats, settings, ["ingress"])
    try:
        host, port = ingress.url.removeprefix("http://").rsplit(":", 1)
        conns = [await asyncio.open_connection(host, int(port)) for _ in range(20)]
        for _, writer in conns:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n"
                         b'content-type: application/json\r\n\r\n{"prompt": ')  # fmt: skip
        for reader, writer in conns:
            assert b" 408 " in await reader.readline()
            rest = await reader.read()  # the server closes the connection after its answer
            assert b"did not arrive within 0.5s" in rest
            writer.close()
    finally:
        await ingress.close()


async def test_a_request_no_engine_could_ever_hold_is_400_before_any_inference(
    stack: Stack,
) -> None:
    """n=128 × max_tokens=8192 was a 502 from the engine; it never fits the engines' budget."""
    body = {"prompt": "hi", "n": 128, "max_tokens": 8192}
    error = assert_error(await post(stack, "/v1/completions", json=body), 400,
                         "tokens of engine budget", "largest engine holds")  # fmt: skip
    assert error["param"] == "max_tokens"


async def test_other_routes_answer_unknown_paths_and_methods_with_openai_bodies(
    stack: Stack,
) -> None:
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        error = assert_error(await http.get("/v1/nowhere"), 404, "/v1/nowhere")
        assert error["type"] == "NotFoundError"
        resp = await http.post("/v1/models")
        error = assert_error(resp, 405, "POST /v1/models")
        assert error["type"] == "MethodNotAllowed" and resp.headers["allow"] == "GET"


async def test_a_model_is_retrieved_by_id_and_an_unknown_one_is_a_404(stack: Stack) -> None:
    """`client.models.retrieve`, as vLLM serves it."""
    client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    model = await client.models.retrieve("deepseek-v4")
    assert model.id == "deepseek-v4" and model.model_extra["max_model_len"] > 0
    with pytest.raises(openai.NotFoundError) as info:
        await client.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found"


async def test_the_version_is_served(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        resp = await http.get("/version")
    assert resp.status_code == 200 and resp.json()["version"]


SECRET = "the server's secret: /etc/tokenway/keys.txt"


def logged_under(caplog: pytest.LogCaptureFixture, rid: str) -> logging.LogRecord:
    """The log record of a bug that names `rid`, with the traceback the client did not get."""
    (record,) = [r for r in caplog.records if rid in r.getMessage() and r.exc_info]
    assert SECRET in str(record.exc_info[1])
    return record


async def test_a_bug_answers_500_with_its_request_id_and_logs_what_broke(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An exception's text can hold paths, keys or another request's data: the client hears
    that a bug happened and the id to find it by; the log has the traceback under that id."""

    async def broken(request: object) -> object:
        raise RuntimeError(SECRET)

    monkeypatch.setattr(stack.by_name["render"][0].backend, "render", broken)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    for stream in (False, True):
        caplog.clear()
        resp = await post(stack, "/v1/chat/completions", json={**body, "stream": stream})
        rid = resp.headers["x-request-id"]
        error = assert_error(resp, 500, f"internal error in request {rid}")
        assert "secret" not in resp.text and "RuntimeError" not in resp.text
        assert error["type"] == "InternalServerError"
        logged_under(caplog, rid)


async def test_a_bug_in_any_other_route_answers_500_with_its_request_id(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> list:
        raise RuntimeError(SECRET)

    monkeypatch.setattr(stack.ingress.registry, "alive", broken)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        resp = await http.get("/v1/models", headers={"X-Request-Id": "mine-1"})
        assert_error(resp, 500, "internal error in request mine-1")
        assert resp.headers["x-request-id"] == "mine-1" and "secret" not in resp.text
        logged_under(caplog, "mine-1")
        anonymous = await http.get("/v1/models")  # without an id of its own, it gets one
        rid = anonymous.headers["x-request-id"]
        assert_error(anonymous, 500, f"internal error in request {rid}")
        logged_under(caplog, rid)
