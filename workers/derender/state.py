"""`stream_state`: everything a chunk needs from the past, small and bounded.

Only derender reads it. Everyone else (the owner, the ledger, the `Tw-Stream-State`
header) carries it as opaque bytes, so its shape can change with derender alone.
"""

from __future__ import annotations

import msgspec
from msgspec import Struct

from tokenway.errors import InvalidRequest

MAX_WINDOW_TOKENS = 512


class DetokState(Struct, array_like=True):
    """The incremental detokenizer's bounded window (vLLM's prefix/read offsets)."""

    tokens: list[int]
    prefix_offset: int
    read_offset: int


class StreamState(Struct, array_like=True, omit_defaults=True):
    detok: DetokState
    completion_tokens: int = 0
    role_sent: bool = False
    finished: bool = False


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StreamState)


def encode(state: StreamState) -> bytes:
    return _encoder.encode(state)


def decode(raw: bytes, vocab_size: int) -> StreamState:
    """A state from the wire; refuse one that no derender could have produced."""
    try:
        state = _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"malformed stream_state: {exc}", param="stream_state") from exc
    problem = _problem(state, vocab_size)
    if problem:
        raise InvalidRequest(problem, param="stream_state")
    return state


def _problem(state: StreamState, vocab_size: int) -> str | None:
    d = state.detok
    if state.finished:
        return "stream_state belongs to a finished stream"
    if len(d.tokens) > MAX_WINDOW_TOKENS:
        return f"stream_state window of {len(d.tokens)} tokens is over {MAX_WINDOW_TOKENS}"
    if not 0 <= d.prefix_offset <= d.read_offset <= len(d.tokens):
        return (
            f"stream_state offsets {d.prefix_offset}/{d.read_offset} do not fit a window of "
            f"{len(d.tokens)} tokens"
        )
    if any(not 0 <= t < vocab_size for t in d.tokens) or state.completion_tokens < 0:
        return "stream_state holds values out of range"
    return None
