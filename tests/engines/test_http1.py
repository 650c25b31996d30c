"""The bridges' lean HTTP/1.1 client against a real socket server that answers scripted bytes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
import pytest_asyncio
import uvloop

from engines import http1
from engines.http1 import ConnectFailed, Http1Client, TransportError

pytestmark = pytest.mark.asyncio(loop_scope="session")

SSE = b'data: {"a": 1}\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n'


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def response(body: bytes, *head: bytes, status: bytes = b"200 OK") -> bytes:
    return b"\r\n".join([b"HTTP/1.1 " + status, *head, b"", b""]) + body


@dataclass
class Server:
    """Answers each request with the next scripted reply (bytes; `None`: say nothing), then
    closes the connection if the script says so."""

    replies: list[tuple[bytes | None, bool]] = field(default_factory=list)
    requests: list[bytes] = field(default_factory=list)
    connections: int = 0
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # a client closed on us
    received: asyncio.Event = field(default_factory=asyncio.Event)  # a request was read
    url: str = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                self.requests.append(head + await reader.readexactly(length))
                self.received.set()
                reply, close = self.replies.pop(0)
                if reply is not None:
                    writer.write(reply)
                    await writer.drain()
                if close:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed.set()


@pytest_asyncio.fixture(loop_scope="session")
async def server() -> AsyncIterator[Server]:
    s = Server()
    listener = await asyncio.start_server(s.handle, "127.0.0.1", 0)
    s.url = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    async with listener:
        yield s


async def test_a_chunked_stream_reaches_the_callback_line_by_line(server: Server) -> None:
    server.replies.append((response(chunked(SSE[:9], SSE[9:30], SSE[30:]),
                                    b"Transfer-Encoding: chunked"), False))  # fmt: skip
    lines: list[bytes] = []
    client = Http1Client(server.url, connect_timeout=5)
    resp = await client.request("POST", "/g", b'{"x": 1}', on_line=lines.append)
    assert resp.status == 200 and resp.body == b""
    assert lines == [b'data: {"a": 1}', b"", b'data: {"b": 2}', b"", b"data: [DONE]", b""]
    request = server.requests[0]
    assert request.startswith(b"POST /g HTTP/1.1\r\nHost: 127.0.0.1:")
    assert request.endswith(b'Content-Length: 8\r\n\r\n{"x": 1}')


async def test_any_split_of_the_bytes_across_reads_parses_the_same(server: Server) -> None:
    """A read may end anywhere: inside the head, a chunk size, a chunk, its CRLF, a line."""
    wire = response(chunked(SSE[:20], SSE[20:]), b"Transfer-Encoding: chunked", b"X-A: b")
    server.replies += [(response(b"", b"Content-Length: 0"), False), (None, False)]
    client = Http1Client(server.url, connect_timeout=5)
    await client.request("GET", "/warm")  # a kept connection, to feed by hand
    conn = client.idle[-1]
    lines: list[bytes] = []
    call = asyncio.ensure_future(client.request("GET", "/s", on_line=lines.append))
    await asyncio.sleep(0)  # the call takes the idle connection and sends on it
    assert conn.exchange is not None
    for i in range(len(wire)):
        conn.data_received(wire[i : i + 1])
    resp = await call
    assert resp.headers["x-a"] == "b"
    assert lines == [line for line in SSE.split(b"\n")[:-1]]


async def test_a_kept_connection_serves_the_next_request(server: Server) -> None:
    server.replies += [(response(b"one", b"Content-Length: 3"), False)] * 2
    client = Http1Client(server.url, connect_timeout=5)
    assert (await client.request("POST", "/a")).body == b"one"
    assert (await client.request("POST", "/b")).body == b"one"
    assert server.connections == 1


async def test_an_idle_connection_past_its_reuse_window_is_not_used(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http1, "IDLE_REUSE", 0.0)
    server.replies += [(response(b"one", b"Content-Length: 3"), False)] * 2
    client = Http1Client(server.url, connect_timeout=5)
    await client.request("POST", "/a")
    await client.request("POST", "/b")
    assert server.connections == 2


async def test_connection_close_and_a_body_to_the_close_are_not_reused(server: Server) -> None:
    server.replies += [
        (response(b"closing", b"Content-Length: 7", b"Connection: close"), True),
        (response(b"to the end"), True),
        (response(b"", b"Content-Length: 0"), False),
    ]
    client = Http1Client(server.url, connect_timeout=5)
    assert (await client.request("GET", "/a")).body == b"closing"
    assert (await client.request("GET", "/b")).body == b"to the end"
    await client.request("GET", "/c")
    assert server.connections == 3


async def test_an_error_status_keeps_its_body_whole_for_the_message(server: Server) -> None:
    body = b'{"error": {"message": "no"}}\n'
    server.replies.append((response(body, b"Content-Length: %d" % len(body),
                                    status=b"404 Not Found"), False))  # fmt: skip
    lines: list[bytes] = []
    resp = await Http1Client(server.url, connect_timeout=5).request(
        "POST", "/g", on_line=lines.append
    )
    assert (resp.status, resp.body, lines) == (404, body, [])


async def test_a_connection_lost_mid_body_raises(server: Server) -> None:
    server.replies.append((response(b"data: 1\n", b"Transfer-Encoding: chunked")[:-2], True))
    lines: list[bytes] = []
    client = Http1Client(server.url, connect_timeout=5)
    with pytest.raises(TransportError, match="closed before the response ended"):
        await client.request("POST", "/g", on_line=lines.append)
    assert client.idle == []


async def test_what_the_callback_raises_ends_the_call_and_its_connection(
    server: Server,
) -> None:
    server.replies.append((response(chunked(SSE), b"Transfer-Encoding: chunked"), False))

    def refuse(line: bytes) -> None:
        raise ValueError(f"bad line {line!r}")

    client = Http1Client(server.url, connect_timeout=5)
    with pytest.raises(ValueError, match="bad line"):
        await client.request("POST", "/g", on_line=refuse)
    await server.closed.wait()
    assert client.idle == []


async def test_cancelling_a_call_closes_its_connection(server: Server) -> None:
    server.replies.append((None, False))  # never answers
    client = Http1Client(server.url, connect_timeout=5)
    call = asyncio.ensure_future(client.request("POST", "/g"))
    await server.received.wait()
    call.cancel()
    await server.closed.wait()
    assert call.cancelled() and client.idle == []


async def test_a_refused_connection_raises_connect_failed() -> None:
    listener = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    listener.close()
    await listener.wait_closed()
    with pytest.raises(ConnectFailed) as info:
        await Http1Client(f"http://127.0.0.1:{port}", connect_timeout=5).request("GET", "/")
    assert not info.value.timed_out


async def test_a_response_that_is_not_http_raises(server: Server) -> None:
    server.replies.append((b"SSH-2.0-OpenSSH\r\n\r\n", False))
    with pytest.raises(TransportError, match="not an HTTP"):
        await Http1Client(server.url, connect_timeout=5).request("GET", "/")


async def test_the_client_works_on_uvloop_as_the_stages_run_it(server: Server) -> None:
    """uvloop hands over a new connection before calling `connection_made`."""
    server.replies += [(response(chunked(SSE), b"Transfer-Encoding: chunked"), False)] * 2

    async def twice() -> list[bytes]:
        client = Http1Client(server.url, connect_timeout=5)
        lines: list[bytes] = []
        await client.request("POST", "/a", on_line=lines.append)
        await client.request("POST", "/b", on_line=lines.append)  # the kept connection
        return lines

    lines = await asyncio.to_thread(uvloop.run, twice())
    assert lines == SSE.split(b"\n")[:-1] * 2 and server.connections == 1
