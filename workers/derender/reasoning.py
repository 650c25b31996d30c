"""Reasoning parsers as pure, incremental steps: output text → (reasoning, content).

Where a chat output's reasoning ends, as vLLM 0.33's `--reasoning-parser` decides it, but
O(delta) per chunk: everything a chunk needs from the past is a `ReasoningState` of one flag
and at most a few held-back characters (a marker that may be split across chunks).

Render decides how the output starts (`tokenway.parsers.start_mode`, from the prompt and
the request's `chat_template_kwargs`); derender then runs `start` once, `step` per text delta
and `finish` at the end. A non-streaming output is one `step` over the whole text, then
`finish`: the same code, so any chunking gives the same concatenated reasoning and content.

The three parsers share one rule set and differ only in when they parse at all:

- in reasoning, text is reasoning up to the first end marker; everything after it is content;
- a start marker inside reasoning is dropped (reasoning simply continues);
- once reasoning has ended (in the prompt or in the output), nothing is parsed any more: the
  rest of the output is content, markers included.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from tokenway.parsers import markers_of
from tokenway.wire import ReasoningStart


class ReasoningState(msgspec.Struct, array_like=True, omit_defaults=True):
    """Where a request's output stands, between two text deltas."""

    in_reasoning: bool
    # The end of the text seen so far when it could begin a marker; shorter than the longest
    # marker, and only ever held while in reasoning.
    held: str = ""


def start(mode: ReasoningStart) -> ReasoningState | None:
    """The state before the first output character; None when reasoning is not parsed."""
    if mode == "off":
        return None
    return ReasoningState(in_reasoning=mode == "open")


def step(parser: str, state: ReasoningState, text: str) -> tuple[str, str, ReasoningState]:
    """(reasoning delta, content delta, next state) for the next piece of output text.

    Costs O(len(text) + len(state.held)); never emits what a later delta could change.
    """
    markers = markers_of(parser)
    if not state.in_reasoning:
        # abstract_parser.py parse_delta: after reasoning ended, deltas pass through as
        # content unparsed (a later <think> or </think> is content text).
        return "", state.held + text, ReasoningState(in_reasoning=False)
    buf = state.held + text
    end_at = buf.find(markers.end)
    scan_to = len(buf) if end_at < 0 else end_at
    parts: list[str] = []
    pos = 0
    # basic_parsers.py / parser/qwen3.py: a start marker while in reasoning is skipped
    # (the R1 parser drops a lone <think> delta; the qwen3 engine absorbs THINK_START).
    while (at := buf.find(markers.start, pos, scan_to)) >= 0:
        parts.append(buf[pos:at])
        pos = at + len(markers.start)
    if end_at >= 0:
        # basic_parsers.py: reasoning is the text before </think>, content the text after it.
        parts.append(buf[pos:end_at])
        content = buf[end_at + len(markers.end) :]
        return "".join(parts), content, ReasoningState(in_reasoning=False)
    # Hold back the longest tail that could still become a marker, so that nothing emitted
    # ever has to be taken back.
    keep = len(buf)
    for n in range(min(markers.longest - 1, len(buf) - pos), 0, -1):
        if markers.could_begin(buf[-n:]):
            keep -= n
            break
    parts.append(buf[pos:keep])
    return "".join(parts), "", ReasoningState(in_reasoning=True, held=buf[keep:])


def finish(parser: str, state: ReasoningState) -> tuple[str, str]:
    """(reasoning, content) still held at the end of the output: a partial marker is text.

    Output that never reached an end marker stays reasoning (basic_parsers.py extract_reasoning:
    no </think> means all reasoning, no content).
    """
    markers_of(parser)
    if state.in_reasoning:
        return state.held, ""
    return "", state.held


def count(parser: str, mode: ReasoningStart, pieces: Sequence[str]) -> int:
    """How many output tokens (each token's text, `pieces`) are reasoning, as vLLM counts
    them (`count_reasoning_tokens`): the tokens inside the markers, not the markers."""
    markers = markers_of(parser)
    state, n = start(mode), 0
    for piece in pieces:
        if state is None or not state.in_reasoning:
            break
        _, _, state = step(parser, state, piece)
        if state.in_reasoning and piece != markers.start:
            n += 1
    return n


def problem(parser: str, state: ReasoningState) -> str | None:
    """Why `state` cannot come from this parser (a forged or corrupted stream_state), or None."""
    markers = markers_of(parser)
    if not state.held:
        return None
    if not state.in_reasoning or not markers.could_begin(state.held):
        return f"reasoning state holds {state.held!r}, which no {parser} step holds back"
    return None
