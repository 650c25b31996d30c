"""CORS: browsers of the origins `--allowed-origins` names may call the API (the key still
asked for); every other origin, and every origin by default, gets no cross-origin access."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import msgspec
import pytest
import pytest_asyncio

from tests.conftest import Stack, start_stack
from tests.ingress.test_auth import KEY_DEFAULT

APP = "https://app.example"
PREFLIGHT = {
    "Origin": APP,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization,content-type,x-request-id",
}
BODY = {"model": "deepseek-v4", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def browsed(stack: Stack) -> AsyncIterator[Stack]:
    """A second ingress that lets one origin in, with a key, on the session pipeline's bus."""
    settings = msgspec.structs.replace(
        stack.settings, api_key=KEY_DEFAULT, allowed_origins=f'["{APP}"]'
    )
    ingress = await start_stack(stack.settings.nats, settings, ["ingress"])
    yield ingress
    await ingress.close()


async def test_an_allowed_origin_is_preflighted_without_a_key_then_served_with_one(
    browsed: Stack,
) -> None:
    async with httpx.AsyncClient(base_url=browsed.url, timeout=30) as http:
        preflight = await http.options("/v1/chat/completions", headers=PREFLIGHT)
        assert preflight.status_code == 200, preflight.text
        assert preflight.headers["access-control-allow-origin"] == APP
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        keyless = await http.post("/v1/chat/completions", json=BODY, headers={"Origin": APP})
        assert keyless.status_code == 401
        auth = {"Origin": APP, "Authorization": f"Bearer {KEY_DEFAULT}", "X-Request-Id": "b-1"}
        async with http.stream(
            "POST", "/v1/chat/completions", json={**BODY, "stream": True}, headers=auth
        ) as served:
            text = (await served.aread()).decode()
    assert served.status_code == 200 and text.endswith("data: [DONE]\n\n")
    assert served.headers["access-control-allow-origin"] == APP
    exposed = served.headers["access-control-expose-headers"].lower()
    assert "x-request-id" in exposed and "x-tokenway-stream-id" in exposed
    assert served.headers["x-request-id"] == "b-1"


async def test_another_origin_gets_no_access(browsed: Stack) -> None:
    other = {**PREFLIGHT, "Origin": "https://evil.example"}
    async with httpx.AsyncClient(base_url=browsed.url, timeout=30) as http:
        preflight = await http.options("/v1/chat/completions", headers=other)
        models = await http.get("/v1/models", headers={"Origin": "https://evil.example"})
    assert preflight.status_code == 400
    assert "access-control-allow-origin" not in preflight.headers
    assert "access-control-allow-origin" not in models.headers


async def test_by_default_no_origin_gets_access(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        preflight = await http.options("/v1/chat/completions", headers=PREFLIGHT)
        models = await http.get("/v1/models", headers={"Origin": APP})
    assert "access-control-allow-origin" not in preflight.headers
    assert "access-control-allow-origin" not in models.headers
