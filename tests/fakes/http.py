"""ASGI plumbing the fake servers share: their listening socket, reading a request body,
answering with bytes or JSON, and a uvicorn server that leaves the process's signals to the
test that runs it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import msgspec
import uvicorn


def listening_socket(port: int = 0) -> socket.socket:
    """A listening socket on 127.0.0.1 (a free port by default): connections queue from now
    on, before uvicorn accepts them."""
    # IPPROTO_TCP named: asyncio then sets TCP_NODELAY on accepted connections (with proto
    # 0 it does not, and Nagle against delayed ACKs costs each answer 40 ms).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


class QuietServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # tests own the process's signals


def serve(app: Any, port: int = 0) -> tuple[str, QuietServer, asyncio.Task[None]]:
    """uvicorn serving `app` on 127.0.0.1 (a free port by default) in a task of the running
    loop, quietly; its URL. Connections queue on the bound socket until uvicorn accepts
    them: nothing to wait for."""
    sock = listening_socket(port)
    host, bound = sock.getsockname()[:2]
    config = uvicorn.Config(
        app, interface="asgi3", http="h11", lifespan="off", log_config=None,
        log_level="warning", access_log=False, timeout_graceful_shutdown=2,
    )  # fmt: skip
    server = QuietServer(config)
    return f"http://{host}:{bound}", server, asyncio.create_task(server.serve(sockets=[sock]))


async def read_body(receive: Any) -> bytes:
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(parts)


async def send_body(send: Any, status: int, body: bytes, content_type: bytes) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Any, status: int, doc: object) -> None:
    await send_body(send, status, msgspec.json.encode(doc), b"application/json")
