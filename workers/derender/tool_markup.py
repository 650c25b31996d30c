"""Tool calls written as markup, parsed as pure incremental steps.

Qwen3-Coder (`qwen3_coder`, `qwen3_xml`), MiniMax-M2 (`minimax_m2`) and GLM-4.5/4.7 (`glm45`,
`glm47`) write a call as tags around its name and each argument, arguments as bare text:

    <tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>
    <minimax:tool_call><invoke name="NAME"><parameter name="KEY">VALUE</parameter></invoke>…
    <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call>

Each family is a table (`Family`): its markers, and how each moves the parser from one phase
to the next (vLLM 0.33 describes these formats as such tables too; read its `vllm/parser`
for the behaviour). A step finds the earliest marker in the new text, holding back a tail
that may be the start of one, so markers split across deltas are found and nothing emitted
is taken back. Argument text goes through a second, smaller scanner (`ParamTags`) that finds
keys and values; a value is turned into JSON as the tool's schema types it
(`tokenway.tool_params`): a string value streams as it arrives, any other is held until it
ends (at most `MAX_TYPED` characters; longer, it streams as a string).

What the whole answer holds, for every chunking: content is the text before the first call
(whitespace-only content before a call is dropped, as is whitespace just before a call);
text after a call is dropped; a call whose name is empty, or (where the family checks)
not one of the request's tools, is dropped with its arguments.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Protocol

import msgspec
from msgspec import Meta

from tokenway.tool_params import coerce, streams_as_text
from tokenway.wire import ToolParams

MAX_NAME = 512  # as tools.py: a longer name is not a function name
MAX_KEY = 256
MAX_TYPED = 4096  # a typed value held for conversion; past it, it streams as a string
MAX_SPACE = 256  # whitespace held back before a possible call; past it, it is content


class Phase(enum.IntEnum):
    CONTENT = 0  # before any call: content
    PREAMBLE = 1  # inside a block's opening marker, before a call
    NAME = 2  # a call's name
    ARGS = 3  # a call's arguments
    BETWEEN = 4  # after a call, inside its block
    DONE = 5  # calls are over (parallel calls off): everything else is dropped


class Act(enum.IntEnum):
    NONE = 0
    START = 1  # a call starts
    END = 2  # the call ends
    RESTART = 3  # the call ends and another starts


class Where(enum.IntEnum):
    """Where the argument scanner stands."""

    OUT = 0  # between parameters
    KEY = 1  # in a parameter's key
    GAP = 2  # after a key, before its value's opening tag
    VALUE = 3  # in a value


class MarkupState(msgspec.Struct, array_like=True, omit_defaults=True):
    """Everything a step needs from earlier text: a few small fields, never the output."""

    phase: Phase = Phase.CONTENT
    held: Annotated[str, Meta(max_length=64)] = ""  # may start a marker
    space: Annotated[str, Meta(max_length=MAX_SPACE)] = ""  # content whitespace held back
    called: bool = False  # a call was reported: content is over
    name: Annotated[str, Meta(max_length=MAX_NAME)] = ""
    live: bool = False  # the current call was reported (its arguments are streamed)
    # the argument scanner
    where: Where = Where.OUT
    tag: Annotated[str, Meta(max_length=64)] = ""  # may start a parameter tag
    close: Annotated[int, Meta(ge=0)] = 0  # the key's closing tag, by index in ParamTags
    key: Annotated[str, Meta(max_length=MAX_KEY)] = ""
    params: Annotated[int, Meta(ge=0)] = 0  # parameters written into the JSON object
    typed: bool = False  # the value is held for conversion (else streams as a string)
    value: Annotated[str, Meta(max_length=MAX_TYPED)] = ""  # a typed value so far
    fresh: bool = True  # nothing of the value seen yet (a leading newline is markup)
    newline: bool = False  # a newline held back (a trailing one is markup)


class Sink(Protocol):
    """Where a step's output goes."""

    content: list[str]

    def call(self, name: str) -> None: ...  # a call starts (its arguments follow)

    def args(self, text: str) -> None: ...  # the current call's arguments, more of them


@dataclass(frozen=True, slots=True)
class ParamTags:
    """How a call's arguments are written: `opens[i]` starts a key that `closes[i]` ends."""

    opens: tuple[str, ...]
    closes: tuple[str, ...]
    value_open: str | None  # a tag between the key and its value (GLM), or none
    value_close: str
    open_ends_value: bool  # a new key's tag also ends an open value (no closing tag)
    trim_newlines: bool  # one leading and one trailing newline of a value are markup
    strip_key: bool

    @property
    def enders(self) -> tuple[str, ...]:
        """What ends a value."""
        return (self.value_close, *self.opens) if self.open_ends_value else (self.value_close,)


@dataclass(frozen=True, slots=True)
class Family:
    moves: Mapping[tuple[Phase, str], tuple[Phase, Act]]
    params: ParamTags
    check_names: bool  # a call to a tool the request does not have is dropped
    # markers whose text goes on into the phase they lead to (GLM's first `<arg_key>`)
    keep: frozenset[str] = frozenset()
    markers: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        found = {m for _, m in self.moves}
        object.__setattr__(self, "markers", tuple(sorted(found, key=len, reverse=True)))


def _moves(*rows: tuple[tuple[Phase, ...], tuple[str, ...], Phase, Act]) -> dict:
    return {(p, m): (to, act) for phases, marks, to, act in rows for p in phases for m in marks}


_C, _P, _N, _A, _B = Phase.CONTENT, Phase.PREAMBLE, Phase.NAME, Phase.ARGS, Phase.BETWEEN
_START, _END, _RESTART, _NONE = Act.START, Act.END, Act.RESTART, Act.NONE

_QWEN = Family(
    moves=_moves(
        ((_C, _B), ("<tool_call>",), _P, _NONE),
        ((_C, _B), ("<function=",), _N, _START),
        ((_P,), ("<function=",), _N, _NONE),
        ((_P, _B), ("</tool_call>",), _C, _NONE),
        ((_N,), (">",), _A, _NONE),
        ((_N, _A), ("</function>",), _B, _END),
        ((_N,), ("</tool_call>",), _C, _END),
        ((_N,), ("<tool_call>",), _P, _END),
        ((_N, _A), ("<function=",), _N, _RESTART),
    ),
    params=ParamTags(
        opens=("<parameter=",),
        closes=(">",),
        value_open=None,
        value_close="</parameter>",
        open_ends_value=True,
        trim_newlines=True,
        strip_key=False,
    ),
    check_names=False,
)
_INVOKES = ('<invoke name="', "<invoke name='", "<invoke name=")
_MINIMAX = Family(
    moves=_moves(
        ((_C,), ("</minimax:tool_call>",), _C, _NONE),
        ((_C,), ("<minimax:tool_call>",), _P, _NONE),
        ((_P, _B), ("</minimax:tool_call>",), _C, _NONE),
        ((_C, _P, _B), _INVOKES, _N, _START),
        ((_N,), ('">', "'>", ">"), _A, _NONE),
        ((_A,), ("</invoke>",), _B, _END),
    ),
    params=ParamTags(
        opens=('<parameter name="', "<parameter name='", "<parameter name="),
        closes=('">', "'>", ">"),
        value_open=None,
        value_close="</parameter>",
        open_ends_value=True,
        trim_newlines=False,
        strip_key=True,
    ),
    check_names=True,
)
_GLM = Family(
    moves=_moves(
        ((_C,), ("<tool_call>",), _N, _START),
        ((_N,), ("<arg_key>",), _A, _NONE),
        ((_N, _A), ("</tool_call>",), _C, _END),
    ),
    params=ParamTags(
        opens=("<arg_key>",),
        closes=("</arg_key>",),
        value_open="<arg_value>",
        value_close="</arg_value>",
        open_ends_value=False,
        trim_newlines=False,
        strip_key=True,
    ),
    check_names=True,
    keep=frozenset({"<arg_key>"}),
)
FAMILIES: dict[str, Family] = {
    "qwen3_coder": _QWEN,
    "qwen3_xml": _QWEN,
    "minimax_m2": _MINIMAX,
    "glm45": _GLM,
    "glm47": _GLM,
}


def step(
    family: Family,
    tools: list[ToolParams],
    s: MarkupState,
    text: str,
    out: Sink,
    parallel: bool,
) -> None:
    """Parse the next piece of output text into `out`, updating `s` in place."""
    text, s.held = s.held + text, ""
    i = 0
    while i < len(text) and s.phase != Phase.DONE:
        at, marker = _first(text, i, family.markers)
        if marker is None or (at + len(marker) == len(text) and _longer(marker, family.markers)):
            # no marker, or one that may grow into a longer one: hold what may start one
            at, marker = _tail(text, i if marker is None else at, family.markers), None
            s.held = text[at:]
        _text(family, tools, s, text[i:at], out)
        if marker is None:
            return
        i = at + len(marker)
        move = family.moves.get((s.phase, marker))
        if move is None:  # a marker that means nothing here is text
            _text(family, tools, s, marker, out)
            continue
        to, act = move
        if act in (Act.END, Act.RESTART):
            _end_call(family, tools, s, out, parallel)
            if s.phase == Phase.DONE:
                return
        elif s.phase == Phase.NAME and to == Phase.ARGS:
            _named(family, tools, s, out)
        s.phase = to
        if act in (Act.START, Act.RESTART):
            s.name = ""
        if marker in family.keep:
            _text(family, tools, s, marker, out)


def finish(family: Family, tools: list[ToolParams], s: MarkupState, out: Sink) -> None:
    """The end of output: what was held is text; an open call ends as if closed."""
    held, s.held = s.held, ""
    _text(family, tools, s, held, out)
    if s.phase == Phase.CONTENT:
        out.content.append(s.space)
        s.space = ""
    elif s.phase in (Phase.NAME, Phase.ARGS):
        _end_call(family, tools, s, out, parallel=True)


# -- markers ----------------------------------------------------------------------------------


def _first(text: str, i: int, markers: tuple[str, ...]) -> tuple[int, str | None]:
    """The earliest marker in `text[i:]` (the longest of those starting there)."""
    best, at = None, len(text)
    for m in markers:  # longest first: a tie keeps the longer
        j = text.find(m, i, at + len(m))
        if 0 <= j < at:
            best, at = m, j
    return at, best


def _tail(text: str, i: int, markers: tuple[str, ...]) -> int:
    """Where the longest tail of `text[i:]` that may start one of `markers` begins."""
    longest = max(len(m) for m in markers)
    for p in range(max(i, len(text) - longest + 1), len(text)):
        if any(m.startswith(text[p:]) for m in markers):
            return p
    return len(text)


def _longer(marker: str, markers: tuple[str, ...]) -> bool:
    return any(len(m) > len(marker) and m.startswith(marker) for m in markers)


# -- text by phase -----------------------------------------------------------------------------


def _text(family: Family, tools: list[ToolParams], s: MarkupState, text: str, out: Sink) -> None:
    if not text:
        return
    if s.phase == Phase.CONTENT:
        _content(s, text, out)
    elif s.phase == Phase.NAME:
        s.name = (s.name + text)[:MAX_NAME]
    elif s.phase == Phase.ARGS and s.live:
        _args(family.params, _types(tools, s.name), s, text, out)


def _content(s: MarkupState, text: str, out: Sink) -> None:
    """Content before the first call; whitespace at its end held until more content
    (released), a call (dropped) or the end (released) says what it is."""
    if s.called:
        return
    body = text.rstrip()
    if body:
        out.content.append(s.space + body)
        s.space = ""
    s.space += text[len(body) :]
    if len(s.space) > MAX_SPACE:
        out.content.append(s.space)
        s.space = ""


# -- calls -------------------------------------------------------------------------------------


def _named(family: Family, tools: list[ToolParams], s: MarkupState, out: Sink) -> None:
    """The name is complete: report the call, unless it has no name or names no tool."""
    name = s.name.strip()
    known = not family.check_names or not tools or any(t.name == name for t in tools)
    s.live = bool(name) and known
    if s.live:
        s.name, s.called, s.space = name, True, ""  # whitespace before a call is not content
        out.call(name)


def _end_call(
    family: Family, tools: list[ToolParams], s: MarkupState, out: Sink, parallel: bool
) -> None:
    """A call ends (its closing marker, the next call's, or the end of output): what is
    open closes, so its arguments are one JSON object."""
    if s.phase == Phase.NAME:
        _named(family, tools, s, out)
    if s.live:
        types = _types(tools, s.name)
        tag, s.tag = s.tag, ""
        if s.where == Where.VALUE:
            _value_text(family.params, types, s, tag, out)
            _close_value(types, s, out)
        out.args("}" if s.params else "{}")
        if not parallel:
            s.phase = Phase.DONE
    s.live, s.name, s.where, s.params, s.key, s.tag = False, "", Where.OUT, 0, "", ""


def _types(tools: list[ToolParams], name: str) -> Mapping[str, list[str]]:
    return next((t.types for t in tools if t.name == name), {})


# -- arguments ---------------------------------------------------------------------------------


def _args(
    tags: ParamTags, types: Mapping[str, list[str]], s: MarkupState, text: str, out: Sink
) -> None:
    """Scan argument text for keys and values; values go out as JSON."""
    text, s.tag = s.tag + text, ""
    i = 0
    while i < len(text):
        if s.where == Where.OUT:
            at, m = _first(text, i, tags.opens)
            if m is None or (at + len(m) == len(text) and _longer(m, tags.opens)):
                s.tag = text[_tail(text, i if m is None else at, tags.opens) :]
                return
            i, s.where, s.close, s.key = at + len(m), Where.KEY, tags.opens.index(m), ""
        elif s.where == Where.KEY:
            close = tags.closes[s.close]
            j = text.find(close, i)
            end = _tail(text, i, (close,)) if j < 0 else j
            s.key = (s.key + text[i:end])[:MAX_KEY]
            if j < 0:
                s.tag = text[end:]
                return
            i = j + len(close)
            if tags.value_open is None:
                _open_value(tags, types, s, out)
            else:
                s.where = Where.GAP
        elif s.where == Where.GAP:
            assert tags.value_open is not None
            rest = text[i:].lstrip()
            i = len(text) - len(rest)
            if rest.startswith(tags.value_open):
                i += len(tags.value_open)
                _open_value(tags, types, s, out)
            elif tags.value_open.startswith(rest):  # it may still come (or nothing is left)
                s.tag = rest
                return
            else:  # a key with no value: not an argument
                s.where = Where.OUT
        else:
            at, m = _first(text, i, tags.enders)
            end = _tail(text, i, tags.enders) if m is None else at
            _value_text(tags, types, s, text[i:end], out)
            if m is None:
                s.tag = text[end:]
                return
            _close_value(types, s, out)
            s.where = Where.OUT
            i = at + len(m) if m == tags.value_close else at


def _open_value(tags: ParamTags, types: Mapping[str, list[str]], s: MarkupState, out: Sink) -> None:
    s.where, s.value, s.fresh, s.newline = Where.VALUE, "", True, False
    if tags.strip_key:
        s.key = s.key.strip()
    if not s.key:  # not an argument: its value is read and dropped
        return
    s.typed = not streams_as_text(types.get(s.key))
    head = "{" if not s.params else ", "
    out.args(head + json.dumps(s.key, ensure_ascii=False) + (": " if s.typed else ': "'))
    s.params += 1


def _value_text(
    tags: ParamTags, types: Mapping[str, list[str]], s: MarkupState, piece: str, out: Sink
) -> None:
    if not s.key or not piece:
        return
    if tags.trim_newlines:
        if s.fresh and piece.startswith("\n"):
            piece = piece[1:]
        piece = ("\n" if s.newline else "") + piece
        s.newline = piece.endswith("\n")
        piece = piece[:-1] if s.newline else piece
    s.fresh = False
    if not s.typed:
        out.args(_escaped(piece))
    elif len(s.value) + len(piece) <= MAX_TYPED:
        s.value += piece
    else:  # too long to hold: it goes on as a string
        out.args('"' + _escaped(s.value + piece))
        s.typed, s.value = False, ""


def _close_value(types: Mapping[str, list[str]], s: MarkupState, out: Sink) -> None:
    if s.key:
        if s.typed:
            out.args(json.dumps(coerce(s.value, types.get(s.key) or ()), ensure_ascii=False))
        else:
            out.args('"')
    s.key, s.value, s.typed = "", "", False


def _escaped(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]
