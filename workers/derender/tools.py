"""Tool-call parsing as pure incremental steps: `(state, text delta) -> (content, calls, state')`.

vLLM's tool parsers re-read the whole output on every chunk. Here a step reads only the new
text: what it needs from the past is `ToolState`, a handful of small fields (where the parser
stands, a held tail that may be the start of a marker, the JSON scanner's nesting). Argument
text is passed on as it arrives and never kept, so the state does not grow with the output.

What is parsed follows `ParseContext.tool_choice`, as vLLM 0.33 serves it:
- "auto" with a `tool_parser`: the model's own call syntax (`deepseek_v31`, `hermes`); text
  before the first call is content, text after it is dropped.
- "named": the whole output is the arguments of one call to `tool_name`.
- "required": the output is a JSON list `[{"name": ..., "parameters": {...}}, ...]`.

Arguments are the model's raw JSON text (vLLM's streaming form), so a non-streaming answer
(one step over the whole text, then `finish`) equals any chunking of the same text.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from tokenway.errors import InvalidRequest
from tokenway.parsers import TOOL_PARSERS
from tokenway.wire import ParseContext, ToolChoice
from workers.derender import json_canon, tool_markup, tool_pythonic
from workers.derender.json_canon import CanonState
from workers.derender.tool_markup import MarkupState
from workers.derender.tool_pythonic import PyState

CALL_ID_PREFIX = "chatcmpl-tool-"
_ALNUM = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
# the parsers of a Python list of calls, and the marker that may come before it
_PYTHONIC = {"pythonic": None, "llama4_pythonic": tool_pythonic.PYTHON_START}

# DeepSeek-V3.1's markers: each one is a single (non-special) token of the vocabulary.
DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DS_CALLS_END = "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DS_CALL_END = "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"
HERMES_BEGIN = "<tool_call>"
HERMES_END = "</tool_call>"
MISTRAL_CALLS = "[TOOL_CALLS]"  # before v11: a JSON list of calls follows

_MARKERS = (DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP)
MAX_HELD = max(len(m) for m in (*_MARKERS, HERMES_BEGIN, HERMES_END)) - 1
MAX_NAME = 512  # OpenAI caps function names at 64 characters; a longer one is not a name
MAX_KEY = 32  # longer than any key we look for, so a capped key never matches one
MAX_SPACE = 256  # leading whitespace held back; past it, it is content


class Phase(enum.IntEnum):
    CONTENT = 0  # auto: content, until the first call marker
    BLOCK = 1  # deepseek_v31: in the calls block, between calls
    NAME = 2  # deepseek_v31: reading a function name
    ARGS = 3  # deepseek_v31: arguments up to the call's end marker; named: all output
    OPEN = 4  # hermes: after <tool_call>, before its JSON object
    OBJECT = 5  # hermes, required: inside a call's JSON object
    AFTER = 6  # hermes: after the object, before </tool_call>
    BETWEEN = 7  # hermes: after </tool_call>; required: in the list, between objects
    LIST = 8  # required: before the list opens
    DONE = 9  # the calls are over: the rest of the output is dropped
    PLAIN = 10  # llama3_json: the output did not open with a call: all of it is content


class Expect(enum.IntEnum):
    """Where a call object's scanner stands at the object's own level."""

    KEY = 0
    IN_KEY = 1
    COLON = 2
    VALUE = 3
    IN_VALUE = 4
    NEXT = 5  # after a value: "," or "}"


class Role(enum.IntEnum):
    """What the value being read is to the call."""

    OTHER = 0
    NAME = 1
    ARGS = 2


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta | None = None


class ToolState(msgspec.Struct, array_like=True, omit_defaults=True):
    """Everything a step needs from earlier text; `calls > 0` once any call was reported."""

    phase: Phase = Phase.CONTENT
    held: Annotated[str, Meta(max_length=MAX_HELD)] = ""  # may be the start of a marker
    calls: Annotated[int, Meta(ge=0)] = 0  # calls announced: the next call's index
    announced: bool = False  # the current call's first delta went out (its index: calls - 1)
    # The name until the call is announced. deepseek_v31: the text read so far; JSON formats:
    # its raw JSON text while it is read, then (name_done) the decoded name.
    name: Annotated[str, Meta(max_length=MAX_NAME)] = ""
    name_done: bool = False
    has_args: bool = False  # the current call's arguments started
    # The JSON scanner of a call object (and of the required list's own level).
    expect: Expect = Expect.KEY
    role: Role = Role.OTHER
    depth: Annotated[int, Meta(ge=0)] = 0  # nesting inside the value being read
    in_string: bool = False
    escape: bool = False
    key: Annotated[str, Meta(max_length=MAX_KEY)] = ""
    # Arguments that came before the name (JSON formats): held until the name is known.
    pending: str = ""
    markup: MarkupState | None = None  # a markup family's parser (tool_markup.py)
    pythonic: PyState | None = None  # a Python list of calls (tool_pythonic.py)
    # content so far is whitespace alone: held, as no content if a call follows
    space: Annotated[str, Meta(max_length=MAX_SPACE)] = ""
    spoke: bool = False  # content other than whitespace went out
    # a JSON call's arguments value, rewritten as vLLM's whole answer writes it back
    canon: CanonState | None = None
    bare: bool = False  # Mistral before v11: one call object, not a list, after the marker


def call_id(response_id: str, index: int, short: bool = False) -> str:
    """The same id for a call on every chunk, retry and worker. `short`: nine letters and
    digits, the only ids Mistral's templates take back in a later turn."""
    digest = hashlib.blake2b(f"{response_id}\x00{index}".encode(), digest_size=8)
    if not short:
        return CALL_ID_PREFIX + digest.hexdigest()
    number = int.from_bytes(digest.digest(), "big")
    return "".join(_ALNUM[(number >> (6 * k)) % len(_ALNUM)] for k in range(9))


def start(ctx: ParseContext) -> ToolState | None:
    """The first state, or None when this request's output is not parsed for calls."""
    choice = _reading(ctx)
    if choice == "none":
        return None
    if choice == "named":
        if not ctx.tool_name:
            raise InvalidRequest('tool_choice "named" needs a tool_name', param="tool_choice")
        return ToolState(phase=Phase.ARGS)
    if choice == "required":
        return ToolState(phase=Phase.LIST)
    if ctx.tool_parser is None:
        return None
    if ctx.tool_parser not in TOOL_PARSERS:
        raise InvalidRequest(
            f"unknown tool parser {ctx.tool_parser!r}; known: {', '.join(TOOL_PARSERS)}",
            param="tool_parser",
        )
    if ctx.tool_parser == "mistral" and ctx.calls_listed:
        return ToolState()
    if ctx.tool_parser in tool_markup.FAMILIES:
        return ToolState(markup=MarkupState())
    if ctx.tool_parser in _PYTHONIC:
        return ToolState(pythonic=PyState())
    return ToolState()


def step(
    ctx: ParseContext, state: ToolState, text: str, response_id: str
) -> tuple[str, list[ToolCallDelta], ToolState]:
    """Parse the next piece of output text: (content delta, call deltas, next state)."""
    s = msgspec.structs.replace(state)
    if s.canon is not None:  # stepped in place: the caller's state stays as it was
        s.canon = msgspec.structs.replace(s.canon)
    out = Emitted(ctx)
    choice = _reading(ctx)
    if choice == "named":
        if text:
            if not s.announced:
                _announce(s, out, ctx.tool_name or "")
            _args(s, out, text)
    elif choice == "required":
        _required(s, text, out, ctx.parallel_tool_calls)
    elif choice == "auto" and ctx.tool_parser == "deepseek_v31":
        _deepseek(s, text, out, ctx.parallel_tool_calls)
    elif choice == "auto" and ctx.tool_parser == "hermes":
        _hermes(s, text, out, ctx.parallel_tool_calls)
    elif choice == "auto" and ctx.tool_parser in ("llama3_json", "llama4_json"):
        _llama(s, text, out, ctx.parallel_tool_calls)
    elif choice == "auto" and ctx.tool_parser == "mistral" and ctx.calls_listed:
        _mistral_list(s, text, out, ctx.parallel_tool_calls)
    elif choice == "auto" and ctx.tool_parser in _PYTHONIC:
        assert state.pythonic is not None
        s.pythonic = msgspec.structs.replace(state.pythonic)
        opener = _PYTHONIC[ctx.tool_parser or ""]
        tool_pythonic.step(s.pythonic, text, _Sink(s, out), ctx.parallel_tool_calls, opener)
    elif choice == "auto" and (family := tool_markup.FAMILIES.get(ctx.tool_parser or "")):
        assert state.markup is not None
        s.markup = msgspec.structs.replace(state.markup)
        sink = _Sink(s, out)
        tool_markup.step(family, ctx.tools, s.markup, text, sink, ctx.parallel_tool_calls)
    else:
        raise InvalidRequest(
            f"no tool parsing for tool_choice {choice!r} with parser {ctx.tool_parser!r}",
            param="tool_choice",
        )
    return "".join(out.content), out.deltas(response_id, _forced(ctx)), s


def finish(
    ctx: ParseContext, state: ToolState, response_id: str
) -> tuple[str, list[ToolCallDelta]]:
    """The end of output: release what was held (a tail that turned out not to be a marker)."""
    s = msgspec.structs.replace(state)
    out = Emitted(ctx)
    if _reading(ctx) == "named":
        if not s.announced:  # a forced call is always reported, even on empty output
            _announce(s, out, ctx.tool_name or "")
            _args(s, out, "{}")
    elif s.pythonic is not None:
        tool_pythonic.finish(msgspec.structs.replace(s.pythonic), _Sink(s, out))
    elif s.markup is not None:
        family = tool_markup.FAMILIES[ctx.tool_parser or ""]
        markup = msgspec.structs.replace(s.markup)
        tool_markup.finish(family, ctx.tools, markup, _Sink(s, out))
    elif s.phase in (Phase.CONTENT, Phase.PLAIN):
        out.content.append(s.space + s.held)
    elif s.phase == Phase.ARGS:
        _args(s, out, s.held)
    elif s.canon is not None:  # cut inside a JSON call's arguments: what the rewrite held
        _args(s, out, json_canon.finish(msgspec.structs.replace(s.canon)))
    return "".join(out.content), out.deltas(response_id, _forced(ctx))


def merge(deltas: list[ToolCallDelta]) -> list[dict]:
    """Assemble call deltas into OpenAI `message.tool_calls`, in index order."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.get(d.index)
        if call is None:
            call = calls[d.index] = {
                "id": d.id or "",
                "type": "function",
                "function": {"name": "", "arguments": ""},
            }
        if d.id and not call["id"]:
            call["id"] = d.id
        if d.function is not None:
            if d.function.name is not None and not call["function"]["name"]:
                call["function"]["name"] = d.function.name
            if d.function.arguments:
                call["function"]["arguments"] += d.function.arguments
    return [calls[i] for i in sorted(calls)]


def rewrites_finish(ctx: ParseContext, any_calls: bool) -> bool:
    """Whether a "stop" finish is reported as "tool_calls" (never "length" or others).

    vLLM does so when the choice carries calls, unless a named tool was forced (OpenAI
    reports "stop" then). `any_calls` is `state.calls > 0`.
    """
    if not any_calls or ctx.tool_choice in ("none", "named"):
        return False
    return ctx.tool_choice == "required" or ctx.tool_parser is not None


# -- what a step emits ----------------------------------------------------------------------


class Emitted:
    """Content pieces and, per call in order, its announcement and argument pieces."""

    __slots__ = ("calls", "content", "short")

    def __init__(self, ctx: ParseContext) -> None:
        self.short = ctx.tool_parser == "mistral"  # Mistral's nine-character call ids
        self.content: list[str] = []
        # (index, name when the call starts here, argument pieces, the model's own call id)
        self.calls: list[tuple[int, str | None, list[str], str | None]] = []

    def announce(self, index: int, name: str, cid: str | None = None) -> None:
        self.calls.append((index, name, [], cid))

    def args(self, index: int, text: str) -> None:
        if self.calls and self.calls[-1][0] == index:
            self.calls[-1][2].append(text)
        else:
            self.calls.append((index, None, [text], None))

    def deltas(self, response_id: str, forced: bool) -> list[ToolCallDelta]:
        """vLLM's shapes: auto announces id, type and name alone (arguments follow in their
        own delta); a forced call's first delta also carries its arguments so far."""
        out: list[ToolCallDelta] = []
        for index, name, parts, own in self.calls:
            args = "".join(parts)
            if name is None:
                out.append(ToolCallDelta(index=index, function=FunctionDelta(arguments=args)))
                continue
            head = FunctionDelta(name=name, arguments=args if forced else None)
            cid = own or call_id(response_id, index, self.short)
            out.append(ToolCallDelta(index=index, id=cid, type="function", function=head))
            if args and not forced:
                out.append(ToolCallDelta(index=index, function=FunctionDelta(arguments=args)))
        return out


class _Sink:
    """A markup parser's output, as calls numbered by the tool state."""

    __slots__ = ("content", "out", "s")

    def __init__(self, s: ToolState, out: Emitted) -> None:
        self.s, self.out, self.content = s, out, out.content

    def call(self, name: str, cid: str | None = None) -> None:
        self.out.announce(self.s.calls, name, cid)
        self.s.calls += 1

    def args(self, text: str) -> None:
        self.out.args(self.s.calls - 1, text)


def _reading(ctx: ParseContext) -> ToolChoice:
    """How the output is read: a forced call in the tool parser's syntax as "auto" reads."""
    return "auto" if ctx.native_calls else ctx.tool_choice


def _forced(ctx: ParseContext) -> bool:
    """Whether calls are JSON a forced call was constrained to (its first delta carries the
    arguments so far, as vLLM's JSON path sends it)."""
    return _reading(ctx) in ("named", "required")


@dataclass(frozen=True, slots=True)
class _Format:
    """How a JSON call object reads: its arguments key, and when its call is announced."""

    args_keys: tuple[str, ...]
    eager: bool  # announce once the name is known (hermes), not once arguments start too
    after: Phase  # where the scanner goes when the object closes


_HERMES = _Format(("arguments",), eager=True, after=Phase.AFTER)
_REQUIRED = _Format(("parameters",), eager=False, after=Phase.BETWEEN)
_LLAMA = _Format(("arguments", "parameters"), eager=True, after=Phase.BETWEEN)


def _announce(s: ToolState, out: Emitted, name: str) -> None:
    out.announce(s.calls, name)
    s.calls += 1
    s.announced, s.name = True, ""
    if s.pending:
        out.args(s.calls - 1, s.pending)
        s.pending = ""


def _args(s: ToolState, out: Emitted, piece: str) -> None:
    if not piece:
        return
    s.has_args = True
    if not s.announced and s.name_done:
        _announce(s, out, s.name)
    if s.announced:
        out.args(s.calls - 1, piece)
    else:
        s.pending += piece


def _close(s: ToolState, out: Emitted, parallel: bool, after: Phase) -> None:
    """A call ends: one with a name is reported (arguments `{}` when it had none)."""
    if not s.announced and s.name_done:
        _announce(s, out, s.name)
    if s.announced and not s.has_args:
        out.args(s.calls - 1, "{}")
    s.announced = s.name_done = s.has_args = s.in_string = s.escape = False
    s.name = s.key = s.pending = ""
    s.expect, s.role, s.depth = Expect.KEY, Role.OTHER, 0
    s.phase = Phase.DONE if s.calls and not parallel else after


# -- markers ----------------------------------------------------------------------------------


def _first(text: str, i: int, markers: tuple[str, ...]) -> tuple[str | None, int]:
    """The earliest of `markers` in `text[i:]`, and where it starts."""
    best, at = None, -1
    for m in markers:
        j = text.find(m, i)
        if j >= 0 and (at < 0 or j < at):
            best, at = m, j
    return best, at


def _hold(s: ToolState, text: str, i: int, markers: tuple[str, ...]) -> int:
    """Hold back a tail of `text[i:]` that may be the start of a marker; return where it starts.

    Only a marker's first character in the last few characters can start one.
    """
    firsts = {m[0] for m in markers}
    for p in range(max(len(text) - MAX_HELD, i), len(text)):
        if text[p] in firsts and any(m.startswith(text[p:]) for m in markers):
            s.held = text[p:]
            return p
    s.held = ""
    return len(text)


# -- deepseek_v31 -----------------------------------------------------------------------------

_BLOCK_MARKERS = (DS_CALL_BEGIN, DS_CALLS_END)
_NAME_MARKERS = (DS_SEP, DS_CALL_END, DS_CALLS_END)
_ARGS_MARKERS = (DS_CALL_END, DS_CALLS_END)


def _content_until(s: ToolState, text: str, i: int, out: Emitted, marker: str, then: Phase) -> int:
    """Content up to `marker` (holding back a partial one); where parsing goes on, or -1."""
    j = text.find(marker, i)
    if j < 0:
        _say(s, out, text[i : _hold(s, text, i, (marker,))])
        return -1
    _say(s, out, text[i:j])
    s.phase, s.space = then, ""  # whitespace alone before a call is no content (vLLM 0.33)
    return j + len(marker)


def _say(s: ToolState, out: Emitted, piece: str) -> None:
    """Content; while it is whitespace alone it is held (a call may follow)."""
    if s.spoke:
        out.content.append(piece)
    elif piece.strip() or len(s.space) + len(piece) > MAX_SPACE:
        out.content.append(s.space + piece)
        s.space, s.spoke = "", True
    else:
        s.space += piece


def _deepseek(s: ToolState, text: str, out: Emitted, parallel: bool) -> None:
    """`<｜tool▁calls▁begin｜>` then calls `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS
    <｜tool▁call▁end｜>`, then `<｜tool▁calls▁end｜>` (vLLM's DeepSeekV31ToolParser)."""
    text, s.held = s.held + text, ""
    i = 0
    while i < len(text):
        if s.phase == Phase.CONTENT:
            i = _content_until(s, text, i, out, DS_CALLS_BEGIN, Phase.BLOCK)
            if i < 0:
                return
        elif s.phase == Phase.BLOCK:
            m, j = _first(text, i, _BLOCK_MARKERS)
            if m is None:
                _hold(s, text, i, _BLOCK_MARKERS)
                return
            i, s.phase = j + len(m), Phase.NAME if m == DS_CALL_BEGIN else Phase.DONE
        elif s.phase == Phase.NAME:
            m, j = _first(text, i, _NAME_MARKERS)
            end = _hold(s, text, i, _NAME_MARKERS) if m is None else j
            s.name = (s.name + text[i:end])[:MAX_NAME]
            if m is None:
                return
            i = j + len(m)
            if m == DS_SEP:
                _announce(s, out, s.name)
                s.name, s.phase = "", Phase.ARGS
            else:  # a call without a separator has no name: dropped
                s.name = ""
                s.phase = Phase.BLOCK if m == DS_CALL_END else Phase.DONE
        elif s.phase == Phase.ARGS:
            m, j = _first(text, i, _ARGS_MARKERS)
            if m is None:
                _args(s, out, text[i : _hold(s, text, i, _ARGS_MARKERS)])
                return
            _args(s, out, text[i:j])
            i = j + len(m)
            _close(s, out, parallel, Phase.BLOCK if m == DS_CALL_END else Phase.DONE)
        else:
            return


# -- hermes -----------------------------------------------------------------------------------


def _hermes(s: ToolState, text: str, out: Emitted, parallel: bool) -> None:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated (vLLM's
    Hermes2ProToolParser); the arguments value's raw text streams as it arrives."""
    text, s.held = s.held + text, ""
    i = 0
    while i < len(text):
        if s.phase == Phase.CONTENT:
            i = _content_until(s, text, i, out, HERMES_BEGIN, Phase.OPEN)
            if i < 0:
                return
        elif s.phase == Phase.OPEN:
            j, k = text.find("{", i), text.find(HERMES_END, i)
            if k >= 0 and (j < 0 or k < j):  # no object in this tag
                i, s.phase = k + len(HERMES_END), Phase.BETWEEN
            elif j >= 0:
                i, s.phase = j + 1, Phase.OBJECT
            else:
                _hold(s, text, i, (HERMES_END,))
                return
        elif s.phase == Phase.OBJECT:
            i = _object(s, text, i, out, parallel, _HERMES)
        elif s.phase in (Phase.AFTER, Phase.BETWEEN):
            marker = HERMES_END if s.phase == Phase.AFTER else HERMES_BEGIN
            j = text.find(marker, i)
            if j < 0:
                _hold(s, text, i, (marker,))
                return
            i = j + len(marker)
            s.phase = Phase.BETWEEN if s.phase == Phase.AFTER else Phase.OPEN
        else:
            return


# -- llama3_json ------------------------------------------------------------------------------

PYTHON_TAG = "<|python_tag|>"


def _llama(s: ToolState, text: str, out: Emitted, parallel: bool) -> None:
    """Llama 3/4's JSON calls: an output that opens with `<|python_tag|>` or `{` is
    `{"name": ..., "parameters": {...}}` objects (`arguments` too), `;` between them; any
    other output is content (vLLM's streaming rule: its whole answer also finds calls after
    text, which a stream that sent the text cannot)."""
    if s.phase == Phase.CONTENT:  # the output's first characters decide
        text, s.held = s.held + text, ""
        if text.startswith(PYTHON_TAG):
            text, s.phase = text[len(PYTHON_TAG) :], Phase.BETWEEN
        elif text.startswith("{"):
            s.phase = Phase.BETWEEN
        elif PYTHON_TAG.startswith(text):  # it may still be the tag (or nothing came yet)
            s.held = text
            return
        else:
            s.phase = Phase.PLAIN
    if s.phase == Phase.PLAIN:
        out.content.append(text)
        return
    i = 0
    while i < len(text) and s.phase != Phase.DONE:
        if s.phase == Phase.BETWEEN:
            j = text.find("{", i)
            if j < 0:
                return
            i, s.phase, s.expect = j + 1, Phase.OBJECT, Expect.KEY
        else:
            i = _object(s, text, i, out, parallel, _LLAMA)


# -- mistral before v11 -----------------------------------------------------------------------

_MISTRAL_LIST = _Format(("arguments",), eager=True, after=Phase.BETWEEN)
_MISTRAL_ONE = _Format(("arguments",), eager=True, after=Phase.DONE)


def _mistral_list(s: ToolState, text: str, out: Emitted, parallel: bool) -> None:
    """Mistral's calls before v11 (a vocabulary without `[ARGS]`): content, then
    `[TOOL_CALLS]` and a JSON list of `{"name": ..., "arguments": {...}}` objects, or one
    such object; what follows the list is dropped (vLLM's legacy extraction)."""
    text, s.held = s.held + text, ""
    i = 0
    while i < len(text):
        if s.phase == Phase.CONTENT:
            i = _content_until(s, text, i, out, MISTRAL_CALLS, Phase.LIST)
            if i < 0:
                return
        elif s.phase == Phase.LIST:
            m = _NON_SPACE.search(text, i)
            if m is None:
                return
            i, ch = m.end(), m.group()
            s.bare = ch == "{"
            s.phase = Phase.BETWEEN if ch == "[" else Phase.OBJECT if s.bare else Phase.DONE
        elif s.phase == Phase.BETWEEN:
            i = _between_items(s, text, i)
        elif s.phase == Phase.OBJECT:
            i = _object(s, text, i, out, parallel, _MISTRAL_ONE if s.bare else _MISTRAL_LIST)
        else:
            return


# -- required ---------------------------------------------------------------------------------

_LIST_OPEN = re.compile(r"[\[{]")
_LIST_LEVEL = re.compile(r'[\[\]{}"]')


def _required(s: ToolState, text: str, out: Emitted, parallel: bool) -> None:
    """A JSON list of `{"name": ..., "parameters": {...}}` (vLLM's required-tool-call scan:
    text before the list and after it is ignored; a list item that is not an object ends it)."""
    i = 0
    while i < len(text):
        if s.phase == Phase.LIST:
            m = _LIST_OPEN.search(text, i)
            if m is None:
                return
            i = m.end()
            s.phase = Phase.BETWEEN if m.group() == "[" else Phase.DONE
        elif s.phase == Phase.BETWEEN:
            i = _between_items(s, text, i)
        elif s.phase == Phase.OBJECT:
            i = _object(s, text, i, out, parallel, _REQUIRED)
        else:
            return


def _between_items(s: ToolState, text: str, i: int) -> int:
    """Between a list's items: a string item is skipped, an object opens a call, anything
    else ends the list; where the scan stopped (the text's end: more is needed)."""
    if s.in_string:
        return _string_end(s, text, i)[0]
    m = _LIST_LEVEL.search(text, i)
    if m is None:
        return len(text)
    ch = m.group()
    if ch == '"':
        s.in_string = True
    elif ch == "{":
        s.phase, s.expect = Phase.OBJECT, Expect.KEY
    else:
        s.phase = Phase.DONE
    return m.end()


# -- a call's JSON object -------------------------------------------------------------------

_STRING = re.compile(r'["\\]')
_NESTED = re.compile(r'["{}\[\]]')
_SCALAR_END = re.compile(r"[,}\]\s]")
_KEY_OR_CLOSE = re.compile(r'["}]')
_COLON_OR_CLOSE = re.compile(r"[:}]")
_NEXT = re.compile(r"[,}]")
_NON_SPACE = re.compile(r"\S")


def _string_end(s: ToolState, text: str, i: int) -> tuple[int, bool]:
    """Scan a JSON string from `i`: (where the scan stopped, whether the string closed)."""
    n = len(text)
    while True:
        if s.escape:
            if i >= n:
                return n, False
            s.escape, i = False, i + 1
            continue
        m = _STRING.search(text, i)
        if m is None:
            return n, False
        if m.group() == '"':
            s.in_string = False
            return m.end(), True
        s.escape, i = True, m.end()


def _object(s: ToolState, text: str, i: int, out: Emitted, parallel: bool, fmt: _Format) -> int:
    """Read a call object from `text[i:]` until it closes or the text ends; return where.

    Only the object's own level is interpreted (vLLM's scan does the same): keys, and the
    "name" and arguments values; quotes and brackets inside values only move the nesting.
    """
    n = len(text)
    while i < n and s.phase == Phase.OBJECT:
        e = s.expect
        if e == Expect.IN_VALUE:
            i = _value(s, text, i, out, fmt)
            continue
        if e == Expect.IN_KEY:
            j, closed = _string_end(s, text, i)
            s.key = (s.key + text[i : j - 1 if closed else j])[:MAX_KEY]
            i = j
            if closed:
                s.role, s.key, s.expect = _role(s, s.key, fmt), "", Expect.COLON
            continue
        pattern = {
            Expect.KEY: _KEY_OR_CLOSE,
            Expect.COLON: _COLON_OR_CLOSE,
            Expect.VALUE: _NON_SPACE,
            Expect.NEXT: _NEXT,
        }[e]
        m = pattern.search(text, i)
        if m is None:
            return n
        i, ch = m.end(), m.group()
        if ch == "}":
            _close(s, out, parallel, fmt.after)
        elif e == Expect.KEY:
            s.expect = Expect.IN_KEY
        elif e == Expect.COLON:
            s.expect = Expect.VALUE
        elif e == Expect.NEXT or ch == ",":
            s.expect = Expect.KEY
        elif ch == "]":  # not a value: a malformed object, scanned on
            s.role, s.expect = Role.OTHER, Expect.NEXT
        else:  # a value starts
            s.expect, s.depth = Expect.IN_VALUE, 1 if ch in "{[" else 0
            s.in_string = ch == '"'
            if s.role == Role.ARGS:
                s.canon = CanonState()
            _piece(s, out, ch)
    return i


def _role(s: ToolState, key: str, fmt: _Format) -> Role:
    if "\\" in key:
        try:
            key = json.loads(f'"{key}"')
        except ValueError:
            return Role.OTHER
    if key == "name" and not s.name_done:
        s.name = ""
        return Role.NAME
    if key in fmt.args_keys and not s.has_args:
        return Role.ARGS
    return Role.OTHER


def _value(s: ToolState, text: str, i: int, out: Emitted, fmt: _Format) -> int:
    """Read the value being read up to its end or the text's; return where."""
    n = len(text)
    while i < n:
        if s.in_string:
            j, closed = _string_end(s, text, i)
            _piece(s, out, text[i:j])
            i = j
            if closed and s.depth == 0:
                _end_value(s, out, fmt)
                return i
        elif s.depth:
            m = _NESTED.search(text, i)
            if m is None:
                _piece(s, out, text[i:])
                return n
            j, ch = m.end(), m.group()
            if ch == '"':
                s.in_string = True
            elif ch in "{[":
                s.depth += 1
            else:
                s.depth -= 1
            _piece(s, out, text[i:j])
            i = j
            if not s.depth:
                _end_value(s, out, fmt)
                return i
        else:  # a number, true, false or null: ends before a delimiter
            m = _SCALAR_END.search(text, i)
            j = n if m is None else m.start()
            _piece(s, out, text[i:j])
            if m is not None:
                _end_value(s, out, fmt)
            return j
    return i


def _piece(s: ToolState, out: Emitted, piece: str) -> None:
    if s.role == Role.ARGS:
        _args(s, out, piece if s.canon is None else json_canon.step(s.canon, piece))
    elif s.role == Role.NAME:
        s.name = (s.name + piece)[:MAX_NAME]


def _end_value(s: ToolState, out: Emitted, fmt: _Format) -> None:
    if s.role == Role.ARGS and s.canon is not None:
        _args(s, out, json_canon.finish(s.canon))
        s.canon = None
    if s.role == Role.NAME:
        try:
            name = json.loads(s.name)
        except ValueError:
            name = None
        s.name_done = isinstance(name, str)
        s.name = name if s.name_done else ""
        if s.name_done and (s.has_args or fmt.eager):
            _announce(s, out, s.name)
    s.role, s.expect = Role.OTHER, Expect.NEXT
