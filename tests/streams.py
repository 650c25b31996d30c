"""A streaming client for fault tests: what arrived, when, and the resume after a lost ingress.

It asks for `id:` lines (`X-Tokenway-Event-Ids`), so that every `data:` event carries its
number across a resume: a gap or a duplicate shows in `ids`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from tokenway.aio import Signal

IDS = {"X-Tokenway-Event-Ids": "1"}


@dataclass
class Streamed:
    """One SSE stream as the client saw it, across a resume on another ingress."""

    rid: str = ""
    raw: bytes = b""
    times: list[float] = field(default_factory=list)  # when each complete event arrived
    started: float = 0.0
    cut: bool = False  # the connection broke before the end

    def events(self) -> list[str]:
        """Complete events (a cut connection may leave half of one)."""
        text = self.raw.decode(errors="replace")
        whole = text if text.endswith("\n\n") else text.rsplit("\n\n", 1)[0] + "\n\n"
        return [e for e in whole.split("\n\n") if e]

    @property
    def ids(self) -> list[int]:
        return [int(e.split("\n", 1)[0][4:]) for e in self.events() if e.startswith("id: ")]

    @property
    def docs(self) -> list[dict]:
        return [json.loads(e.split("data: ", 1)[1]) for e in self.events() if "data: {" in e]

    @property
    def done(self) -> int:
        return sum(e.endswith("data: [DONE]") for e in self.events())

    @property
    def text(self) -> str:
        return "".join(c.get("text", "") for d in self.docs for c in d.get("choices", []))

    @property
    def usage(self) -> dict | None:
        return next((d["usage"] for d in reversed(self.docs) if d.get("usage")), None)

    @property
    def error(self) -> dict | None:
        return next((d["error"] for d in self.docs if "error" in d), None)

    @property
    def longest_wait(self) -> float:
        """The longest the client waited for an event, from the request on."""
        marks = [self.started, *self.times]
        return max(b - a for a, b in itertools.pairwise(marks)) if self.times else 0.0

    def keep_complete(self) -> int:
        """Drop a half-received event; the id of the last complete one (for Last-Event-ID)."""
        self.raw = "".join(e + "\n\n" for e in self.events()).encode()
        return self.ids[-1] if self.ids else 0


async def read(resp: httpx.Response, out: Streamed, progress: Signal | None) -> None:
    async for part in resp.aiter_bytes():
        out.raw += part
        out.times += [time.monotonic()] * part.count(b"\n\n")
        if progress is not None:
            progress.fire()


async def post(
    http: httpx.AsyncClient, url: str, body: dict, out: Streamed, progress: Signal | None = None
) -> Streamed:
    """POST a streaming completion; a connection that breaks marks the stream `cut`."""
    out.started = time.monotonic()
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body, headers=IDS) as resp:
            assert resp.status_code == 200, (await resp.aread()).decode()
            out.rid = resp.headers["x-tokenway-stream-id"]
            await read(resp, out, progress)
    except httpx.TransportError:
        out.cut = True
    return out


async def resume(http: httpx.AsyncClient, url: str, out: Streamed) -> Streamed:
    """Fetch the rest of a cut stream from another ingress, from its last complete event."""
    last = out.keep_complete()
    headers = {"Last-Event-ID": str(last), **IDS}
    async with http.stream("GET", f"{url}/v1/streams/{out.rid}", headers=headers) as resp:
        assert resp.status_code == 200, (await resp.aread()).decode()
        out.cut = False
        await read(resp, out, None)
    return out


async def until(progress: Signal, condition: Callable[[], bool], timeout: float = 60) -> None:
    """Until `condition()` holds, checked whenever a stream makes progress."""
    async with asyncio.timeout(timeout):
        while True:
            waiter = progress.waiter()
            if condition():
                return
            await waiter.wait()
