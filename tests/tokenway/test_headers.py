"""The `Tw-Stream-State` and `Tw-Tokens` header codecs."""

from __future__ import annotations

import base64

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenway.headers import (
    MAX_STATE_BYTES,
    StateError,
    decode_state,
    decode_tokens,
    encode_state,
    encode_tokens,
)
from tokenway.wire import DetokState, StreamState

token_ids = st.lists(st.integers(0, 2**31 - 1), max_size=40)


@st.composite
def states(draw: st.DrawFn) -> StreamState:
    tokens = draw(token_ids)
    read = draw(st.integers(0, len(tokens)))
    prefix = draw(st.integers(0, read))
    return StreamState(
        detok=DetokState(tokens=tokens, prefix_offset=prefix, read_offset=read),
        completion_tokens=draw(st.integers(0, 1 << 40)),
        role_sent=draw(st.booleans()),
        finished=draw(st.booleans()),
    )


def sample() -> StreamState:
    return StreamState(
        detok=DetokState(tokens=[6366, 223, 128822], prefix_offset=1, read_offset=3),
        completion_tokens=12,
        role_sent=True,
    )


@settings(max_examples=60, deadline=None)
@given(state=states())
def test_a_state_round_trips_through_its_header_text(state: StreamState) -> None:
    text = encode_state(state)
    assert decode_state(text) == state
    assert text.isascii() and "=" not in text
    assert set(text) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def test_a_typical_state_is_small() -> None:
    assert len(encode_state(sample())) < 64


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


@pytest.mark.parametrize(
    "text",
    [
        "",
        "!!!!",
        "not a state at all",
        "A",
        _b64(b"\xc1"),  # a byte msgpack never uses
        _b64(msgspec.msgpack.encode({"detok": [1]})),  # a map, not the array layout
        _b64(msgspec.msgpack.encode([["x"], 0, 0])),  # wrong field types
        _b64(msgspec.msgpack.encode(7)),
    ],
    ids=["empty", "punctuation", "words", "one-char", "reserved-byte", "map", "types", "int"],
)
def test_garbage_is_a_state_error(text: str) -> None:
    with pytest.raises(StateError, match="malformed"):
        decode_state(text)


def test_a_truncated_state_is_a_state_error() -> None:
    text = encode_state(sample())
    for cut in range(len(text)):
        with pytest.raises(StateError):
            decode_state(text[:cut])


def test_a_state_with_trailing_data_is_a_state_error() -> None:
    with pytest.raises(StateError):
        decode_state(encode_state(sample()) + "AAAA")


def test_a_state_with_a_tampered_layout_byte_is_a_state_error() -> None:
    text = encode_state(sample())
    with pytest.raises(StateError):
        decode_state("A" + text[1:])  # the array header becomes an integer


def test_an_oversized_state_is_a_state_error_before_decoding() -> None:
    with pytest.raises(StateError, match=str(MAX_STATE_BYTES)):
        decode_state("A" * (MAX_STATE_BYTES + 1))
    big = StreamState(detok=DetokState(tokens=[2**31 - 1] * 4000, prefix_offset=0, read_offset=1))
    with pytest.raises(StateError, match="limit"):
        decode_state(encode_state(big))


@pytest.mark.parametrize(
    "window",
    [
        DetokState(tokens=[-1], prefix_offset=0, read_offset=1),
        DetokState(tokens=[6366], prefix_offset=0, read_offset=9),
        DetokState(tokens=[6366, 223], prefix_offset=2, read_offset=1),
    ],
    ids=["negative-token", "offset-past-window", "prefix-after-read"],
)
def test_a_state_out_of_bounds_is_a_state_error(window: DetokState) -> None:
    with pytest.raises(StateError):
        decode_state(encode_state(StreamState(detok=window)))


@settings(max_examples=60, deadline=None)
@given(ids=token_ids)
def test_token_ids_round_trip_through_their_header_text(ids: list[int]) -> None:
    text = encode_tokens(ids)
    assert decode_tokens(text) == ids
    assert " " not in text


def test_no_tokens_is_the_empty_header() -> None:
    assert encode_tokens([]) == ""
    assert decode_tokens("") == []
    assert encode_tokens([6366, 1]) == "6366,1"
