"""Stop strings on streamed text: any chunking releases exactly the non-streaming output."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.workers.derender.texts import PROPERTY
from tokenway.errors import InvalidRequest
from workers.derender import stops as stopping
from workers.derender.stops import StopState, finish, matched_end, step

# A small alphabet, so that stop strings, their prefixes and overlaps turn up often.
ALPHABET = ["a", "b", "c", "中", "文", "😀", "👍", "\n"]
_strings = st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=5).map("".join)
stop_lists = st.lists(_strings, min_size=1, max_size=4)
outputs = st.lists(st.sampled_from(ALPHABET), max_size=40).map("".join)
cuts = st.lists(st.integers(0, 40), max_size=8)


def reference(
    stops: list[str], include: bool, text: str, inactive: int = 0
) -> tuple[str, str | None]:
    """The whole output at once: the first stop string to be complete (by end, then by list
    order) among those that end past the first `inactive` characters."""
    for end in range(inactive + 1, len(text) + 1):
        for stop in stops:
            if end >= len(stop) and text.startswith(stop, end - len(stop)):
                return text[: end if include else end - len(stop)], stop
    return text, None


def pieces(text: str, points: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(min(p, len(text)) for p in points)})
    return [text[a:b] for a, b in pairwise(bounds)]


def stream(
    stops: list[str], include: bool, chunks: list[tuple[str, bool]]
) -> tuple[str, str | None, list[StopState]]:
    """Feed (text, active) chunks until a stop matches; the released text and every state."""
    out, states, state = [], [], StopState()
    for text, active in chunks:
        released, stop, state = step(stops, include, state, text, active)
        out.append(released)
        states.append(state)
        if stop is not None:
            return "".join(out), stop, states
    return "".join(out) + finish(state), None, states


def is_partial(stops: list[str], s: str) -> bool:
    return any(len(s) < len(stop) and stop.startswith(s) for stop in stops)


@PROPERTY
@given(stops=stop_lists, include=st.booleans(), text=outputs, points=cuts)
def test_any_chunking_releases_the_non_streaming_output(
    stops: list[str], include: bool, text: str, points: list[int]
) -> None:
    chunks = [(p, True) for p in pieces(text, points)]
    assert stream(stops, include, chunks)[:2] == reference(stops, include, text)
    assert stream(stops, include, [(text, True)])[:2] == reference(stops, include, text)


@PROPERTY
@given(
    stops=stop_lists, include=st.booleans(), text=outputs, points=cuts, boundary=st.integers(0, 40)
)
def test_min_tokens_text_is_never_the_end_of_a_stop_but_can_start_one(
    stops: list[str], include: bool, text: str, points: list[int], boundary: int
) -> None:
    boundary = min(boundary, len(text))
    head, tail = text[:boundary], text[boundary:]
    chunks = [(p, False) for p in pieces(head, points)] + [(p, True) for p in pieces(tail, points)]
    assert stream(stops, include, chunks)[:2] == reference(stops, include, text, boundary)


@PROPERTY
@given(stops=stop_lists, text=outputs, points=cuts, active=st.booleans())
def test_withholds_exactly_the_longest_suffix_that_could_start_a_stop(
    stops: list[str], text: str, points: list[int], active: bool
) -> None:
    fed, released, state = "", "", StopState()
    for piece in pieces(text, points):
        out, stop, state = step(stops, False, state, piece, active)
        if stop is not None:
            return
        fed += piece
        released += out
        assert released + state.held == fed
        assert len(state.held) < max(map(len, stops))
        assert state.held == "" or is_partial(stops, state.held)
        # Nothing longer could start a stop string, so nothing more may be withheld.
        longer = [fed[i:] for i in range(len(fed) - len(state.held))]
        assert not any(is_partial(stops, s) for s in longer)
        assert stopping.problem(state, stops) is None


@PROPERTY
@given(stops=stop_lists, text=outputs, points=cuts)
def test_with_the_stop_string_in_the_output_nothing_is_withheld(
    stops: list[str], text: str, points: list[int]
) -> None:
    fed, released, state = "", "", StopState()
    for piece in pieces(text, points):
        out, stop, state = step(stops, True, state, piece, True)
        released += out
        fed += piece
        if stop is not None:
            assert released.endswith(stop)
            return
        assert released == fed
        assert state.held == ""
        assert len(state.seen) < max(map(len, stops))


def test_a_stop_split_across_chunks_is_found_and_nothing_after_it_is_released() -> None:
    chunks = [("Hello wo", True), ("rl", True), ("d! and more", True)]
    out, stop, states = stream(["world"], False, chunks)
    assert (out, stop) == ("Hello ", "world")
    assert [s.held for s in states[:2]] == ["wo", "worl"]


def test_the_stop_string_that_ends_first_wins() -> None:
    # "bc" ends before "abcd" does, though "abcd" starts first.
    assert stream(["abcd", "bc"], False, [("xabcdy", True)])[:2] == ("xa", "bc")
    assert stream(["abcd", "bc"], True, [("xabcdy", True)])[:2] == ("xabc", "bc")


def test_stops_ending_together_go_to_the_first_in_the_list() -> None:
    assert stream(["bc", "abc"], False, [("xabc", True)])[:2] == ("xa", "bc")
    assert stream(["abc", "bc"], False, [("xabc", True)])[:2] == ("x", "abc")


def test_overlapping_stops_over_many_chunks() -> None:
    # "b" and "aab" end together (the first listed wins), "abx" would end later.
    stops = ["abx", "b", "aab"]
    for text in ["aab", "aabx"]:
        for size in (1, 2, 3):
            chunks = [(text[i : i + size], True) for i in range(0, len(text), size)]
            assert stream(stops, False, chunks)[:2] == ("aa", "b")


def test_include_stop_str_in_output_ends_the_text_with_the_stop() -> None:
    out, stop, _ = stream(["</s>", "\n\n"], True, [("one </", True), ("s> two", True)])
    assert (out, stop) == ("one </s>", "</s>")


def test_a_stop_at_the_very_start_releases_nothing() -> None:
    assert step(["STOP"], False, StopState(), "STOP here", True)[:2] == ("", "STOP")
    assert step(["STOP"], True, StopState(), "STOP here", True)[:2] == ("STOP", "STOP")


def test_text_that_starts_a_stop_and_diverges_is_released_whole() -> None:
    state = StopState()
    out1, _, state = step(["world"], False, state, "hello wor", True)
    out2, stop, state = step(["world"], False, state, "k", True)
    assert (out1, out2, stop, state.held) == ("hello ", "work", None, "")
    # Diverging at the end of output: finish releases what was held.
    out3, _, state = step(["world"], False, state, " wo", True)
    assert out1 + out2 + out3 + finish(state) == "hello work wo"


def test_min_tokens_skips_a_stop_inside_the_first_tokens_text() -> None:
    # Inactive: "ab" is complete but never matches, later or now.
    assert stream(["ab"], False, [("xab", False), ("c", True)])[:2] == ("xabc", None)
    # A stop that starts in inactive text and ends in active text matches.
    assert stream(["bc"], False, [("xab", False), ("cd", True)])[:2] == ("xa", "bc")
    # The same stop again once active matches.
    assert stream(["ab"], False, [("ab", False), ("ab", True)])[:2] == ("ab", "ab")


def test_inactive_text_that_is_a_whole_stop_is_still_held_if_it_starts_a_longer_one() -> None:
    _, stop, state = step(["ab", "abc"], False, StopState(), "ab", False)
    assert (stop, state.held) == (None, "ab")
    assert step(["ab", "abc"], False, state, "c", True)[:2] == ("", "abc")


def test_held_text_stays_shorter_than_the_longest_stop() -> None:
    stops = ["a" * 50 + "b", "xyz"]
    state = StopState()
    released = []
    for i in range(1, 1001):
        out, stop, state = step(stops, False, state, "a" * 7, True)
        assert stop is None
        released.append(out)
        assert len(state.held) == min(50, 7 * i)
    assert len("".join(released)) == 7000 - 50


def test_cjk_and_emoji_stops_split_inside_a_multi_character_stop() -> None:
    stops = ["。", "😀👍"]
    assert stream(stops, False, [("你好😀", True), ("👍世界", True)])[:2] == ("你好", "😀👍")
    assert stream(stops, False, [("你好", True), ("。再见", True)])[:2] == ("你好", "。")
    assert stream(stops, True, [("a😀", True), ("👍b", True)])[:2] == ("a😀👍", "😀👍")


def test_no_stops_passes_text_through() -> None:
    assert step([], False, StopState(), "anything", True) == ("anything", None, StopState())


def test_an_empty_stop_string_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="empty string"):
        step(["ok", ""], False, StopState(), "text", True)


@pytest.mark.parametrize("include", [False, True])
def test_matched_end_locates_the_stop_in_the_step_text(include: bool) -> None:
    _, _, before = step(["world"], include, StopState(), "hello wo", True)
    text = "rld and more"
    released, stop, _ = step(["world"], include, before, text, True)
    assert stop == "world"
    assert text[: matched_end(before, include, released, stop)] == "rld"


def test_a_state_holding_more_than_its_stops_allow_is_a_problem() -> None:
    assert stopping.problem(StopState(held="abcd"), ["abcd"]) is not None
    assert stopping.problem(StopState(held="abc"), ["abcd"]) is None
