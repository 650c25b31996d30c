"""API keys and tenants: an ingress with keys in front of the session's pipeline, through
the openai SDK and httpx."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import httpx
import msgspec
import openai
import pytest
import pytest_asyncio
from nats.js import JetStreamContext
from nats.js import api as jsapi

from tests.conftest import Stack, start_stack
from tests.ingress.test_auth import KEY_A, KEY_B, KEY_DEFAULT
from tokenway import bus
from tokenway import headers as h

CHAT = [{"role": "user", "content": "Who am I?"}]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def keyed(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    """A second ingress, with keys of three tenants, on the session pipeline's bus."""
    tmp = tmp_path_factory.mktemp("keys")
    key_file = tmp / "keys"
    key_file.write_text(f"# tenant key\nacme {KEY_A}\n\nglobex  {KEY_B}\n")
    settings = msgspec.structs.replace(
        stack.settings, api_key=KEY_DEFAULT, api_key_file=str(key_file), open_routes="ready"
    )
    ingress = await start_stack(stack.settings.nats, settings, ["ingress"])
    yield ingress
    await ingress.close()


def _client(stack: Stack, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0)


pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_a_key_of_any_tenant_is_served(keyed: Stack) -> None:
    for key in (KEY_A, KEY_B, KEY_DEFAULT):
        resp = await _client(keyed, key).chat.completions.create(
            model="deepseek-v4", messages=CHAT, max_tokens=4
        )
        assert resp.choices[0].message.content is not None


@pytest.mark.parametrize("key", ["sk-wrong", KEY_A[:-1], KEY_A + "x"])
async def test_a_wrong_or_missing_key_is_a_401_with_an_openai_body(
    keyed: Stack, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with pytest.raises(openai.AuthenticationError) as raised:
        await _client(keyed, key).chat.completions.create(
            model="deepseek-v4", messages=CHAT, max_tokens=4
        )
    err = raised.value
    assert err.status_code == 401
    assert err.response.headers["www-authenticate"] == "Bearer"
    assert err.body["code"] == "invalid_api_key" and err.body["type"] == "AuthenticationError"
    assert key not in err.body["message"]  # what the client sent is neither echoed nor logged
    assert all(key not in r.getMessage() for r in caplog.records)


async def test_every_route_but_the_open_ones_needs_a_key(keyed: Stack) -> None:
    async with httpx.AsyncClient(base_url=keyed.url) as http:
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/ready")).status_code in (200, 503)  # open: its own answer
        for method, path in [("GET", "/metrics"), ("GET", "/v1/models"),
                             ("GET", "/v1/streams/abc"), ("POST", "/v1/completions"),
                             ("GET", "/v1/chat/completions"), ("GET", "/nowhere")]:  # fmt: skip
            resp = await http.request(method, path, headers={"Authorization": "Basic eDp5"})
            assert resp.status_code == 401, path
            assert resp.json()["error"]["code"] == "invalid_api_key"
        missing = await http.get("/v1/models")
        assert missing.status_code == 401 and "Missing API key" in missing.text
        models = await http.get("/v1/models", headers={"Authorization": f"Bearer {KEY_B}"})
        assert models.json()["data"][0]["id"] == "deepseek-v4"


async def test_refusals_on_a_completion_route_are_counted(keyed: Stack) -> None:
    async with httpx.AsyncClient(base_url=keyed.url) as http:
        await http.post("/v1/completions", json={"prompt": "x"})
        page = await http.get("/metrics", headers={"Authorization": f"Bearer {KEY_A}"})
    assert 'tokenway_requests_total{api="completion",status="401"}' in page.text


async def test_a_stream_resumes_only_for_its_own_tenant(keyed: Stack, stack: Stack) -> None:
    body = {"model": "deepseek-v4", "messages": CHAT, "max_tokens": 6, "stream": True}
    async with httpx.AsyncClient(base_url=keyed.url, timeout=30) as http:
        a = {"Authorization": f"Bearer {KEY_A}"}
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=a) as resp:
            rid = resp.headers["x-tokenway-stream-id"]
            sent = [line async for line in resp.aiter_lines() if line.startswith("data:")]
        path = f"/v1/streams/{rid}"
        mine = await http.get(path, headers={**a, "Last-Event-ID": "1"})
        assert mine.status_code == 200
        assert [x for x in mine.text.splitlines() if x.startswith("data:")] == sent[1:]
        theirs = await http.get(path, headers={"Authorization": f"Bearer {KEY_B}"})
        assert theirs.status_code == 404
        assert theirs.json()["error"]["code"] == "stream_not_found"
    # Without keys, a keyed stream is nobody's: the open ingress does not serve it either.
    async with httpx.AsyncClient(base_url=stack.url) as http:
        assert (await http.get(path)).status_code == 404


@contextlib.asynccontextmanager
async def ledger_of(stack: Stack) -> AsyncIterator[JetStreamContext.PushSubscription]:
    """What is stored in TW_OUT for the ingress's clients from now on."""
    js = stack.ingress.router.nc.jetstream()
    sub = await js.subscribe(bus.out_subject(stack.ingress.ingress_id, "*"), ordered_consumer=True,
                             deliver_policy=jsapi.DeliverPolicy.NEW)  # fmt: skip
    try:
        yield sub
    finally:
        await sub.unsubscribe()


async def test_the_tenant_rides_every_ledger_message_of_its_request(keyed: Stack) -> None:
    async with ledger_of(keyed) as stored:
        await _client(keyed, KEY_B).chat.completions.create(
            model="deepseek-v4", messages=CHAT, max_tokens=3, n=2, stream=True
        )
        tenants, kind = [], None
        while kind != h.KIND_END:
            hdrs = (await stored.next_msg(timeout=10)).headers or {}
            tenants.append(hdrs.get(h.TENANT))
            kind = hdrs.get(h.KIND)
    assert len(tenants) > 1 and set(tenants) == {"globex"}


async def test_an_error_before_the_owner_names_the_tenant_too(keyed: Stack) -> None:
    """Render's refusal (the prompt does not fit) is the tenant's like its output would be."""
    async with ledger_of(keyed) as stored:
        with pytest.raises(openai.BadRequestError):
            await _client(keyed, KEY_A).completions.create(
                model="deepseek-v4", prompt="x", max_tokens=10**9
            )
        msg = await stored.next_msg(timeout=10)
    assert (msg.headers or {}).get(h.KIND) == h.KIND_ERROR
    assert (msg.headers or {}).get(h.TENANT) == "acme"
