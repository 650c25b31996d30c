"""ASGI plumbing the fake servers share: read a request body, answer with bytes or JSON, and
a uvicorn server that leaves the process's signals to the test that runs it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import msgspec
import uvicorn


class QuietServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # tests own the process's signals


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
