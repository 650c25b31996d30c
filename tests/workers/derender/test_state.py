"""`stream_state` as derender reads it from the wire: round trips, and refuses forgeries."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenway.errors import InvalidRequest
from tokenway.wire import OutputContext
from workers.derender import state as states
from workers.derender.state import MAX_WINDOW_TOKENS, DetokState, StreamState

VOCAB = 129280
CTX = OutputContext(api="completion")


@st.composite
def valid_states(draw: st.DrawFn) -> StreamState:
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), max_size=20))
    read = draw(st.integers(0, len(tokens)))
    return StreamState(
        detok=DetokState(tokens=tokens, prefix_offset=draw(st.integers(0, read)), read_offset=read),
        completion_tokens=draw(st.integers(0, 1 << 40)),
        role_sent=draw(st.booleans()),
    )


@settings(max_examples=60, deadline=None)
@given(state=valid_states())
def test_a_state_round_trips(state: StreamState) -> None:
    assert states.decode(states.encode(state), VOCAB, CTX) == state


def test_a_typical_state_is_a_few_dozen_bytes() -> None:
    state = StreamState(
        detok=DetokState(tokens=[6366, 223, 128822], prefix_offset=1, read_offset=3),
        completion_tokens=12,
        role_sent=True,
    )
    assert len(states.encode(state)) < 32


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xc1",  # a byte msgpack never uses
        msgspec.msgpack.encode({"detok": [1]}),  # a map, not the array layout
        msgspec.msgpack.encode([["x"], 0, 0]),  # wrong field types
        msgspec.msgpack.encode(7),
    ],
    ids=["empty", "reserved-byte", "map", "types", "int"],
)
def test_garbage_is_invalid_request(raw: bytes) -> None:
    with pytest.raises(InvalidRequest, match="malformed") as info:
        states.decode(raw, VOCAB, CTX)
    assert info.value.param == "stream_state"


def test_truncated_or_padded_bytes_are_invalid_request() -> None:
    raw = states.encode(
        StreamState(detok=DetokState(tokens=[1, 2], prefix_offset=0, read_offset=2))
    )
    for cut in range(len(raw)):
        with pytest.raises(InvalidRequest):
            states.decode(raw[:cut], VOCAB, CTX)
    with pytest.raises(InvalidRequest):
        states.decode(raw + b"\x00", VOCAB, CTX)


@pytest.mark.parametrize(
    "window",
    [
        DetokState(tokens=[-1], prefix_offset=0, read_offset=1),
        DetokState(tokens=[VOCAB], prefix_offset=0, read_offset=1),
        DetokState(tokens=[6366], prefix_offset=0, read_offset=9),
        DetokState(tokens=[6366, 223], prefix_offset=2, read_offset=1),
        DetokState(tokens=[6366] * (MAX_WINDOW_TOKENS + 1), prefix_offset=0, read_offset=1),
    ],
    ids=["negative-token", "outside-vocab", "offset-past-window", "prefix-after-read", "huge"],
)
def test_an_impossible_state_is_invalid_request(window: DetokState) -> None:
    with pytest.raises(InvalidRequest) as info:
        states.decode(states.encode(StreamState(detok=window)), VOCAB, CTX)
    assert info.value.param == "stream_state"


def test_a_finished_state_is_invalid_request() -> None:
    raw = states.encode(StreamState(detok=DetokState([], 0, 0), finished=True))
    with pytest.raises(InvalidRequest, match="finished"):
        states.decode(raw, VOCAB, CTX)
