"""Header names and the `Tw-Stream-State` codec. Only this package spells header names."""

from __future__ import annotations

import base64
import binascii

import msgspec

from tokenway.wire import StreamState

MSG_ID = "Nats-Msg-Id"
RID = "Tw-Rid"
SEQ = "Tw-Seq"
ATTEMPT = "Tw-Attempt"
STREAM_STATE = "Tw-Stream-State"
TOKENS = "Tw-Tokens"
DEADLINE = "Tw-Deadline"
REPLY = "Tw-Reply"
KIND = "Tw-Kind"
STATUS = "Tw-Status"
TRACEPARENT = "traceparent"

# Set by the server on republished messages.
STREAM_SEQUENCE = "Nats-Sequence"

# Output kinds on TW_OUT (the `Tw-Kind` header).
KIND_CHUNK = "chunk"  # stream chunk(s); more follow
KIND_END = "end"  # last stream chunk(s); the client then gets [DONE]
KIND_RESPONSE = "response"  # a complete non-streaming response body
KIND_ERROR = "error"  # an OpenAI error body; `Tw-Status` holds the HTTP status

# A state is a few hundred bytes; anything far above that is tampering or a bug.
MAX_STATE_BYTES = 16 * 1024

_state_encoder = msgspec.msgpack.Encoder()
_state_decoder = msgspec.msgpack.Decoder(StreamState)


class StateError(ValueError):
    """A `Tw-Stream-State` that cannot be decoded or is out of bounds."""


def encode_state(state: StreamState) -> str:
    return base64.urlsafe_b64encode(_state_encoder.encode(state)).rstrip(b"=").decode()


def state_problem(state: StreamState) -> str | None:
    """What makes a decoded state impossible (offsets outside the window, negative values)."""
    d = state.detok
    if not 0 <= d.prefix_offset <= d.read_offset <= len(d.tokens):
        return (
            f"stream_state offsets {d.prefix_offset}/{d.read_offset} do not fit a window of "
            f"{len(d.tokens)} tokens"
        )
    if any(t < 0 for t in d.tokens) or state.completion_tokens < 0:
        return "stream_state holds negative values"
    return None


def decode_state(text: str) -> StreamState:
    if len(text) > MAX_STATE_BYTES:
        raise StateError(f"stream_state is {len(text)} bytes, over the {MAX_STATE_BYTES} limit")
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        state = _state_decoder.decode(raw)
    except (binascii.Error, msgspec.DecodeError) as exc:
        raise StateError(f"malformed stream_state: {exc}") from exc
    problem = state_problem(state)
    if problem:
        raise StateError(problem)
    return state


def encode_tokens(token_ids: list[int]) -> str:
    """`Tw-Tokens`: the chunk's output token IDs, comma separated (readable in `nats sub`)."""
    return ",".join(map(str, token_ids))


def decode_tokens(text: str) -> list[int]:
    return [int(t) for t in text.split(",")] if text else []
