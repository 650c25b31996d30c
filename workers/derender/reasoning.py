"""Reasoning parsers as pure, incremental steps: output text → (reasoning, content).

Where a chat output's reasoning ends, as vLLM 0.33's `--reasoning-parser` decides it, but
O(delta) per chunk: everything a chunk needs from the past is a `ReasoningState` of one flag
and at most a few held-back characters (a marker that may be split across chunks).

Render decides how the output starts (`start_mode`, from the prompt and the request's
`chat_template_kwargs`); derender then runs `start` once, `step` per text delta and `finish`
at the end. A non-streaming output is one `step` over the whole text, then `finish`: the same
code, so any chunking gives the same concatenated reasoning and content.

The three parsers share one rule set and differ only in when they parse at all:

- in reasoning, text is reasoning up to the first end marker; everything after it is content;
- a start marker inside reasoning is dropped (reasoning simply continues);
- once reasoning has ended (in the prompt or in the output), nothing is parsed any more: the
  rest of the output is content, markers included.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from tokenway.wire import ReasoningStart

START = "<think>"
END = "</think>"


@dataclass(frozen=True, slots=True)
class _Markers:
    start: str
    end: str

    @property
    def longest(self) -> int:
        return max(len(self.start), len(self.end))

    def could_begin(self, tail: str) -> bool:
        """Whether `tail` is a proper prefix of a marker (it may complete in the next delta)."""
        return (len(tail) < len(self.start) and self.start.startswith(tail)) or (
            len(tail) < len(self.end) and self.end.startswith(tail)
        )


_THINK = _Markers(START, END)
# Every parser we know marks reasoning with <think>…</think>.
_MARKERS: dict[str, _Markers] = {"deepseek_r1": _THINK, "deepseek_v3": _THINK, "qwen3": _THINK}
PARSERS: tuple[str, ...] = ("deepseek_r1", "deepseek_v3", "qwen3")


class ReasoningState(msgspec.Struct, array_like=True, omit_defaults=True):
    """Where a request's output stands, between two text deltas."""

    in_reasoning: bool
    # The end of the text seen so far when it could begin a marker; shorter than the longest
    # marker, and only ever held while in reasoning.
    held: str = ""


def _markers(parser: str) -> _Markers:
    markers = _MARKERS.get(parser)
    if markers is None:
        raise ValueError(f"unknown reasoning parser {parser!r}; known: {', '.join(PARSERS)}")
    return markers


def _thinking(parser: str, kwargs: Mapping[str, object]) -> bool:
    """Whether the request asked this parser to separate reasoning at all."""
    if parser == "deepseek_v3":
        # deepseek_v3_reasoning_parser.py: `thinking` or `enable_thinking` picks the R1 parser,
        # otherwise the identity parser (everything is content).
        return bool(kwargs.get("thinking", False)) or bool(kwargs.get("enable_thinking", False))
    if parser == "qwen3":
        # parser/qwen3.py (Qwen3Parser): `enable_thinking`, default on; off starts in content
        # and is_reasoning_end is always true, so nothing is ever reasoning.
        return bool(kwargs.get("enable_thinking", True))
    return True  # deepseek_r1 always parses


def start_mode(
    parser: str,
    prompt_token_ids: Sequence[int],
    chat_template_kwargs: Mapping[str, object],
    vocab: Mapping[str, int],
) -> ReasoningStart:
    """How the output starts: "off" (no parsing), "open" (in reasoning) or "closed" (content).

    Decided once, by render, from the rendered prompt. Raises ValueError for an unknown parser,
    or for deepseek parsers whose markers are not single tokens of the vocabulary.
    """
    markers = _markers(parser)
    if not _thinking(parser, chat_template_kwargs):
        return "off"
    start_id, end_id = vocab.get(markers.start), vocab.get(markers.end)
    if parser != "qwen3" and (start_id is None or end_id is None):
        # basic_parsers.py: a <think>/</think> parser refuses a tokenizer without both tokens
        # (the qwen3 engine matches text, so it goes on and finds no marker in the prompt).
        raise ValueError(
            f"reasoning parser {parser!r} needs {markers.start} and {markers.end} as tokens "
            "of the model's vocabulary"
        )
    # is_reasoning_end(prompt) in basic_parsers.py and parser_engine.py: the prompt's last
    # marker decides; abstract_parser.py parse_delta then skips reasoning parsing altogether.
    # No marker in the prompt: deepseek_r1 takes output without <think> as reasoning until
    # </think> (deepseek_r1_reasoning_parser.py); qwen3 with thinking starts in REASONING.
    last = last_marker(prompt_token_ids, start_id, end_id)
    return "closed" if last is not None and last == end_id else "open"


def last_marker(
    prompt_token_ids: Sequence[int], start_id: int | None, end_id: int | None
) -> int | None:
    """The prompt's last reasoning marker (`start_id` or `end_id`), None without one: whether
    it leaves the output in reasoning, as parsers and a thinking budget read it."""
    markers = {start_id, end_id} - {None}
    return next((t for t in reversed(prompt_token_ids) if t in markers), None)


def start(mode: ReasoningStart) -> ReasoningState | None:
    """The state before the first output character; None when reasoning is not parsed."""
    if mode == "off":
        return None
    return ReasoningState(in_reasoning=mode == "open")


def step(parser: str, state: ReasoningState, text: str) -> tuple[str, str, ReasoningState]:
    """(reasoning delta, content delta, next state) for the next piece of output text.

    Costs O(len(text) + len(state.held)); never emits what a later delta could change.
    """
    markers = _markers(parser)
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
    _markers(parser)
    if state.in_reasoning:
        return state.held, ""
    return "", state.held


def count(parser: str, mode: ReasoningStart, pieces: Sequence[str]) -> int:
    """How many output tokens (each token's text, `pieces`) are reasoning, as vLLM counts
    them (`count_reasoning_tokens`): the tokens inside the markers, not the markers."""
    markers = _markers(parser)
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
    markers = _markers(parser)
    if not state.held:
        return None
    if not state.in_reasoning or not markers.could_begin(state.held):
        return f"reasoning state holds {state.held!r}, which no {parser} step holds back"
    return None
