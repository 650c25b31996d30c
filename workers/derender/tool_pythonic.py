"""Tool calls written as a Python list of calls, parsed as pure incremental steps.

Llama 4 (`llama4_pythonic`, after an optional `<|python_start|>`), OLMo 3 and others
(`pythonic`) answer a call as `[get_weather(city="Paris", days=3), search(q='x')]`. vLLM
reads the whole output as Python: an output that opens with the list is its calls, each
call's keyword arguments a JSON object (`json.dumps` of their values: strings, numbers,
True/False/None or JSON's true/false/null, lists, tuples and sets as lists, dicts, a sign
before a number); positional arguments are ignored. Any other output is content.

Here a step reads only the new text (what a reader cannot decide yet, a few characters, is
held for the next). A string argument streams as it arrives, its escapes decoded and written
as JSON; any other value is held until it ends and read with Python's own parser (past
`MAX_LITERAL` characters it streams as a string of its text). vLLM's whole answer turns the
entire output into content when any part of it does not read; a stream that has sent calls
cannot, so here a value that is no literal comes out as its text (a JSON string), and text
after the list is dropped.
"""

from __future__ import annotations

import ast
import enum
import json
import re
from typing import Annotated, Any, Protocol

import msgspec
from msgspec import Meta

PYTHON_START = "<|python_start|>"
MAX_NAME = 512
MAX_LITERAL = 1024  # as tool_markup.MAX_TYPED: the state stays within stream_state's bound
_SEPARATORS = re.compile(r"[\s,]*")
_NAME = re.compile(r"[\w.]+")
_KEYWORD = re.compile(r"([A-Za-z_]\w*)\s*(=?)")
_STRING_START = re.compile(r"([rRuU]?)('''|\"\"\"|'|\")")
_LITERAL_NAMES = {"null": None, "true": True, "false": False}
_SIMPLE = {
    "\\": "\\", "'": "'", '"': '"', "a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
    "t": "\t", "v": "\v", "\n": "",
}  # fmt: skip


class Phase(enum.IntEnum):
    START = 0  # the output's first characters decide
    PLAIN = 1  # not calls: all content
    LIST = 2  # in the list, between calls
    NAME = 3  # a call's name
    ARGS = 4  # in a call's parentheses, between arguments
    KEY = 5  # an argument: a keyword's name, or a positional value's start
    VALUE = 6  # a keyword argument's value
    SKIP = 7  # a positional argument, read past
    DONE = 8  # the list closed: the rest is dropped


class PyState(msgspec.Struct, array_like=True, omit_defaults=True):
    phase: Phase = Phase.START
    held: Annotated[str, Meta(max_length=MAX_NAME + 64)] = ""  # text a reader cannot decide yet
    opened: bool = False  # the list's `[` was read
    name: Annotated[str, Meta(max_length=MAX_NAME)] = ""
    live: bool = False  # the current call was reported
    params: Annotated[int, Meta(ge=0)] = 0  # arguments written into its JSON object
    quote: str = ""  # a streaming string's closing quote
    raw_string: bool = False  # an r-string: backslashes are text
    # a held value: its text, and its brackets and open string so far
    literal: Annotated[str, Meta(max_length=MAX_LITERAL)] = ""
    held_value: bool = False
    spilled: bool = False  # the held value grew past MAX_LITERAL: it goes on as a string
    depth: Annotated[int, Meta(ge=0)] = 0
    inner: str = ""
    inner_escape: bool = False


class Sink(Protocol):
    content: list[str]

    def call(self, name: str, cid: str | None = None) -> None: ...

    def args(self, text: str) -> None: ...


def step(s: PyState, text: str, out: Sink, parallel: bool, opener: str | None) -> None:
    """Parse the next piece of output; `opener`: a marker the list may follow."""
    text, s.held = s.held + text, ""
    i = 0
    if s.phase == Phase.START:
        if opener and text.startswith(opener):
            i, s.phase = len(opener), Phase.LIST
        elif text.startswith("["):
            i, s.phase, s.opened = 1, Phase.LIST, True
        elif not text or (opener and opener.startswith(text)):
            s.held = text
            return
        else:
            s.phase = Phase.PLAIN
    while i < len(text) and s.phase not in (Phase.PLAIN, Phase.DONE) and not s.held:
        j = _READERS[s.phase](s, text, i, out, parallel)
        if j is None:  # undecided: read again with the next piece
            s.held = text[i:]
            return
        i = j
    if s.phase == Phase.PLAIN:
        out.content.append(text[i:])


def finish(s: PyState, out: Sink) -> None:
    """The end of output: undecided text is content; an open call closes as it stands."""
    held, s.held = s.held, ""
    if s.phase in (Phase.START, Phase.PLAIN):
        out.content.append(held)
    elif s.phase in (Phase.NAME, Phase.ARGS, Phase.KEY, Phase.VALUE, Phase.SKIP):
        if s.phase == Phase.NAME:
            _called(s, out)
        if s.live and s.phase == Phase.VALUE:
            if s.quote:
                out.args(_json(held) + '"')
            elif s.spilled:
                out.args(_json(held) + '"')
            elif s.held_value or held.strip():
                out.args(_dumped(s.literal + held))
            else:
                out.args("null")
        _end_call(s, out, parallel=True)


# -- readers, one per phase: where each stopped, or None to wait for more text -------------


def _list(s: PyState, text: str, i: int, out: Sink, parallel: bool) -> int | None:
    i = _SEPARATORS.match(text, i).end()  # type: ignore[union-attr]
    if i >= len(text):
        return i
    ch = text[i]
    if not s.opened:  # after <|python_start|>: the list opens, or this is no list
        s.opened = ch == "["
        if not s.opened:
            s.phase = Phase.PLAIN
            return i
        return i + 1
    if ch == "]":
        s.phase = Phase.DONE
        return i + 1
    s.phase, s.name = Phase.NAME, ""
    return i


def _name(s: PyState, text: str, i: int, out: Sink, parallel: bool) -> int | None:
    m = _NAME.match(text, i)
    if m is not None:
        s.name = (s.name + m.group())[:MAX_NAME]
        return m.end()
    if text[i].isspace():
        return i + 1
    if text[i] != "(":  # not a call: the list is not calls any more
        s.phase = Phase.DONE
        return i
    _called(s, out)
    s.phase = Phase.ARGS
    return i + 1


def _called(s: PyState, out: Sink) -> None:
    s.live, s.params = bool(re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*", s.name)), 0
    if s.live:
        out.call(s.name)


def _args(s: PyState, text: str, i: int, out: Sink, parallel: bool) -> int | None:
    i = _SEPARATORS.match(text, i).end()  # type: ignore[union-attr]
    if i >= len(text):
        return i
    if text[i] == ")":
        _end_call(s, out, parallel)
        return i + 1
    s.phase = Phase.KEY
    return i


def _key(s: PyState, text: str, i: int, out: Sink, parallel: bool) -> int | None:
    """`name=` starts a keyword argument; anything else is a positional one."""
    m = _KEYWORD.match(text, i)
    if m is not None and m.end() + 1 > len(text) and len(text) - i <= MAX_NAME:
        return None  # the name, its `=`, or a second `=` may follow
    s.literal, s.held_value, s.spilled, s.depth = "", False, False, 0
    s.inner, s.inner_escape = "", False
    if m is None or not m.group(2) or text.startswith("==", m.end() - 1):
        s.phase = Phase.SKIP
        return i
    if s.live:
        head = "{" if not s.params else ", "
        out.args(head + json.dumps(m.group(1), ensure_ascii=False) + ": ")
        s.params += 1
    s.phase, s.quote = Phase.VALUE, ""
    return m.end()


def _value(s: PyState, text: str, i: int, out: Sink, parallel: bool) -> int | None:
    if s.quote:
        return _string(s, text, i, out)
    if s.held_value:
        return _literal_text(s, text, i, out)
    while i < len(text) and text[i].isspace():
        i += 1
    if i >= len(text):
        return i
    m = _STRING_START.match(text, i)
    if m is not None:
        quote = m.group(2)
        if (
            len(quote) == 1
            and len(text) - m.start(2) < 3
            and text.endswith(quote * (len(text) - m.start(2)))
        ):
            return None  # one quote, or the start of three
        s.quote, s.raw_string = quote, m.group(1) in ("r", "R")
        if s.live:
            out.args('"')
        return m.end()
    if re.fullmatch(r"[rRuU]", text[i:]):
        return None  # a string's prefix, or a name
    s.held_value = True
    return _literal_text(s, text, i, out)


def _string(s: PyState, text: str, i: int, out: Sink) -> int:
    """Inside a streaming string: its text, escapes decoded, as JSON; a partial escape or
    closing quote is held."""
    parts: list[str] = []
    n, q = len(text), s.quote
    stop = None
    while i < n:
        j = i
        while j < n and text[j] != "\\" and text[j] != q[0]:
            j += 1
        parts.append(text[i:j])
        i = j
        if i >= n:
            break
        if text[i] == "\\":
            length = _escape_length(text, i, s.raw_string)
            if length is None:
                stop = i
                break
            esc = text[i : i + length]
            parts.append(esc if s.raw_string else _decoded(esc))
            i += length
            continue
        if text.startswith(q, i):  # closed
            if s.live:
                out.args(_json("".join(parts)) + '"')
            s.quote, s.phase = "", Phase.ARGS
            return i + len(q)
        if q.startswith(text[i:]):  # may close with the next piece
            stop = i
            break
        parts.append(text[i])
        i += 1
    if s.live and parts:
        out.args(_json("".join(parts)))
    if stop is not None:  # what went out stays out; the rest waits for the next piece
        s.held = text[stop:]
    return n


def _escape_length(text: str, i: int, raw: bool) -> int | None:
    """How long the escape at `text[i]` is; None while the text does not say yet."""
    if i + 1 >= len(text):
        return None
    c = text[i + 1]
    if raw:
        return 2
    fixed = {"x": 4, "u": 6, "U": 10}.get(c)
    if fixed is not None:
        return fixed if i + fixed <= len(text) else None
    if c == "N":
        end = text.find("}", i)
        return end - i + 1 if end >= 0 else (None if len(text) - i < 64 else 2)
    if c in "01234567":
        k = i + 1
        while k < len(text) and k < i + 4 and text[k] in "01234567":
            k += 1
        return k - i if k == i + 4 or k < len(text) else None
    return 2


def _decoded(esc: str) -> str:
    if len(esc) == 2 and esc[1] in _SIMPLE:
        return _SIMPLE[esc[1]]
    try:
        value = ast.literal_eval(f'"{esc}"')
    except (ValueError, SyntaxError):
        return esc
    return value if isinstance(value, str) else esc


def _literal_text(s: PyState, text: str, i: int, out: Sink) -> int:
    """A held value (or a positional one, skipped): its text up to the `,` or `)` that
    ends it, brackets and strings inside tracked."""
    n, start = len(text), i
    while i < n:
        ch = text[i]
        if s.inner:
            if s.inner_escape:
                s.inner_escape = False
            elif ch == "\\":
                s.inner_escape = True
            elif ch == s.inner:
                s.inner = ""
        elif ch in "'\"":
            s.inner = ch
        elif ch in "([{":
            s.depth += 1
        elif ch in ")]}" and s.depth:
            s.depth -= 1
        elif ch in ",)" and not s.depth:
            break
        i += 1
    if s.phase == Phase.VALUE:
        _hold_literal(s, text[start:i], out)
    if i >= n:
        return n
    if s.phase == Phase.VALUE and s.live:
        out.args('"' if s.spilled else _dumped(s.literal))
    s.literal, s.held_value, s.spilled, s.phase = "", False, False, Phase.ARGS
    return i


def _hold_literal(s: PyState, piece: str, out: Sink) -> None:
    """More of a held value's text; past MAX_LITERAL, the value goes on as a string of its
    text (nothing of it is lost)."""
    if s.spilled:
        if s.live:
            out.args(_json(piece))
    elif len(s.literal) + len(piece) > MAX_LITERAL:
        if s.live:
            out.args('"' + _json(s.literal + piece))
        s.literal, s.spilled = "", True
    else:
        s.literal += piece


def _skip(s: PyState, text: str, i: int, out: Sink, parallel: bool) -> int | None:
    return _literal_text(s, text, i, out)


def _end_call(s: PyState, out: Sink, parallel: bool) -> None:
    if s.live:
        out.args("}" if s.params else "{}")
    s.phase = Phase.LIST if parallel or not s.live else Phase.DONE
    s.live, s.name, s.params, s.quote, s.literal = False, "", 0, "", ""
    s.held_value = s.spilled = False


_READERS = {
    Phase.LIST: _list,
    Phase.NAME: _name,
    Phase.ARGS: _args,
    Phase.KEY: _key,
    Phase.VALUE: _value,
    Phase.SKIP: _skip,
}


# -- values ------------------------------------------------------------------------------------


def _json(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _dumped(text: str) -> str:
    """A held value as JSON: read as vLLM reads a call argument; its text when no literal."""
    try:
        value = _value_of(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        value = text.strip()
    return json.dumps(value, ensure_ascii=False)


def _value_of(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, (str, int, float)):
            return node.value
        raise ValueError("not a JSON value")
    if isinstance(node, ast.Dict):
        keys = [k.value if isinstance(k, ast.Constant) else None for k in node.keys]
        if not all(isinstance(k, ast.Constant) for k in node.keys):
            raise ValueError("a dict key that is no literal")
        return {k: _value_of(v) for k, v in zip(keys, node.values, strict=True)}
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [_value_of(v) for v in node.elts]
    if isinstance(node, ast.JoinedStr) and all(isinstance(p, ast.Constant) for p in node.values):
        return "".join(str(p.value) for p in node.values if isinstance(p, ast.Constant))
    if isinstance(node, ast.Name) and node.id in _LITERAL_NAMES:
        return _LITERAL_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _value_of(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    raise ValueError("not a literal")
