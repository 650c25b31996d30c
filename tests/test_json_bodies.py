"""A JSON body that is not valid JSON gets a 400 that says what is wrong with it, and where,
on every JSON route."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import Stack

pytestmark = pytest.mark.asyncio(loop_scope="session")

# Raw bytes: a JSON encoder would never write a lone surrogate's escape.
LONE = rb"\ud800"
CHAT = rb'{"model":"deepseek-v4","messages":[{"role":"user","content":"\ud800"}]}'
ROUTES = [
    ("/v1/chat/completions", CHAT, "messages[0].content"),
    ("/v1/completions", rb'{"model":"deepseek-v4","prompt":"a\ud800b"}', "prompt"),
    ("/v1/responses", rb'{"model":"deepseek-v4","input":"\ud800"}', "input"),
    ("/v1/messages", rb'{"model":"deepseek-v4","max_tokens":8,'
     rb'"messages":[{"role":"user","content":"\ud800"}]}', "messages[0].content"),
    ("/v1/messages/count_tokens", rb'{"model":"deepseek-v4",'
     rb'"messages":[{"role":"user","content":"\ud800"}]}', "messages[0].content"),
    ("/tokenize", rb'{"model":"deepseek-v4","prompt":"\ud800"}', "prompt"),
    ("/detokenize", rb'{"model":"deepseek-v4","tokens":[1],"\ud800":1}', None),
    ("/v1/chat/completions/render", CHAT, "messages[0].content"),
    ("/v1/completions/render", rb'{"model":"deepseek-v4","prompt":"a\ud800b"}', "prompt"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param"), ROUTES, ids=[r[0] for r in ROUTES])
async def test_a_lone_surrogate_escape_is_a_400_naming_it_and_where(
    stack: Stack, path: str, body: bytes, param: str | None
) -> None:
    """msgspec reads a high surrogate's escape without its low half at the end of a string
    as "Input data was truncated": the client was told its body was cut short."""
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        resp = await http.post(path, content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    message = error["message"]
    assert "truncated" not in message
    assert "lone UTF-16 surrogate" in message and "\\ud800" in message
    assert f"at byte {body.index(LONE)}" in message
    if param is not None:
        assert f"in {param}" in message
    if "messages" not in path:  # Anthropic's error shape has no param
        assert error["param"] == param


async def test_a_low_surrogate_alone_or_a_pair_out_of_order_says_the_same(stack: Stack) -> None:
    for escape in (rb"\udc00", rb"\ud800\ud800", rb"\ud800\n"):
        body = rb'{"model":"deepseek-v4","prompt":"x' + escape + rb'y"}'
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
            resp = await http.post("/v1/completions", content=body,
                                   headers={"content-type": "application/json"})  # fmt: skip
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert "lone UTF-16 surrogate" in error["message"], escape
        assert error["param"] == "prompt"


async def test_a_surrogate_pair_and_an_escaped_backslash_are_taken(stack: Stack) -> None:
    """What looks like a lone surrogate but is not one: a pair, or `\\\\ud800` (a backslash
    and the text `ud800`)."""
    for text in (rb"\ud83d\ude00", rb"\\ud800"):
        body = rb'{"model":"deepseek-v4","prompt":"' + text + rb'","max_tokens":2}'
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
            resp = await http.post("/v1/completions", content=body,
                                   headers={"content-type": "application/json"})  # fmt: skip
        assert resp.status_code == 200, resp.text
