"""Reasoning parsers as pure, incremental steps: output text → (reasoning, content).

Where a chat output's reasoning ends, as vLLM 0.33's `--reasoning-parser` decides it for a
whole (non-streaming) answer, but O(delta) per chunk: everything a chunk needs from the past
is a `ReasoningState` of a flag or two and a few held-back characters (a marker that may be
split across chunks, reasoning's trailing whitespace).

Render decides how the output starts (`tokenway.parsers.start_mode`, from the prompt and
the request's `chat_template_kwargs`); derender then runs `start` once, `step` per text delta
and `finish` at the end. A non-streaming output is one `step` over the whole text, then
`finish`: the same code, so any chunking gives the same concatenated reasoning and content.

Each parser's `ReasoningFormat` (tokenway/parsers.py) says which markers it reads where:

- in reasoning, a start marker is dropped (reasoning goes on); the end marker ends reasoning;
  an implicit end (a tool call's start) ends it too and stays content, for the tool parser;
- the <think> parsers (deepseek_r1, deepseek_v3, qwen3) parse nothing after reasoning: the
  rest of the output is content, markers included;
- vLLM's parser engine reads content too (`parses_content`): an end marker there is dropped,
  a start marker opens reasoning again where the parser `reopens` (glm, mistral), and
  minimax_m2 drops a tool call's closer that closes no call;
- where it `strips_whitespace`, reasoning's trailing whitespace is no reasoning (vLLM strips
  it from the whole answer's reasoning): it is held until more reasoning follows.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal

import msgspec

from tokenway.parsers import ReasoningFormat, reasoning_format
from tokenway.wire import ReasoningStart

# The most trailing whitespace held back: a longer run keeps its head as reasoning, so the
# state stays small (vLLM strips any length; models end reasoning with a newline or two).
MAX_BLANK = 256

# What a marker does where it is found.
Action = Literal["drop", "end", "implicit", "reopen", "call", "close"]
# A piece of the scanned text: reasoning, content, a dropped marker, or reasoning's end.
Kind = Literal["reasoning", "content", "dropped", "ended"]


class ReasoningState(msgspec.Struct, array_like=True, omit_defaults=True):
    """Where a request's output stands, between two text deltas. For minimax_m2_append_think
    `in_reasoning` means the <think> it puts before the content is still owed."""

    in_reasoning: bool
    # The end of the text seen so far when it could begin a marker; shorter than the longest
    # marker.
    held: str = ""
    # Reasoning's trailing whitespace, at most MAX_BLANK characters: reasoning if more
    # reasoning follows, dropped if none does. Held on in content where reasoning reopens.
    blank: str = ""
    # minimax_m2: a tool call opened in content, so its closer is content, not dropped.
    in_call: bool = False


def start(mode: ReasoningStart) -> ReasoningState | None:
    """The state before the first output character; None when reasoning is not parsed."""
    if mode == "off":
        return None
    return ReasoningState(in_reasoning=mode == "open")


@functools.cache
def _markers(parser: str, in_reasoning: bool) -> tuple[tuple[str, Action], ...]:
    """The markers the parser reads in reasoning or in content, and what each does."""
    fmt = reasoning_format(parser)
    if fmt.prefix:
        return ()
    if in_reasoning:
        implicit: list[tuple[str, Action]] = [(m, "implicit") for m in fmt.implicit_ends]
        return ((fmt.start, "drop"), (fmt.end, "end"), *implicit)
    if not fmt.parses_content:
        return ()
    found: list[tuple[str, Action]] = [(fmt.end, "drop")]
    if fmt.reopens:
        found.append((fmt.start, "reopen"))
    if fmt.tool_call is not None:
        found += [(m, "call") for m in fmt.tool_call.opens]
        found.append((fmt.tool_call.closes, "close"))
    return tuple(found)


def _could_begin(parser: str, in_reasoning: bool, tail: str) -> bool:
    """Whether `tail` is a proper prefix of a marker read there (it may complete later)."""
    return any(len(tail) < len(m) and m.startswith(tail) for m, _ in _markers(parser, in_reasoning))


def _undecided(parser: str, in_reasoning: bool, tail: str) -> int:
    """How many characters at the end of `tail` could still become a marker."""
    longest = max((len(m) for m, _ in _markers(parser, in_reasoning)), default=0)
    for n in range(min(longest - 1, len(tail)), 0, -1):
        if _could_begin(parser, in_reasoning, tail[-n:]):
            return n
    return 0


def _scan(
    parser: str, state: ReasoningState, text: str, final: bool
) -> tuple[list[tuple[Kind, str]], ReasoningState]:
    """Split the held text and `text` into pieces, in order; hold back a possible marker
    at the end unless `final`. The state's blank is left to the caller.

    Markers are found leftmost first (the longest at one place), as vLLM's lexer finds its
    terminals: none of the parsers' other terminals can hide a marker's first character."""
    fmt = reasoning_format(parser)
    buf = state.held + text
    pieces: list[tuple[Kind, str]] = []
    in_reasoning, in_call = state.in_reasoning, state.in_call
    found: dict[str, int] = {}  # each marker's next place at or after pos, -1: none
    pos = 0
    while True:
        best: tuple[int, str, Action] | None = None
        for marker, action in _markers(parser, in_reasoning):
            at = found.get(marker)
            if at is None or 0 <= at < pos:
                at = found[marker] = buf.find(marker, pos)
            if at >= 0 and (best is None or (at, -len(marker)) < (best[0], -len(best[1]))):
                best = (at, marker, action)
        if best is None:
            break
        at, marker, action = best
        if at > pos:
            pieces.append(("reasoning" if in_reasoning else "content", buf[pos:at]))
        pos = at + len(marker)
        if action == "end":
            pieces += [("dropped", marker), ("ended", "")]
            in_reasoning = False
        elif action == "implicit":
            pieces += [("ended", ""), ("content", marker)]
            in_reasoning, in_call = False, fmt.tool_call is not None
        elif action == "reopen":
            pieces.append(("dropped", marker))
            in_reasoning = True
        elif action == "call":
            pieces.append(("content", marker))
            in_call = True
        elif action == "close":
            pieces.append(("content" if in_call else "dropped", marker))
            in_call = False
        else:
            pieces.append(("dropped", marker))
    tail = buf[pos:]
    keep = len(tail) - (0 if final else _undecided(parser, in_reasoning, tail))
    if keep:
        pieces.append(("reasoning" if in_reasoning else "content", tail[:keep]))
    return pieces, ReasoningState(in_reasoning, tail[keep:], in_call=in_call)


def _unblank(blank: str, text: str) -> tuple[str, str]:
    """(reasoning to emit, blank to hold) for more reasoning `text` after `blank`."""
    body = text.rstrip()
    if body:
        out, blank = blank + body, text[len(body) :]
    else:
        out, blank = "", blank + text
    if len(blank) > MAX_BLANK:
        out, blank = out + blank[:-MAX_BLANK], blank[-MAX_BLANK:]
    return out, blank


def _join(fmt: ReasoningFormat, pieces: list[tuple[Kind, str]], blank: str) -> tuple[str, str, str]:
    """(reasoning, content, blank still held) of scanned pieces."""
    thoughts: list[str] = []
    answer: list[str] = []
    for kind, text in pieces:
        if kind == "reasoning":
            if fmt.strips_whitespace:
                text, blank = _unblank(blank, text)
            thoughts.append(text)
        elif kind == "content":
            answer.append(text)
        elif kind == "ended" and not fmt.reopens:
            blank = ""  # no reasoning can follow: it was trailing
    return "".join(thoughts), "".join(answer), blank


def step(parser: str, state: ReasoningState, text: str) -> tuple[str, str, ReasoningState]:
    """(reasoning delta, content delta, next state) for the next piece of output text.

    Costs O(len(text) + len(state.held)); never emits what a later delta could change.
    """
    fmt = reasoning_format(parser)
    if fmt.prefix:
        # MiniMaxM2AppendThinkReasoningParser: no reasoning, and the content starts with
        # the <think> the model's template put in the prompt.
        owed = fmt.prefix if state.in_reasoning else ""
        return "", owed + text, ReasoningState(in_reasoning=False)
    pieces, after = _scan(parser, state, text, final=False)
    thought, answer, blank = _join(fmt, pieces, state.blank)
    return thought, answer, msgspec.structs.replace(after, blank=blank)


def finish(parser: str, state: ReasoningState) -> tuple[str, str]:
    """(reasoning, content) still held at the end of the output: a partial marker is text,
    trailing whitespace of reasoning is dropped.

    Output that never reached an end marker stays reasoning (basic_parsers.py extract_reasoning:
    no </think> means all reasoning, no content).
    """
    fmt = reasoning_format(parser)
    if fmt.prefix:
        return "", fmt.prefix if state.in_reasoning else ""
    pieces, _ = _scan(parser, state, "", final=True)
    thought, answer, _ = _join(fmt, pieces, state.blank)
    return thought, answer


def count(parser: str, mode: ReasoningStart, pieces: Sequence[str]) -> int:
    """How many output tokens (each token's text, `pieces`) are reasoning, as vLLM counts
    them (`count_reasoning_tokens`): for the <think> parsers the tokens inside the markers,
    not the markers; for its parser engine the tokens whose text begins in reasoning (its
    counting pass also parses tool calls, so reasoning markers inside a call's markup may
    count there otherwise)."""
    fmt = reasoning_format(parser)
    state = start(mode)
    if state is None or fmt.prefix:
        return 0
    if not fmt.parses_content:
        n = 0
        for piece in pieces:
            if not state.in_reasoning:
                break
            _, _, state = step(parser, state, piece)
            if state.in_reasoning and piece != fmt.start:
                n += 1
        return n
    scanned, _ = _scan(parser, state, "".join(pieces), final=True)
    kinds = iter(scanned)
    kind: Kind = "content"
    upto = at = n = 0  # the scanned text covers [.., upto); the piece starts at `at`
    for piece in pieces:
        while upto <= at and (nxt := next(kinds, None)) is not None:
            kind, upto = nxt[0], upto + len(nxt[1])
        if piece and kind == "reasoning" and at < upto:
            n += 1
        at += len(piece)
    return n


def problem(parser: str, state: ReasoningState) -> str | None:
    """Why `state` cannot come from this parser (a forged or corrupted stream_state), or None."""
    fmt = reasoning_format(parser)
    if state.blank and not (
        fmt.strips_whitespace
        and (state.in_reasoning or fmt.reopens)
        and len(state.blank) <= MAX_BLANK
        and state.blank.isspace()
    ):
        return f"reasoning state holds whitespace {state.blank!r}, which no {parser} step holds"
    if state.in_call and (fmt.tool_call is None or state.in_reasoning):
        return f"reasoning state is in a tool call, which no {parser} step is"
    if state.held and not _could_begin(parser, state.in_reasoning, state.held):
        return f"reasoning state holds {state.held!r}, which no {parser} step holds back"
    return None
