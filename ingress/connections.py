"""What a connection may hold before its request is in: a deadline for the request head, a cap
on its size, and a cap on the connections one client address keeps open.

uvicorn (0.55) times out only a keep-alive connection idle between two requests: one that
sends a request head a byte at a time is held for as long as its bytes keep coming, and one
that sends nothing at all for ever, so a few hundred of them hold the ingress's sockets at no
cost to their sender. `GuardedProtocol` is uvicorn's httptools protocol (the one
`uvicorn[standard]` runs) with a timer from the start of each request head (or the opening of
the connection) to its end: a head not all there by then is answered 408 and the connection
closed. And `Guard` counts each address's open connections: one past the cap is answered
429 once its head is in, without reaching the app, and closed; it gets `OVER_CAP_HEAD`
seconds for that head, so that an address cannot hold more by opening faster than heads
time out. uvicorn also reads a head of any size (a 64 MB header was held whole): past
`--max-header-bytes` of request line and headers, the head is answered 431 and closed.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import MutableMapping
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ingress.completions import Receive, Reply, Send
from tokenway.errors import BodyTimeout, HeadTooLarge, RateLimited, TokenwayError, error_body

# An honest client sends its head as it connects: a second is room enough to hear its 429.
OVER_CAP_HEAD = 1.0


class Guard:
    """The limits every connection of one server shares, and its count per address."""

    def __init__(self, header_timeout: float, per_address: int, max_head_bytes: int) -> None:
        self.header_timeout = header_timeout
        self.per_address = per_address  # 0: no cap
        self.max_head_bytes = max_head_bytes
        self.open: Counter[str] = Counter()


class _Refused(Exception):
    """Raised from a parser callback to stop reading a head that was answered already."""


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's protocol for one connection, with `guard`'s head deadline and cap."""

    def __init__(self, *args: Any, guard: Guard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard
        self.head_timeout = guard.header_timeout
        self.head_timer: asyncio.TimerHandle | None = None  # armed while a head comes in
        self.head_bytes = 0  # of the head coming in: its request line and headers so far
        self.refused = False  # its head was answered and the connection closed
        self.counted: str | None = None  # the address this connection counts against

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        address = self.client[0] if self.client else None
        cap = self.guard.per_address
        if address is not None and cap and self.guard.open[address] >= cap:
            self.app = _refusal(address, cap)  # every request on it, instead of the API
            self.head_timeout = min(self.head_timeout, OVER_CAP_HEAD)
        elif address is not None and cap:
            self.guard.open[address] += 1
            self.counted = address
        self._head_begins()  # a connection that sends nothing is a head that never ends

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_ends()
        if self.counted is not None:
            self.guard.open[self.counted] -= 1
            if not self.guard.open[self.counted]:
                del self.guard.open[self.counted]
            self.counted = None
        super().connection_lost(exc)

    def on_message_begin(self) -> None:  # a head's first byte (the first request's: armed)
        super().on_message_begin()
        self.head_bytes = 0
        self._head_begins()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value))
        super().on_header(name, value)

    def _count(self, size: int) -> None:
        self.head_bytes += size
        if self.head_bytes > self.guard.max_head_bytes:
            self._head_ends()
            self._close_with(
                b"431 Request Header Fields Too Large",
                HeadTooLarge(
                    f"the request head is over {self.guard.max_head_bytes} bytes "
                    "(--max-header-bytes)"
                ),
            )
            raise _Refused  # no more of it is read

    def send_400_response(self, msg: str) -> None:
        if not self.refused:  # uvicorn's answer to the parser stopping: ours went already
            super().send_400_response(msg)

    def on_headers_complete(self) -> None:
        self._head_ends()
        super().on_headers_complete()

    def _head_begins(self) -> None:
        if self.head_timer is None:
            self.head_timer = self.loop.call_later(self.head_timeout, self._head_late)

    def _head_ends(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_late(self) -> None:
        self.head_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False  # a pipelined head behind a response: closed after it
            return
        if self.transport.is_closing():
            return
        late = BodyTimeout(f"the request head did not arrive within {self.head_timeout:g}s")
        self._close_with(b"408 Request Timeout", late)

    def _close_with(self, status: bytes, error: TokenwayError) -> None:
        """Answer the head with `error` (OpenAI's body) and close the connection."""
        self.refused = True
        body = error_body(error.info())
        self.transport.write(
            b"HTTP/1.1 %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (status, len(body), body)
        )
        self.transport.close()


def _refusal(address: str, cap: int) -> Any:
    """An ASGI app answering every request 429, the connection then closed."""
    busy = RateLimited(
        f"{address} holds {cap} connections to this server already, the most one address may "
        "hold (--max-connections-per-address); send this request on one of those, or again "
        "once one is closed",
        retry_after=1,
    )

    async def refuse(scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        await Reply.error(busy.info(), (b"connection", b"close")).send(send)

    return refuse
