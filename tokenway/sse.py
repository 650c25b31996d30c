"""Server-sent-event framing, as vLLM and OpenAI frame it: `data: <json>\n\n` events, then
`data: [DONE]\n\n`, nothing else. `id:` lines only for a client that asks for them.
Anthropic's Messages streams name each event (`event: <type>`) and end without [DONE]."""

from __future__ import annotations

DONE = b"data: [DONE]\n\n"
NAMED = b"event: "  # how Anthropic's events begin, and a Responses stream's
NAMING = ("messages", "responses")  # the APIs whose events say their kind
_END = b"\n\n"


def frame(documents: list[bytes]) -> bytes:
    """`data: <json>\n\n` per document; the owner frames, the ingress passes the bytes on."""
    return b"".join(b"data: " + doc + _END for doc in documents)


def api_of(framed: bytes) -> str:
    """Whose events framed bytes hold: a Responses stream's, a Messages stream's, or a chat
    or completion stream's (all framed alike)."""
    if framed.startswith(NAMED + b"response."):
        return "responses"
    return "messages" if framed.startswith(NAMED) else "chat"


def named(kind: str, data: bytes) -> bytes:
    """An event that says its kind (`event: <kind>`), as Anthropic and Responses streams
    frame theirs."""
    return NAMED + kind.encode() + b"\ndata: " + data + _END


def framed(api: str, documents: list[bytes]) -> bytes:
    """A derender result's documents as SSE bytes: a Messages or Responses stream's events
    come framed (`event: <type>` lines name them), the others' are framed here."""
    return b"".join(documents) if api in NAMING else frame(documents)


def count(framed: bytes) -> int:
    """How many events framed bytes hold (JSON escapes newlines: a blank line ends one)."""
    return framed.count(_END)


def renumber(framed: bytes, first: int, skip: int = 0, ids: bool = False) -> bytes:
    """Framed events numbered from `first`: those numbered up to `skip` left out, the others
    with an `id: <number>` line when `ids`."""
    out = []
    for n, event in enumerate(framed.split(_END)[:-1], start=first):
        if n > skip:
            out.append(b"id: %d\n%s\n\n" % (n, event) if ids else event + _END)
    return b"".join(out)
