"""The incremental detokenizer: any chunking of any output decodes to exactly the full decode."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from tests.workers.derender.texts import (
    EOS,
    PROPERTY,
    REPLACEMENT,
    THINK,
    chunkings,
    encode,
    prompts,
    segments,
    split,
)
from tokenway.wire import SEED_TOKENS
from workers.derender.detok import SEED_PREFIX, Detokenizer, seed
from workers.derender.state import DetokState

WINDOW_BOUND = 16


def run(
    detok: Detokenizer, state: DetokState, chunks: list[list[int]], skip: bool
) -> tuple[str, list[DetokState]]:
    """Feed chunk after chunk; the concatenated output and the state after every step."""
    out, states = [], []
    for chunk in chunks:
        text, state = detok.step(state, chunk, skip_special_tokens=skip)
        out.append(text)
        states.append(state)
    return "".join(out), states


@PROPERTY
@given(parts=segments, sizes=chunkings)
def test_any_chunking_decodes_to_the_full_decode(
    detok: Detokenizer, tokenizer: Tokenizer, parts: list[str | int], sizes: list[int]
) -> None:
    ids = encode(tokenizer, parts)
    for skip in (True, False):
        text, _ = run(detok, seed([]), split(ids, sizes), skip)
        assert text == tokenizer.decode(ids, skip_special_tokens=skip)


@PROPERTY
@given(prompt=prompts, parts=segments, sizes=chunkings)
def test_seeded_from_a_prompt_tail_output_continues_the_prompt_decode(
    detok: Detokenizer,
    tokenizer: Tokenizer,
    prompt: str,
    parts: list[str | int],
    sizes: list[int],
) -> None:
    prompt_ids = encode(tokenizer, [prompt])
    ids = encode(tokenizer, parts)
    for skip in (True, False):
        before = tokenizer.decode(prompt_ids, skip_special_tokens=skip)
        full = tokenizer.decode(prompt_ids + ids, skip_special_tokens=skip)
        assert full.startswith(before)
        text, _ = run(detok, seed(prompt_ids), split(ids, sizes), skip)
        assert text == full[len(before) :]


@PROPERTY
@given(prompt=prompts, parts=segments, sizes=chunkings)
def test_output_has_no_replacement_character_and_the_window_stays_bounded(
    detok: Detokenizer,
    tokenizer: Tokenizer,
    prompt: str,
    parts: list[str | int],
    sizes: list[int],
) -> None:
    ids = encode(tokenizer, parts)
    for skip in (True, False):
        text, states = run(detok, seed(encode(tokenizer, [prompt])), split(ids, sizes), skip)
        assert REPLACEMENT not in text
        for state in states:
            assert len(state.tokens) <= WINDOW_BOUND
            assert 0 <= state.prefix_offset <= state.read_offset <= len(state.tokens)


def test_a_character_split_over_several_tokens_is_released_once_complete(
    detok: Detokenizer, tokenizer: Tokenizer
) -> None:
    ids = encode(tokenizer, ["👩‍👩‍👧"])
    assert len(ids) > 3  # byte-level pieces: the first ones are partial UTF-8 sequences
    state = seed([])
    pieces = []
    for tid in ids:
        text, state = detok.step(state, [tid])
        pieces.append(text)
    assert "".join(pieces) == "👩‍👩‍👧"
    assert all(REPLACEMENT not in p for p in pieces)
    assert pieces[0] == ""  # the first byte of 👩 alone is not a character yet


def test_seed_keeps_a_window_of_the_last_prompt_tokens() -> None:
    prompt = list(range(100, 120))
    state = seed(prompt)
    assert state.tokens == prompt[-SEED_PREFIX:]
    assert (state.prefix_offset, state.read_offset) == (0, SEED_PREFIX)
    assert SEED_PREFIX <= SEED_TOKENS
    assert seed([]) == DetokState(tokens=[], prefix_offset=0, read_offset=0)
    assert seed([7, 8]) == DetokState(tokens=[7, 8], prefix_offset=0, read_offset=2)


def test_skipped_special_tokens_vanish_and_kept_ones_appear(
    detok: Detokenizer, tokenizer: Tokenizer
) -> None:
    ids = encode(tokenizer, ["Hi", EOS, " there", THINK])
    assert detok.step(seed([]), ids, skip_special_tokens=True)[0] == "Hi there<think>"
    assert (
        detok.step(seed([]), ids, skip_special_tokens=False)[0]
        == "Hi<｜end▁of▁sentence｜> there<think>"
    )


@pytest.mark.parametrize("bad", [10**6, 129280, -1])
def test_a_token_id_outside_the_vocabulary_raises_value_error(detok: Detokenizer, bad: int) -> None:
    with pytest.raises(ValueError, match=str(bad)):
        detok.step(seed([]), [6366, bad])


def test_the_window_stays_bounded_over_a_long_run_of_skipped_special_tokens(
    detok: Detokenizer,
) -> None:
    state = seed([])
    text = ""
    for _ in range(100):
        out, state = detok.step(state, [EOS], skip_special_tokens=True)
        text += out
        assert len(state.tokens) <= WINDOW_BOUND
    out, state = detok.step(state, [6366], skip_special_tokens=True)
    assert text + out == "hi"


@PROPERTY
@given(prompt=prompts, parts=segments, skip=st.booleans())
def test_every_token_releases_what_vllms_decode_stream_releases(
    detok: Detokenizer, tokenizer: Tokenizer, prompt: str, parts: list, skip: bool
) -> None:
    """vLLM's fast detokenizer is tokenizers' DecodeStream, seeded with the whole prompt.
    Ours carries a bounded window instead; token by token, the released text is the same."""
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    ids = encode(tokenizer, parts)
    stream = DecodeStream(ids=prompt_ids, skip_special_tokens=skip)
    state = seed(prompt_ids)
    for tid in ids:
        expected = stream.step(tokenizer, tid) or ""
        [piece], state = detok.pieces(state, [tid], skip)
        assert piece == expected
