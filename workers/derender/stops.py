"""Stop strings matched on streamed output text, as vLLM 0.33's detokenizer matches them.

Each step looks for the stop strings that *end* in the new text (they may start in the text
kept from earlier steps) and picks the one that ends first, ties going to the earlier entry in
the request's `stop` list (vLLM `check_stop_strings`). That choice does not depend on how the
text was cut into chunks, so streaming gives the non-streaming result.

Without `include_stop_str_in_output`, the longest suffix of the text that could still grow into
a stop string is withheld until it either does (and is dropped) or diverges (and is released).
With it, vLLM withholds nothing: the stop string is part of the output and nothing after it is
released. Either way the state keeps fewer characters than the longest stop string.

`min_tokens`: vLLM checks no stop string that ends in the text of the first `min_tokens` output
tokens. The caller detokenizes those tokens and the rest separately and passes the first part
with `active=False`; that text can still begin a stop string that ends in later, active text.
"""

from __future__ import annotations

from collections.abc import Sequence

from msgspec import Struct

from tokenway.errors import InvalidRequest


class StopState(Struct, array_like=True, omit_defaults=True):
    """What a step needs from earlier text: fewer characters than the longest stop string."""

    held: str = ""  # withheld from the client: it may be the start of a stop string
    # Already released, kept only to find a stop string split across chunks
    # (include_stop_str_in_output, where nothing is withheld).
    seen: str = ""


def step(
    stops: Sequence[str], include: bool, state: StopState, text: str, active: bool = True
) -> tuple[str, str | None, StopState]:
    """`text` (the next output text) → (text to release now, the stop string matched, next state).

    On a match the stream ends: the released text stops where the stop string starts (or ends,
    with `include`), and the caller reports finish_reason "stop" with the string as stop_reason.
    """
    if not stops:
        return text, None, state
    if not all(stops):
        raise InvalidRequest("stop cannot contain an empty string", param="stop")
    before = state.seen if include else state.held
    window = before + text
    start = len(before)  # where the new text begins in `window`
    if active and text:
        match = _earliest(stops, window, start)
        if match is not None:
            stop, index = match
            if include:
                return window[start : index + len(stop)], stop, StopState()
            return window[:index], stop, StopState()
    keep = len(window) - _longest_partial(stops, window)
    if include:
        return text, None, StopState(seen=window[keep:])
    return window[:keep], None, StopState(held=window[keep:])


def finish(state: StopState) -> str:
    """The output ended without a stop string (EOS, a stop token, length): release what is held."""
    return state.held


def matched_end(before: StopState, include: bool, released: str, stop: str) -> int:
    """Where, in the `text` of the step that matched, the stop string ends.

    vLLM drops the output tokens after the one that completed the stop string; with the
    text's per-token offsets this finds that token.
    """
    if include:
        return len(released)
    return len(released) + len(stop) - len(before.held)


def problem(state: StopState, stops: Sequence[str]) -> str | None:
    """Why a state from the wire cannot belong to a request with these stop strings, if so."""
    limit = max((len(s) for s in stops), default=1) - 1
    if len(state.held) > limit or len(state.seen) > limit:
        return f"stop state holds more than the {limit} characters its stop strings allow"
    return None


def _earliest(stops: Sequence[str], window: str, start: int) -> tuple[str, int] | None:
    """The stop string ending first past `start` (ties: first in `stops`) and its index."""
    best: tuple[str, int] | None = None
    best_end = len(window) + 1
    for stop in stops:
        # Only occurrences that end in the new text: earlier ones were checked before.
        index = window.find(stop, max(start - len(stop) + 1, 0))
        if index != -1 and index + len(stop) < best_end:
            best, best_end = (stop, index), index + len(stop)
    return best


def _longest_partial(stops: Sequence[str], window: str) -> int:
    """Length of the longest suffix of `window` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        tail_start = max(len(window) - len(stop) + 1, 0)
        # Nearly always the stop's first character is not in the tail: nothing to keep.
        if len(window) - tail_start > longest and window.find(stop[0], tail_start) != -1:
            longest = max(longest, _border(stop, window[tail_start:]))
    return longest


def _border(stop: str, tail: str) -> int:
    """Longest suffix of `tail` that is a prefix of `stop`, in O(len(stop) + len(tail)).

    The KMP prefix function of stop + separator + tail: its last value is that length.
    `tail` is shorter than `stop`, so the prefix is a proper one.
    """
    seq: list[str | None] = [*stop, None, *tail]
    pi = [0] * len(seq)
    for i in range(1, len(seq)):
        k = pi[i - 1]
        while k and seq[i] != seq[k]:
            k = pi[k - 1]
        if seq[i] == seq[k]:
            k += 1
        pi[i] = k
    return pi[-1]
