"""vLLM's token-in/token-out route, `POST /inference/v1/generate` (issue 35): vLLM's
`GenerateRequest` in, its `tokens`-mode response or SSE events out, run through tokenway's
render, schedule and derender stages like any request (the session's stack, a simulated
engine speaking vLLM's wire)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio

from tests.conftest import Stack, keyed_ingress, start_stack
from tests.test_errors import assert_error

pytestmark = pytest.mark.asyncio(loop_scope="session")

GENERATE = "/inference/v1/generate"
# Every key of vLLM's GenerateTokensResponse, and of a choice of it
WHOLE = {
    "request_id", "model", "created", "usage", "prompt_logprobs", "prompt_token_id_logprobs",
    "prompt_token_ids", "mm_placeholders", "metrics", "kv_transfer_params",
    "ec_transfer_params", "output_mode", "choices",
}  # fmt: skip
CHOICE = {
    "index", "finish_reason", "stop_reason", "token_ids", "routed_experts", "sampling_mask",
    "weight_versions", "logprobs",
}  # fmt: skip


async def _prompt(http: httpx.AsyncClient, text: str = "The quick brown fox") -> list[int]:
    resp = await http.post("/tokenize", json={"prompt": text})
    return resp.json()["tokens"]


def _events(text: str) -> list[dict]:
    """A generate stream's events; it ends in [DONE]."""
    frames = [f for f in text.split("\n\n") if f]
    assert frames[-1] == "data: [DONE]", frames[-1]
    assert all(f.startswith("data: ") and "\n" not in f for f in frames)
    return [json.loads(f.removeprefix("data: ")) for f in frames[:-1]]


async def test_token_ids_in_give_vllms_whole_response_with_the_tokens_a_completion_gets(
    http: httpx.AsyncClient,
) -> None:
    ids = await _prompt(http)
    body = {"token_ids": ids, "sampling_params": {"max_tokens": 6, "temperature": 0}}
    resp = await http.post(GENERATE, json=body, headers={"X-Request-Id": "r-1"})
    assert resp.status_code == 200, resp.text
    doc = resp.json()
    assert set(doc) == WHOLE and doc["output_mode"] == "tokens"
    assert doc["request_id"] == "generate-tokens-r-1" and resp.headers["x-request-id"] == "r-1"
    assert doc["model"] == "deepseek-v4" and doc["prompt_token_ids"] is None
    (choice,) = doc["choices"]
    assert set(choice) == CHOICE and choice["index"] == 0
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 6
    assert doc["usage"]["prompt_tokens"] == len(ids)
    assert doc["usage"]["completion_tokens"] == 6
    assert doc["usage"]["total_tokens"] == len(ids) + 6
    # The same prompt as a completion's token-ID prompt samples the same tokens.
    completion = {"prompt": ids, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    same = (await http.post("/v1/completions", json=completion)).json()
    assert same["choices"][0]["token_ids"] == choice["token_ids"]
    # The body's request_id names the response when no header does.
    named = await http.post(GENERATE, json=body | {"request_id": "mine"})
    assert named.json()["request_id"] == "generate-tokens-mine"


async def test_a_stream_is_vllms_events_the_same_tokens_then_usage_and_done(
    http: httpx.AsyncClient,
) -> None:
    ids = await _prompt(http)
    params = {"max_tokens": 5, "temperature": 0}
    whole = (await http.post(GENERATE, json={"token_ids": ids, "sampling_params": params})).json()
    body = {
        "token_ids": ids,
        "sampling_params": params,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "return_token_ids": True,
    }
    resp = await http.post(GENERATE, json=body)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    *outputs, closing = _events(resp.text)
    assert outputs[0]["prompt_token_ids"] == ids  # on the first event alone
    assert all("prompt_token_ids" not in e for e in outputs[1:])
    streamed: list[int] = []
    for event in outputs:
        assert set(event) <= {"request_id", "usage", "prompt_token_ids", "output_mode", "choices"}
        (choice,) = event["choices"]
        assert set(choice) == CHOICE
        streamed += choice["token_ids"]
        assert event["usage"]["completion_tokens"] == len(streamed)  # continuous usage
    assert streamed == whole["choices"][0]["token_ids"]
    assert [e["choices"][0]["finish_reason"] for e in outputs][-1] == "length"
    assert all(e["choices"][0]["finish_reason"] is None for e in outputs[:-1])
    assert closing["choices"] == [] and closing["output_mode"] == "tokens"
    assert closing["usage"]["completion_tokens"] == 5
    assert closing["usage"]["total_tokens"] == len(ids) + 5


async def test_logprobs_come_by_token_id_one_entry_per_token(http: httpx.AsyncClient) -> None:
    ids = await _prompt(http)
    params = {"max_tokens": 4, "temperature": 0, "logprobs": 2}
    doc = (await http.post(GENERATE, json={"token_ids": ids, "sampling_params": params})).json()
    (choice,) = doc["choices"]
    content = choice["logprobs"]["content"]
    assert [c["token_id"] for c in content] == choice["token_ids"]
    for entry in content:
        assert isinstance(entry["logprob"], float) and entry["logprob"] <= 0
        assert entry["top_logprobs"][0]["token_id"] == entry["token_id"]  # sampled first
        assert set(entry["top_logprobs"][0]) == {"token_id", "logprob", "rank"}


async def test_several_choices_each_with_its_index_whole_and_streamed(
    http: httpx.AsyncClient,
) -> None:
    ids = await _prompt(http)
    params = {"max_tokens": 3, "n": 2, "seed": 7}
    doc = (await http.post(GENERATE, json={"token_ids": ids, "sampling_params": params})).json()
    assert sorted(c["index"] for c in doc["choices"]) == [0, 1]
    assert doc["usage"]["completion_tokens"] == 6
    streamed = {
        "token_ids": ids,
        "sampling_params": params,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    *outputs, closing = _events((await http.post(GENERATE, json=streamed)).text)
    assert {e["choices"][0]["index"] for e in outputs} == {0, 1}
    assert closing["usage"]["completion_tokens"] == 6 and closing["choices"] == []


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"sampling_params": {"stop": ["x"]}}, "sampling_params.stop"),
        ({"output_mode": "text"}, "output_mode"),
        ({"sampling_params": {"bad_words": ["x"]}}, "sampling_params.bad_words"),
        ({"sampling_params": {"prompt_logprobs": 1}}, "sampling_params.prompt_logprobs"),
        ({"sampling_params": {"extra_args": {"x": 1}}}, "sampling_params.extra_args"),
        ({"sampling_params": {"temperature": 3}}, "sampling_params.temperature"),
        ({"sampling_params": {"max_tokens": 0}}, "sampling_params.max_tokens"),
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [10**7]}, "token_ids"),
        ({"features": {"mm_hashes": {}}}, "features"),
        ({"ec_transfer_params": {}}, "ec_transfer_params"),
        # found by the fuzz test: a constraint of no kind crashed the engine (a 502 after
        # relays, each a strike on a breaker); one that does not compile is refused too
        (
            {"sampling_params": {"structured_outputs": {"json_object": None}}},
            "sampling_params.structured_outputs",
        ),
        (
            {"sampling_params": {"structured_outputs": {"regex": "(("}}},
            "sampling_params.structured_outputs",
        ),
    ],
)
async def test_what_the_route_cannot_do_is_a_400_naming_the_field(
    http: httpx.AsyncClient, change: dict, param: str
) -> None:
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}
    for key, value in change.items():
        body[key] = body[key] | value if isinstance(value, dict) and key in body else value
    error = assert_error(await http.post(GENERATE, json=body), 400)
    assert error["param"] == param, error


async def test_a_body_without_sampling_params_or_for_another_model_is_refused(
    http: httpx.AsyncClient,
) -> None:
    assert_error(await http.post(GENERATE, json={"token_ids": [1, 2]}), 400, "sampling_params")
    other = {"token_ids": [1, 2], "sampling_params": {}, "model": "nope"}
    assert_error(await http.post(GENERATE, json=other), 404)
    assert_error(await http.post(GENERATE, content=b"{"), 400, "JSON")
    assert_error(await http.get(GENERATE), 405)


async def test_a_render_servers_answer_posts_unchanged_and_runs(http: httpx.AsyncClient) -> None:
    """A coordinator's flow: render, then generate with what render answered (vLLM 0.32's
    render keeps the KV transfer parameters in `extra_args`, and writes its internals)."""
    rendered = await http.post("/v1/completions/render", json={"prompt": "Hi", "max_tokens": 3})
    (request,) = rendered.json()
    request["sampling_params"] |= {"output_kind": 2, "skip_clone": True, "bad_words": []}
    resp = await http.post(GENERATE, json=request)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 3


ABORT = "/inference/v1/abort_requests"
LONG = {"max_tokens": 4000, "ignore_eos": True}  # 40 s of the simulated engine's output


def _key(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _opened(http: httpx.AsyncClient, body: dict, request_id: str, key: str = "-"):
    """A streamed generate, once its first event is in: its response and line iterator."""
    headers = {"X-Request-Id": request_id, **_key(key)}
    resp = await http.send(http.build_request("POST", GENERATE, json=body, headers=headers),
                           stream=True)  # fmt: skip
    assert resp.status_code == 200
    lines = resp.aiter_lines()
    first = ""
    while not first:
        first = await anext(lines)
    return resp, lines, first


async def _rest(resp: httpx.Response, lines, first: str) -> list[dict]:
    text = first + "\n\n" + "".join(line + "\n\n" for line in [x async for x in lines] if line)
    await resp.aclose()
    return _events(text)


def _tokens(outputs: list[dict]) -> list[int]:
    return [t for e in outputs for t in e["choices"][0]["token_ids"]]


async def test_abort_requests_ends_a_stream_with_its_output_so_far_finished_abort(
    http: httpx.AsyncClient,
) -> None:
    body = {"token_ids": await _prompt(http), "sampling_params": LONG, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    resp, lines, first = await _opened(http, body, "long-1")
    aborted = await http.post(ABORT, json={"request_ids": ["generate-tokens-long-1"]})
    assert aborted.status_code == 200 and aborted.content == b""  # as vLLM's: at once, empty
    *outputs, closing = await _rest(resp, lines, first)
    assert outputs[-1]["choices"][0]["finish_reason"] == "abort"
    assert all(e["choices"][0]["finish_reason"] is None for e in outputs[:-1])
    made = len(_tokens(outputs))
    assert 0 < made < 4000 and closing["usage"]["completion_tokens"] == made


async def test_abort_requests_ends_a_whole_response_with_the_tokens_made_so_far(
    http: httpx.AsyncClient,
) -> None:
    body = {"token_ids": await _prompt(http), "sampling_params": LONG}
    call = asyncio.ensure_future(
        http.post(GENERATE, json=body | {"request_id": "long-2"}, timeout=120)
    )
    while not call.done():  # until the request is held (an id not held yet is ignored)
        await http.post(ABORT, json={"request_ids": "generate-tokens-long-2"})  # one, bare
        await asyncio.wait({call}, timeout=0.05)
    doc = call.result().json()
    (choice,) = doc["choices"]
    assert choice["finish_reason"] == "abort" and len(choice["token_ids"]) < 4000
    assert doc["usage"]["completion_tokens"] == len(choice["token_ids"])


async def test_an_abort_without_ids_or_json_is_a_400_and_unknown_ids_are_ignored(
    http: httpx.AsyncClient,
) -> None:
    assert_error(await http.post(ABORT, json={}), 400, "Missing 'request_ids'")
    assert_error(await http.post(ABORT, content=b"{"), 400, "JSON decode error")
    unknown = await http.post(ABORT, json={"request_ids": ["generate-tokens-nobody"]})
    assert unknown.status_code == 200 and unknown.content == b""


KEY_ACME, KEY_RIVAL = "sk-acme-generate-0123456789ab", "sk-rival-generate-0123456789ab"
KEY_METERED = "sk-metered-generate-0123456789ab"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def keyed(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    """A second ingress on the session's bus, with the keys of two tenants."""
    keys = f"acme {KEY_ACME}\nrival {KEY_RIVAL}\nmetered {KEY_METERED} tokens_per_minute=100\n"
    async with keyed_ingress(stack, tmp_path_factory.mktemp("generate"), keys) as ingress:
        yield ingress


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def twin(stack: Stack) -> AsyncIterator[Stack]:
    """A second keyless ingress on the session's bus, as a load balancer's other replica."""
    ingress = await start_stack(stack.settings.nats, stack.settings, ["ingress"])
    yield ingress
    await ingress.close()


async def test_an_abort_ends_only_its_tenants_request_of_that_id(
    http: httpx.AsyncClient, keyed: Stack
) -> None:
    """rival aborts the id acme's request answers under too (rival's own request has it):
    rival's ends, and acme's, running meanwhile, runs to its length (2 s of output)."""
    async with httpx.AsyncClient(base_url=keyed.url, timeout=60) as other:
        body = {"token_ids": await _prompt(http), "stream": True}
        long_enough = {"max_tokens": 2000, "ignore_eos": True}
        acme = await _opened(other, body | {"sampling_params": long_enough}, "same", KEY_ACME)
        rival = await _opened(other, body | {"sampling_params": LONG}, "same", KEY_RIVAL)
        by_rival = {"request_ids": ["generate-tokens-same"]}
        aborted = await other.post(ABORT, json=by_rival, headers=_key(KEY_RIVAL))
        assert aborted.status_code == 200
        assert (await _rest(*rival))[-1]["choices"][0]["finish_reason"] == "abort"
        acme_outputs = await _rest(*acme)
        assert acme_outputs[-1]["choices"][0]["finish_reason"] == "length"
        assert len(_tokens(acme_outputs)) == 2000
        assert_error(await other.post(ABORT, json=by_rival), 401)  # no key: nobody's


async def test_an_abort_posted_to_another_ingress_ends_the_request(
    http: httpx.AsyncClient, twin: Stack
) -> None:
    body = {"token_ids": await _prompt(http), "stream": True, "sampling_params": LONG}
    mine = await _opened(http, body, "mine")
    async with httpx.AsyncClient(base_url=twin.url, timeout=60) as other:
        aborted = await other.post(ABORT, json={"request_ids": ["generate-tokens-mine"]})
        assert aborted.status_code == 200
    assert (await _rest(*mine))[-1]["choices"][0]["finish_reason"] == "abort"


async def test_a_generate_stream_resumes_after_the_events_its_client_has(
    http: httpx.AsyncClient,
) -> None:
    """`GET /v1/streams/{id}` with `Last-Event-ID`: the rest of a generate stream, read back
    from the ledger, as for any stream."""
    body = {"token_ids": await _prompt(http), "stream": True,
            "sampling_params": {"max_tokens": 12, "temperature": 0},
            "stream_options": {"include_usage": True}}  # fmt: skip
    resp = await http.post(GENERATE, json=body)
    whole = _events(resp.text)
    stream_id = resp.headers["x-tokenway-stream-id"]
    resumed = await http.get(f"/v1/streams/{stream_id}", headers={"Last-Event-ID": "2"})
    assert resumed.status_code == 200, resumed.text
    assert _events(resumed.text) == whole[2:]


async def test_a_tenants_token_limit_charges_a_generate_request_as_any(
    http: httpx.AsyncClient, keyed: Stack
) -> None:
    """Its prompt and budget against the tenant's tokens per minute: within them it runs,
    past them a 429 that says when, and no budget at all (the context) a 400."""
    ids = await _prompt(http)
    async with httpx.AsyncClient(base_url=keyed.url, timeout=60,
                                 headers=_key(KEY_METERED)) as metered:  # fmt: skip
        small = {"token_ids": ids, "sampling_params": {"max_tokens": 60}}  # 64 of 100
        assert (await metered.post(GENERATE, json=small)).status_code == 200
        refused = await metered.post(GENERATE, json=small)
        assert_error(refused, 429, "100 tokens per minute")
        assert int(refused.headers["retry-after"]) >= 1
        endless = {"token_ids": ids, "sampling_params": {}}
        assert_error(await metered.post(GENERATE, json=endless), 400, "needs")
