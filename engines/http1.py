"""A lean HTTP/1.1 client for an engine bridge's calls to its server.

An engine streams each running sequence on a connection of its own, one small chunk per
engine step: at 32 sequences that is 32 reads per step, all in the bridge's event loop. A
general client (httpx over httpcore, h11 and anyio) spends tens of microseconds of Python on
each of them and wakes a task per read. Here a connection is an `asyncio.Protocol`: a read is
parsed where it arrives (status line and headers once, then chunked or sized body framing)
and every body line goes straight to the caller's callback, so a token costs one callback,
no task switch. The caller waits once, for the end of the response.

It speaks what engine servers answer (uvicorn behind vLLM): HTTP/1.1 keep-alive, chunked or
`Content-Length` bodies, or a body that runs to the connection's close. Connections are kept
for reuse for `IDLE_REUSE` seconds, under the keep-alive timeout servers default to (uvicorn:
5 s), so a request is never written to a connection the server is closing.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

IDLE_REUSE = 4.0  # seconds an idle connection is reused; uvicorn closes them at 5 s
MAX_HEAD = 64 * 1024  # bytes of status line and headers before the response is refused

OnLine = Callable[[bytes], None]


class TransportError(Exception):
    """The exchange failed on the wire: the connection ended early, or spoke no HTTP/1.1."""


class ConnectFailed(TransportError):
    """No connection (refused, unreachable, timed out): nothing was sent."""

    def __init__(self, message: str, *, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


@dataclass
class Response:
    status: int
    headers: dict[str, str]  # names lower-cased; a repeated header keeps its last value
    body: bytes  # empty when the body went to the caller's `on_line`


@dataclass
class _Exchange:
    on_line: OnLine | None
    done: asyncio.Future[Response]
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    lines: bytearray = field(default_factory=bytearray)  # a body line not ended yet
    keep_alive: bool = True


# Body framing states.
_HEAD, _SIZE, _DATA, _DATA_END, _TRAILER, _LENGTH, _TO_CLOSE = range(7)


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.state = _HEAD
        self.remaining = 0  # bytes left of a chunk or a sized body
        self.exchange: _Exchange | None = None
        self.closed = False
        self.idle_since = 0.0

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a TCP (or TLS) transport

    def data_received(self, data: bytes) -> None:
        x = self.exchange
        if x is None:
            self._close()  # a server that speaks unasked has lost track of the exchange
            return
        self.buf += data
        try:
            self._parse(x)
        except Exception as exc:  # malformed HTTP, or the caller's callback
            self._fail(x, exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        x, self.exchange = self.exchange, None
        if x is None or x.done.done():
            return
        if self.state == _TO_CLOSE:  # the close is the body's end
            try:
                self._finish(x)
            except Exception as failed:  # the caller's callback
                x.done.set_exception(failed)
            return
        why = f": {exc}" if exc else ""
        x.done.set_exception(TransportError(f"connection closed before the response ended{why}"))

    # -- the exchange -------------------------------------------------------------------

    def send(self, x: _Exchange, request: bytes) -> None:
        assert self.transport is not None
        self.exchange, self.state = x, _HEAD
        self.buf.clear()
        self.transport.write(request)

    def reusable(self, now: float) -> bool:
        return not self.closed and now - self.idle_since < IDLE_REUSE

    def _close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def abandon(self) -> None:
        """The caller stopped waiting: the rest of the response is never read."""
        self.exchange = None
        self._close()

    def _fail(self, x: _Exchange, exc: Exception) -> None:
        self.exchange = None
        self._close()
        if not x.done.done():
            x.done.set_exception(exc)

    def _finish(self, x: _Exchange) -> None:
        self.exchange = None
        if not x.keep_alive or self.buf:  # bytes past the response: not reusable
            self._close()
        if x.lines and x.on_line is not None:  # a last line without its newline
            x.on_line(bytes(x.lines))
        x.done.set_result(Response(x.status, x.headers, bytes(x.body)))

    def _parse(self, x: _Exchange) -> None:
        buf = self.buf
        while buf and self.exchange is x:
            state = self.state
            if state == _HEAD:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD:
                        raise TransportError(f"response head over {MAX_HEAD} bytes")
                    return
                head = bytes(buf[:end])
                del buf[: end + 4]
                self._head(x, head)
            elif state == _SIZE:
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                size = buf[:end].split(b";", 1)[0].strip()
                del buf[: end + 2]
                try:
                    self.remaining = int(size, 16)
                except ValueError:
                    raise TransportError(f"bad chunk size {bytes(size)!r}") from None
                self.state = _DATA if self.remaining else _TRAILER
            elif state == _DATA or state == _LENGTH:
                take = min(self.remaining, len(buf))
                self._body(x, buf[:take])
                del buf[:take]
                self.remaining -= take
                if not self.remaining:
                    if state == _DATA:
                        self.state = _DATA_END
                    else:
                        self._finish(x)
            elif state == _DATA_END:
                if len(buf) < 2:
                    return
                if buf[:2] != b"\r\n":
                    raise TransportError("chunk not followed by CRLF")
                del buf[:2]
                self.state = _SIZE
            elif state == _TRAILER:
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                del buf[: end + 2]
                if end == 0:
                    self._finish(x)
            else:  # _TO_CLOSE
                self._body(x, buf)
                buf.clear()

    def _head(self, x: _Exchange, head: bytes) -> None:
        status_line, *lines = head.split(b"\r\n")
        parts = status_line.split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise TransportError(f"not an HTTP/1.x response: {status_line[:80]!r}")
        status = int(parts[1])
        if 100 <= status < 200:  # 100 Continue and the like: the real head follows
            return
        headers: dict[str, str] = {}
        for line in lines:
            name, _, value = line.partition(b":")
            headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
        x.status, x.headers = status, headers
        if x.on_line is not None and status != 200:
            x.on_line = None  # an error's body is read whole, for its message
        connection = headers.get("connection", "").lower()
        x.keep_alive = parts[0] == b"HTTP/1.1" and "close" not in connection
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self.state = _SIZE
        elif "content-length" in headers:
            self.remaining = int(headers["content-length"])
            self.state = _LENGTH
            if not self.remaining:
                self._finish(x)
        elif status in (204, 304):
            self._finish(x)
        else:
            x.keep_alive = False
            self.state = _TO_CLOSE

    def _body(self, x: _Exchange, data: bytearray) -> None:
        if x.on_line is None:
            x.body += data
            return
        lines = x.lines
        lines += data
        start = 0
        while (end := lines.find(b"\n", start)) >= 0:
            line = bytes(lines[start:end])
            start = end + 1
            x.on_line(line[:-1] if line.endswith(b"\r") else line)
            if self.exchange is not x:  # the callback failed the exchange
                return
        del lines[:start]


class Http1Client:
    """Connections to one server (`http://host:port` or `https://…`), reused while idle."""

    def __init__(self, url: str, *, connect_timeout: float, max_idle: int = 256) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s)://host:port URL: {url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.authority = parts.netloc.rsplit("@", 1)[-1].encode()
        # Built now, not on the event loop: loading the certificate store takes seconds.
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self.idle: list[_Connection] = []

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        *,
        headers: dict[str, str] | None = None,
        on_line: OnLine | None = None,
    ) -> Response:
        """One exchange. With `on_line`, a 200 body goes to it line by line (without the
        line end, as each line arrives) and `Response.body` stays empty; any other status
        keeps its body whole. Cancelling closes the connection."""
        conn = await self._connection()
        loop = asyncio.get_running_loop()
        x = _Exchange(on_line, loop.create_future())
        head = [f"{method} {path} HTTP/1.1".encode(), b"Host: " + self.authority]
        head += [f"{k}: {v}".encode() for k, v in (headers or {}).items()]
        head.append(b"Content-Length: %d" % len(body))
        conn.send(x, b"\r\n".join(head) + b"\r\n\r\n" + body)
        try:
            response = await x.done
        except BaseException:
            conn.abandon()
            raise
        if not conn.closed and len(self.idle) < self.max_idle:
            conn.idle_since = time.monotonic()
            self.idle.append(conn)
        return response

    async def _connection(self) -> _Connection:
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()  # the most recently used: the least likely to expire
            if conn.reusable(now):
                return conn
            conn.abandon()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                transport, conn = await loop.create_connection(
                    _Connection, self.host, self.port, ssl=self.ssl
                )
        except TimeoutError:
            raise ConnectFailed(
                f"no connection within {self.connect_timeout}s", timed_out=True
            ) from None
        except OSError as exc:
            raise ConnectFailed(str(exc) or type(exc).__name__, timed_out=False) from exc
        conn.transport = transport  # uvloop may call connection_made only after this returns
        return conn

    async def aclose(self) -> None:
        idle, self.idle = self.idle, []
        for conn in idle:
            conn.abandon()
