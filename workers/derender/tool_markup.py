"""Tool calls written as markup, parsed as pure incremental steps.

Most open model families write a call as markers around its name and its arguments:

    qwen3_coder, qwen3_xml   <tool_call><function=NAME><parameter=K>V</parameter></function>…
    seed_oss                 the same XML in <seed:tool_call> blocks
    minimax_m2               <minimax:tool_call><invoke name="NAME"><parameter name="K">V…
    glm45, glm47             <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…
    deepseek_v32, _v4        <｜DSML｜invoke name="NAME"><｜DSML｜parameter name="K" string="…">V…
    kimi_k2                  <|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{…}
    mistral                  [TOOL_CALLS]NAME[ARGS]{…}

Each family is a table (`Family`): its markers, and how each moves the parser from one phase
to the next (vLLM 0.33 describes these formats as such tables too; read its `vllm/parser`
for the behaviour). A step finds the earliest marker in the new text, holding back a tail
that may be the start of one, so markers split across deltas are found and nothing emitted
is taken back. Arguments written as tags go through a second, smaller scanner (`ParamTags`)
that finds keys and values; a value is turned into JSON as the tool's schema types it
(`tokenway.tool_params`): a string value streams as it arrives, any other is held until it
ends (at most `MAX_TYPED` characters; longer, it streams as a string). Arguments written as
JSON (Kimi's, Mistral's) pass as written.

What the whole answer holds, for every chunking: content is the text before the first call
(whitespace alone before a call is dropped, and, where the family strips it, whitespace
just before one); text after a call is dropped; a call whose name is empty, or (where the
family checks) not one of the request's tools, is dropped with its arguments.
"""

from __future__ import annotations

import enum
import functools
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Protocol

import msgspec
from msgspec import Meta

from tokenway.tool_params import streams_as_text, typed
from tokenway.wire import ToolParams

MAX_NAME = 512  # as tools.py: a longer name is not a function name
MAX_KEY = 256
# a typed value held for conversion; past it, it streams as a string. At most 4 bytes a
# character, it keeps the state well within what a chunk may carry (stream_state, 12 KiB).
MAX_TYPED = 1024
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
    ATTRS = 4  # after a key, its attributes up to ">" (DSML's string="true")


class MarkupState(msgspec.Struct, array_like=True, omit_defaults=True):
    """Everything a step needs from earlier text: a few small fields, never the output."""

    phase: Phase = Phase.CONTENT
    held: Annotated[str, Meta(max_length=64)] = ""  # may start a marker
    space: Annotated[str, Meta(max_length=MAX_SPACE)] = ""  # content whitespace held back
    called: bool = False  # a call was reported: content is over
    spoke: bool = False  # content other than whitespace went out
    name: Annotated[str, Meta(max_length=MAX_NAME)] = ""
    live: bool = False  # the current call was reported (its arguments are streamed)
    # the argument scanner
    where: Where = Where.OUT
    tag: Annotated[str, Meta(max_length=64)] = ""  # may start a parameter tag
    close: Annotated[int, Meta(ge=0)] = 0  # the key's closing tag, by index in ParamTags
    key: Annotated[str, Meta(max_length=MAX_KEY)] = ""
    params: Annotated[int, Meta(ge=0)] = 0  # parameters written into the JSON object
    attrs: Annotated[str, Meta(max_length=MAX_KEY)] = ""
    as_json: bool = False  # the value reads as JSON first (DSML without string="true")
    typed: bool = False  # the value is held for conversion (else streams as a string)
    # a typed value so far; JSON arguments: whitespace held back at their end
    value: Annotated[str, Meta(max_length=MAX_TYPED)] = ""
    # JSON arguments' first value: its nesting, and whether it ended (the rest is dropped)
    depth: Annotated[int, Meta(ge=0)] = 0
    in_string: bool = False
    escape: bool = False
    ended: bool = False
    fresh: bool = True  # nothing of the value seen yet (a leading newline is markup)
    newline: bool = False  # a newline held back (a trailing one is markup)


class Sink(Protocol):
    """Where a step's output goes."""

    content: list[str]

    def call(self, name: str, cid: str | None = None) -> None: ...  # a call starts

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
    attrs: bool = False  # attributes follow the key up to ">" (DSML)
    enders: tuple[str, ...] = field(init=False)  # what ends a value

    def __post_init__(self) -> None:
        ends = (self.value_close, *self.opens) if self.open_ends_value else (self.value_close,)
        object.__setattr__(self, "enders", ends)


def _plain(header: str) -> tuple[str, str | None] | None:
    name = header.strip()
    return (name, None) if name else None


@dataclass(frozen=True, slots=True)
class Family:
    moves: Mapping[tuple[Phase, str], tuple[Phase, Act]]
    params: ParamTags | None  # None: arguments are JSON, passed on as written
    check_names: bool  # a call to a tool the request does not have is dropped
    # markers whose text goes on into the phase they lead to (GLM's first `<arg_key>`)
    keep: frozenset[str] = frozenset()
    strip: bool = True  # content before a call loses its whitespace at the end
    first_value: bool = False  # JSON arguments end with their first value (text after it goes)
    # a call's name (and the model's own id for it) from the text that names it
    header: Callable[[str], tuple[str, str | None] | None] = _plain
    markers: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        found = {m for _, m in self.moves}
        object.__setattr__(self, "markers", tuple(sorted(found, key=len, reverse=True)))


def _moves(*rows: tuple[tuple[Phase, ...], tuple[str, ...], Phase, Act]) -> dict:
    return {(p, m): (to, act) for phases, marks, to, act in rows for p in phases for m in marks}


_C, _P, _N, _A, _B = Phase.CONTENT, Phase.PREAMBLE, Phase.NAME, Phase.ARGS, Phase.BETWEEN
_START, _END, _RESTART, _NONE = Act.START, Act.END, Act.RESTART, Act.NONE


def _qwen(block: str, block_end: str) -> Family:
    """Qwen3-Coder's XML calls in a block (`<tool_call>`; Seed-OSS: `<seed:tool_call>`)."""
    return Family(
        moves=_moves(
            ((_C, _B), (block,), _P, _NONE),
            ((_C, _B), ("<function=",), _N, _START),
            ((_P,), ("<function=",), _N, _NONE),
            ((_P, _B), (block_end,), _C, _NONE),
            ((_N,), (">",), _A, _NONE),
            ((_N, _A), ("</function>",), _B, _END),
            ((_N,), (block_end,), _C, _END),
            ((_N,), (block,), _P, _END),
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


_QWEN = _qwen("<tool_call>", "</tool_call>")
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
_KIMI_ID = re.compile(r"(.+:\d+)")


def _kimi(header: str) -> tuple[str, str | None] | None:
    """`functions.NAME:N` names the call and is its id (Kimi's templates write it back)."""
    m = _KIMI_ID.match(header.strip())
    if m is None:
        return None
    cid = m.group(1).strip()
    name = cid.split(":")[0].removeprefix("functions.")
    return (name, cid) if name else None


_SECTION, _SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
_KIMI_FAMILY = Family(
    moves=_moves(
        ((_C,), (_SECTION,), _P, _NONE),
        ((_P, _B), ("<|tool_call_begin|>",), _N, _START),
        ((_P, _B), (_SECTION_END,), _P, _NONE),
        ((_N,), ("<|tool_call_argument_begin|>",), _A, _NONE),
        ((_A,), ("<|tool_call_end|>",), _B, _END),
        ((_A,), (_SECTION_END,), _P, _END),
    ),
    params=None,
    check_names=False,
    strip=False,
    header=_kimi,
)


def _dsml(blocks: tuple[str, ...], block_end: str) -> Family:
    """DeepSeek's DSML: `<｜DSML｜invoke name="…">` calls in a block, parameters typed by
    their `string` attribute (V3.2: `function_calls` blocks; V4: `tool_calls`, and two
    spellings of its opening seen from the model)."""
    d = "｜DSML｜"
    invoke = f'<{d}invoke name="'
    opens, closes = tuple(f"<{d}{b}>" for b in blocks), (f"</{d}{block_end}>",)
    return Family(
        moves=_moves(
            ((_C, _B), opens, _P, _NONE),
            ((_C, _P, _B), (invoke,), _N, _START),
            ((_N,), ('">',), _A, _NONE),
            ((_A,), (f"</{d}invoke>", *closes), _B, _END),
            ((_B,), closes, _B, _NONE),
        ),
        params=ParamTags(
            opens=(f'<{d}parameter name="',),
            closes=('"',),
            value_open=None,
            value_close=f"</{d}parameter>",
            open_ends_value=True,
            trim_newlines=False,
            strip_key=False,
            attrs=True,
        ),
        check_names=False,
        strip=False,
    )


# Mistral's current models (tokenizer v11+): `[TOOL_CALLS]NAME[ARGS]{...}` (or NAME{...}),
# one marker per call, no closing marker.
_MISTRAL = Family(
    moves=_moves(
        ((_C,), ("[TOOL_CALLS]",), _N, _START),
        ((_N,), ("[ARGS]", "{"), _A, _NONE),
        ((_A,), ("[TOOL_CALLS]",), _N, _RESTART),
    ),
    params=None,
    check_names=False,
    keep=frozenset({"{"}),
    first_value=True,
)

FAMILIES: dict[str, Family] = {
    "deepseek_v32": _dsml(("function_calls",), "function_calls"),
    "deepseek_v4": _dsml(("tool_calls", "toolcalls", "tool"), "tool_calls"),
    "glm45": _GLM,
    "glm47": _GLM,
    "kimi_k2": _KIMI_FAMILY,
    "minimax_m2": _MINIMAX,
    "mistral": _MISTRAL,
    "qwen3_coder": _QWEN,
    "qwen3_xml": _QWEN,
    "seed_oss": _qwen("<seed:tool_call>", "</seed:tool_call>"),
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
    firsts, longest = _shape(markers)
    for p in range(max(i, len(text) - longest + 1), len(text)):
        if text[p] in firsts and any(m.startswith(text[p:]) for m in markers):
            return p
    return len(text)


@functools.cache
def _shape(markers: tuple[str, ...]) -> tuple[frozenset[str], int]:
    """The characters `markers` start with (a tail starting otherwise is text), and the
    longest's length."""
    return frozenset(m[0] for m in markers), max(len(m) for m in markers)


def _longer(marker: str, markers: tuple[str, ...]) -> bool:
    return any(len(m) > len(marker) and m.startswith(marker) for m in markers)


# -- text by phase -----------------------------------------------------------------------------


def _text(family: Family, tools: list[ToolParams], s: MarkupState, text: str, out: Sink) -> None:
    if not text:
        return
    if s.phase == Phase.CONTENT:
        _content(family, s, text, out)
    elif s.phase == Phase.NAME:
        s.name = (s.name + text)[:MAX_NAME]
    elif s.phase == Phase.ARGS and s.live:
        if family.params is None:
            _json_args(family, s, text, out)
        else:
            _args(family.params, _types(tools, s.name), s, text, out)


def _content(family: Family, s: MarkupState, text: str, out: Sink) -> None:
    """Content before the first call. Whitespace at its end is held until more content
    (released), a call (dropped: content before calls is stripped, or whitespace alone is
    none) or the end (released) says what it is."""
    if s.called:
        return
    if s.spoke and not family.strip:
        out.content.append(text)
        return
    body = text.rstrip()
    if body:
        out.content.append(s.space + body)
        s.space, s.spoke = "", True
        if not family.strip:
            out.content.append(text[len(body) :])
            return
    s.space += text[len(body) :]
    if len(s.space) > MAX_SPACE:
        out.content.append(s.space)
        s.space = ""


# -- calls -------------------------------------------------------------------------------------


def _named(family: Family, tools: list[ToolParams], s: MarkupState, out: Sink) -> None:
    """The name is complete: report the call, unless it has no name or names no tool."""
    header = family.header(s.name)
    name, cid = header if header is not None else ("", None)
    known = not family.check_names or not tools or any(t.name == name for t in tools)
    s.live = bool(name) and known
    if s.live:
        s.name, s.called, s.space = name, True, ""
        out.call(name, cid)


def _end_call(
    family: Family, tools: list[ToolParams], s: MarkupState, out: Sink, parallel: bool
) -> None:
    """A call ends (its closing marker, the next call's, or the end of output): what is
    open closes, so its arguments are one JSON object."""
    if s.phase == Phase.NAME:
        _named(family, tools, s, out)
    if s.live:
        if family.params is None:
            out.args("" if s.params else "{}")
        else:
            types = _types(tools, s.name)
            tag, s.tag = s.tag, ""
            if s.where == Where.VALUE:
                _value_text(family.params, types, s, tag, out)
                _close_value(types, s, out)
            out.args("}" if s.params else "{}")
        if not parallel:
            s.phase = Phase.DONE
    s.live, s.name, s.where, s.params, s.key, s.tag = False, "", Where.OUT, 0, "", ""
    s.value, s.fresh, s.depth, s.in_string, s.escape, s.ended = "", True, 0, False, False, False


def _types(tools: list[ToolParams], name: str) -> Mapping[str, list[str]]:
    return next((t.types for t in tools if t.name == name), {})


def _json_args(family: Family, s: MarkupState, text: str, out: Sink) -> None:
    """Arguments written as JSON go out as written, less the whitespace around them (and,
    for Mistral's, whatever follows their first value, as vLLM's whole answer drops it)."""
    if s.ended:
        return
    if s.fresh:
        text = text.lstrip()
        if not text:
            return
        s.fresh = False
    if family.first_value and (end := _value_end(s, text)) is not None:
        text, s.ended = text[:end], True
    body = text.rstrip()
    if body:
        out.args(s.value + body)
        s.value, s.params = "", 1
    s.value += text[len(body) :]
    if len(s.value) > MAX_SPACE:
        out.args(s.value)
        s.value = ""


def _value_end(s: MarkupState, text: str) -> int | None:
    """Where the arguments' first JSON object, array or string ends in `text`; None while
    it goes on."""
    for i, ch in enumerate(text):
        if s.in_string:
            if s.escape:
                s.escape = False
            elif ch == "\\":
                s.escape = True
            elif ch == '"':
                s.in_string = False
                if not s.depth:
                    return i + 1
        elif ch == '"':
            s.in_string = True
        elif ch in "{[":
            s.depth += 1
        elif ch in "}]" and s.depth:
            s.depth -= 1
            if not s.depth:
                return i + 1
    return None


# -- arguments written as tags -------------------------------------------------------------------

_STRING_ATTR = re.compile(r'string="([^"]*)"')


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
            if tags.attrs:
                s.where, s.attrs = Where.ATTRS, ""
            elif tags.value_open is None:
                _open_value(tags, types, s, out)
            else:
                s.where = Where.GAP
        elif s.where == Where.ATTRS:
            j = text.find(">", i)
            s.attrs = (s.attrs + text[i : len(text) if j < 0 else j])[:MAX_KEY]
            if j < 0:
                return
            i = j + 1
            attrs = s.attrs.strip()
            declared = _STRING_ATTR.fullmatch(attrs)
            if attrs and declared is None:  # not a parameter tag: its value is dropped
                s.key = ""
            s.as_json = declared is None or declared.group(1) != "true"
            _open_value(tags, types, s, out)
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
    s.typed = s.as_json or not streams_as_text(types.get(s.key))
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
            value = typed(s.value, types.get(s.key), s.as_json)
            out.args(json.dumps(value, ensure_ascii=False))
        else:
            out.args('"')
    s.key, s.value, s.typed, s.as_json = "", "", False, False


def _escaped(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]
