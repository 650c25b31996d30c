"""The `Tw-Stream-State` and `Tw-Tokens` header codecs."""

from __future__ import annotations

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

token_ids = st.lists(st.integers(0, 2**31 - 1), max_size=40)


@settings(max_examples=60, deadline=None)
@given(raw=st.binary(max_size=600))
def test_state_bytes_round_trip_through_header_safe_text(raw: bytes) -> None:
    text = encode_state(raw)
    assert decode_state(text) == raw
    assert text.isascii() and "=" not in text
    assert set(text) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


@pytest.mark.parametrize("text", ["A", "!!!!", "not a state at all"])
def test_text_that_is_not_base64url_is_a_state_error(text: str) -> None:
    with pytest.raises(StateError, match="malformed"):
        decode_state(text)


def test_an_oversized_state_is_a_state_error_before_decoding() -> None:
    with pytest.raises(StateError, match=str(MAX_STATE_BYTES)):
        decode_state("A" * (MAX_STATE_BYTES + 1))


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
