"""Server-sent-event framing, as vLLM and OpenAI frame it."""

from __future__ import annotations

DONE = b"data: [DONE]\n\n"


def frame(documents: list[bytes]) -> bytes:
    """`data: <json>\\n\\n` per document; the owner frames, the ingress only prefixes the id."""
    return b"".join(b"data: " + doc + b"\n\n" for doc in documents)


def with_id(seq: int | str, framed: bytes) -> bytes:
    return b"id: " + str(seq).encode() + b"\n" + framed
