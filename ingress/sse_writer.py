"""A stream's committed events as the SSE bytes its client gets."""

from __future__ import annotations

from tokenway import sse
from tokenway.api import anthropic
from tokenway.output_router import Event
from tokenway.wire import Failed


def _error_event(api: str | None, status: int, body: bytes) -> bytes:
    """An error event as the stream's API frames one (`body`: an OpenAI error body)."""
    if api == "messages":
        return sse.named("error", anthropic.error_body(status, body))
    if api == "responses":
        return sse.named("error", body)
    return sse.frame([body])


class SseWriter:
    """One stream's events as SSE bytes: the committed chunk bytes, untouched, then [DONE].

    Its `data:` events are numbered from 1 in the order the client gets them, so a client
    that counted what it received resumes with that count (`Last-Event-ID`), `id:` lines or
    not. Numbering costs a pass over the bytes: it is done only for a client that asked for
    `id:` lines, and while a resume skips what its client already has.
    """

    def __init__(self, ids: bool = False, after: int = 0, api: str | None = None) -> None:
        self.ids = ids
        self.after = after  # events the client has: left out
        self.numbered = 0  # events numbered so far (only while numbering)
        # whose events: a Messages or Responses stream's say their kind and end without
        # [DONE]; None: told by the first chunk (a resume does not know)
        self.api = api

    def write(self, events: list[Event]) -> tuple[bytes, bool]:
        """The events' bytes, and whether they end the stream."""
        out, done = [], False
        for event in events:
            if isinstance(event, Failed):
                framed = _error_event(self.api, event.status, event.payload)
            else:
                self.api = self.api or sse.api_of(event.payload)
                framed = event.payload
            if self.ids or self.numbered < self.after:
                first = self.numbered + 1
                self.numbered += sse.count(framed)
                framed = sse.renumber(framed, first, self.after, self.ids)
            out.append(framed)
            if event.terminal:
                if self.api not in sse.NAMING:
                    out.append(sse.DONE)
                done = True
        return b"".join(out), done
