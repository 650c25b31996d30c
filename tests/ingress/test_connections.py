"""Slow clients cannot hold connections: a request head has a deadline, and one address holds
a bounded number of connections."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import msgspec
import pytest
import pytest_asyncio

from tests.conftest import Stack, start_stack

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: tokenway\r\nX-Drip: "  # never ends


async def ingress(stack: Stack, **settings: object) -> Stack:
    """Another ingress on the session stack's bus (its render, schedule and engine serve it)."""
    changed = msgspec.structs.replace(stack.settings, **settings)
    return await start_stack(stack.settings.nats, changed, ["ingress"])


def where(stack: Stack) -> tuple[str, int]:
    url = httpx.URL(stack.url)
    assert url.host and url.port
    return url.host, url.port


@pytest_asyncio.fixture(loop_scope="session")
async def impatient(stack: Stack) -> AsyncIterator[Stack]:
    """An ingress that gives a request head one second."""
    s = await ingress(stack, header_timeout=1.0)
    yield s
    await s.close()


async def until_closed(reader: asyncio.StreamReader) -> bytes:
    """What the server sent before it closed the connection (a reset: what came before)."""
    got = b""
    try:
        while part := await reader.read(65536):
            got += part
    except ConnectionResetError:
        pass
    return got


async def test_dripping_request_heads_are_closed_while_a_calm_client_is_served(
    impatient: Stack,
) -> None:
    """50 connections that send a request head a byte every 0.1 s and never finish it: uvicorn
    held each of them for as long as the bytes came (200 were all open after 45 s)."""
    host, port = where(impatient)
    connected = asyncio.Barrier(51)

    async def drip() -> bytes:
        reader, writer = await asyncio.open_connection(host, port)
        closed = asyncio.ensure_future(until_closed(reader))
        writer.write(HEAD)
        await connected.wait()
        while not closed.done():
            writer.write(b"a")
            await asyncio.wait({closed}, timeout=0.1)  # the drip's pace; it ends on the close
        writer.close()
        return closed.result()

    async with asyncio.timeout(30):  # a safety net: the server closes each one within 1 s
        dripping = asyncio.gather(*(drip() for _ in range(50)))
        await connected.wait()
        async with httpx.AsyncClient(base_url=impatient.url, timeout=30) as http:
            calm = await http.post("/v1/chat/completions", json=CHAT)
        assert calm.status_code == 200, calm.text
        answers = await dripping
    assert len(answers) == 50
    assert all(a == b"" or a.startswith(b"HTTP/1.1 408 ") for a in answers)


async def test_a_head_cut_short_or_never_begun_is_a_408_and_the_connection_closed(
    impatient: Stack,
) -> None:
    host, port = where(impatient)
    for sent in (HEAD, b""):  # a head that stops coming; a connection that sends nothing
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(sent)
        async with asyncio.timeout(30):
            answer = await until_closed(reader)
        writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 "), answer
        assert b"connection: close" in head.lower()
        error = json.loads(body)["error"]
        assert error["message"] == "the request head did not arrive within 1s"
        assert error["type"] == "RequestTimeoutError"


async def request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str = "/health"
) -> tuple[int, dict[str, str], bytes]:
    """One request on a kept-alive connection: status, headers, body."""
    writer.write(f"GET {path} HTTP/1.1\r\nHost: tokenway\r\n\r\n".encode())
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    status, *lines = head.strip().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines)
    body = await reader.readexactly(int(headers.get("content-length", 0)))
    return int(status.split()[1]), headers, body


async def test_the_next_head_on_a_kept_alive_connection_has_the_same_deadline(
    impatient: Stack,
) -> None:
    reader, writer = await asyncio.open_connection(*where(impatient))
    status, _, _ = await request(reader, writer)
    assert status == 200
    writer.write(HEAD)  # the second request's head, never finished
    async with asyncio.timeout(30):
        answer = await until_closed(reader)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 408 "), answer


async def test_an_address_past_its_connections_is_refused_and_others_are_not(
    stack: Stack,
) -> None:
    """Three connections from 127.0.0.1 are all it may hold: a fourth is answered 429 and
    closed (and one that sends nothing is closed within a second), the three go on, another
    address is served, and a closed one frees its place."""
    capped = await ingress(stack, max_connections_per_address=3)
    host, port = where(capped)
    held = [await asyncio.open_connection(host, port) for _ in range(3)]
    try:
        async with asyncio.timeout(30):
            for reader, writer in held:
                assert (await request(reader, writer))[0] == 200
            reader, writer = await asyncio.open_connection(host, port)
            status, headers, body = await request(reader, writer)
            assert status == 429, body
            assert headers["connection"] == "close" and headers["retry-after"] == "1"
            error = json.loads(body)["error"]
            assert "127.0.0.1 holds 3 connections" in error["message"]
            assert "--max-connections-per-address" in error["message"]
            assert error["type"] == "RateLimitError"
            assert await until_closed(reader) == b""
            writer.close()
            # one that sends nothing is not held for --header-timeout (10 s) but a second
            reader, writer = await asyncio.open_connection(host, port)
            assert b"did not arrive within 1s" in await until_closed(reader)
            writer.close()

            for reader, writer in held:  # the three are served as before
                assert (await request(reader, writer))[0] == 200
            other = await asyncio.open_connection(host, port, local_addr=("127.0.0.2", 0))
            assert (await request(*other))[0] == 200
            other[1].close()

            held.pop()[1].close()
            while True:  # until the server has seen it go: then a new one takes its place
                reader, writer = await asyncio.open_connection(host, port)
                status, _, _ = await request(reader, writer)
                writer.close()
                if status == 200:
                    break
                assert status == 429
    finally:
        for _, writer in held:
            writer.close()
        await capped.close()


async def test_a_request_head_over_the_limit_is_a_431_and_closed(stack: Stack) -> None:
    """uvicorn read a request head of any size: a 64 MB header, within the head's deadline,
    held 64 MB of the ingress for one connection. A header that fits is still served."""
    small = await ingress(stack, max_header_bytes=4096)
    try:
        host, port = where(small)
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(
            b"GET /health HTTP/1.1\r\nHost: tokenway\r\nX-Big: " + b"a" * 8192 + b"\r\n\r\n"
        )
        got = await asyncio.wait_for(until_closed(reader), 30)  # a safety net, not a measure
        writer.close()
        status, _, body = got.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 431 "), got[:200]
        error = json.loads(body)["error"]
        assert "4096" in error["message"] and error["code"] == 431
        async with httpx.AsyncClient(base_url=small.url, timeout=30) as http:
            fits = await http.get("/health", headers={"X-Fits": "a" * 2048})
        assert fits.status_code == 200
    finally:
        await small.close()
