"""JSON text rewritten, as it streams, the way `json.dumps(json.loads(text), ensure_ascii=False)`
writes it (or, `ascii`, `json.dumps(json.loads(text))`).

Where vLLM's whole answer re-serializes a model's JSON (hermes' and llama3_json's call
arguments, a "required" call's parameters), a stream of the model's raw text would end as
other text than the whole answer. This turns raw JSON into that canonical form piece by
piece: whitespace between tokens goes, `,` and `:` get their one space, a string is decoded
and encoded again (escapes as Python's json writes them, other characters as they are), a
number or literal is held until it ends and then written as Python reads it. The state is a
few fields: whether a string is open, a pending escape (at most a surrogate pair's twelve
characters) and a number or literal so far (bounded).

What it cannot make canonical is text that is not JSON: it passes such characters through
(a whole answer of invalid JSON is not JSON either).
"""

from __future__ import annotations

import json
import re
from typing import Annotated

import msgspec
from msgspec import Meta

MAX_ATOM = 512  # a number or literal longer than this is passed on as it is
_SHORT = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}
_NEEDS_ESCAPE = re.compile(r'["\\\x00-\x1f]')
_STRING_STOP = re.compile(r'["\\]')
_ATOM_END = re.compile(r'[\s,:\]}\["{]')
_SIMPLE_ESCAPES = {
    "n": "\n",
    "r": "\r",
    "t": "\t",
    "b": "\b",
    "f": "\f",
    "/": "/",
    "\\": "\\",
    '"': '"',
}


class CanonState(msgspec.Struct, array_like=True, omit_defaults=True):
    in_string: bool = False
    escape: Annotated[str, Meta(max_length=12)] = ""  # an escape not yet complete
    atom: Annotated[str, Meta(max_length=MAX_ATOM)] = ""  # a number or literal so far
    # json.dumps's own default: every character past ASCII escaped (harmony's arguments)
    ascii: bool = False


def step(s: CanonState, text: str) -> str:
    """The canonical text for the next raw piece; `s` is updated in place."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        if s.in_string:
            i = _string(s, text, i, out)
            continue
        if s.atom:
            m = _ATOM_END.search(text, i)
            end = n if m is None else m.start()
            s.atom += text[i:end]
            i = end
            if len(s.atom) > MAX_ATOM:
                out.append(s.atom)
                s.atom = ""
            elif m is not None:
                out.append(_atom(s.atom))
                s.atom = ""
            continue
        ch = text[i]
        i += 1
        if ch in " \t\r\n":
            continue
        if ch == '"':
            s.in_string = True
            out.append('"')
        elif ch == ",":
            out.append(", ")
        elif ch == ":":
            out.append(": ")
        elif ch in "{}[]":
            out.append(ch)
        else:
            s.atom = ch
    return "".join(out)


def finish(s: CanonState) -> str:
    """What was held at the end of the value (a number, or an unfinished escape)."""
    held = _atom(s.atom) if s.atom else s.escape
    s.atom = s.escape = ""
    return held


def _string(s: CanonState, text: str, i: int, out: list[str]) -> int:
    """Inside a string: plain characters re-escaped as json writes them; escapes decoded."""
    n = len(text)
    if s.escape:
        need = _escape_length(s.escape + text[i : i + 12])
        take = min(need - len(s.escape), n - i)
        s.escape += text[i : i + take]
        i += take
        if len(s.escape) == need:
            out.append(_escaped(_decode_escape(s.escape), s.ascii))
            s.escape = ""
        return i
    m = _STRING_STOP.search(text, i)
    end = n if m is None else m.start()
    out.append(_escaped(text[i:end], s.ascii))
    if m is None:
        return n
    if m.group() == '"':
        s.in_string = False
        out.append('"')
        return end + 1
    s.escape = "\\"
    return end + 1


def _escape_length(esc: str) -> int:
    """How long the escape that `esc` starts is: 2, 6 (\\uXXXX) or 12 (a surrogate pair)."""
    if len(esc) < 2 or esc[1] != "u":
        return 2
    if len(esc) < 6:
        return 6
    code = int(esc[2:6], 16) if _hex(esc[2:6]) else 0
    if not 0xD800 <= code < 0xDC00:
        return 6
    if len(esc) >= 8 and esc[6:8] != "\\u":
        return 6  # a lone high surrogate
    if len(esc) >= 12 and not (_hex(esc[8:12]) and 0xDC00 <= int(esc[8:12], 16) < 0xE000):
        return 6
    return 12


def _hex(s: str) -> bool:
    return len(s) == 4 and all(c in "0123456789abcdefABCDEF" for c in s)


def _decode_escape(esc: str) -> str:
    if esc[1] != "u":
        return _SIMPLE_ESCAPES.get(esc[1], esc)
    try:
        return json.loads(f'"{esc}"')
    except ValueError:
        return esc


def _escaped(text: str, ascii: bool) -> str:
    if ascii:  # past printable ASCII (DEL too), \uXXXX as json writes it
        return json.dumps(text)[1:-1]
    if not _NEEDS_ESCAPE.search(text):
        return text
    return _NEEDS_ESCAPE.sub(lambda m: _SHORT.get(m.group(), f"\\u{ord(m.group()):04x}"), text)


def _atom(atom: str) -> str:
    try:
        return json.dumps(json.loads(atom))
    except ValueError:
        return atom
