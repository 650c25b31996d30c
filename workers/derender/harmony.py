"""gpt-oss's harmony output read as it streams: `(state, text delta) -> (reasoning, content,
calls, state')`, as vLLM 0.33's `openai` tool and `openai_gptoss` reasoning parsers read it
(both name one parser there, harmony's, which reads tokens with openai-harmony's streaming
parser).

The output is a run of messages, the first one's `<|start|>assistant` in the prompt:

    <|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>final<|message|>…<|return|>

A message's header (up to `<|message|>`) names its channel, a recipient (`to=functions.X`)
and a content type (`json`, `<|constrain|>json`), in either order harmony writes them; its
content runs to `<|end|>`, `<|call|>` or `<|return|>`. What a message is to the answer, as
vLLM's whole answer has it:

- a call where its recipient is a function (`functions.X`, or a bare name that is no
  built-in tool): arguments as `json.dumps(json.loads(text))` writes them (here rewritten as
  they stream, `json_canon` with ASCII escapes), its text as written for a content type
  other than JSON;
- reasoning on the `analysis` channel, content on `final` (and `commentary` without a
  recipient); anything else, and any role but the assistant's, is dropped;
- messages of one kind are joined with a newline; empty ones are no message.

Text between a message's end and the next `<|start|>` is no message (harmony refuses it). A
header that harmony cannot read drops its message. An output that ends inside a header is
content as it was written (vLLM's recovery of "the raw output"), as is a header that has run
past `MAX_HEADER` characters without its `<|message|>` (a model ignoring the format): it and
the rest of the output are content (harmony would wait for the end, and vLLM keeps it all
for then; a stream cannot).

The parser reads the decoded text (special tokens kept, as harmony's markers are), so the
state is a few fields: where it stands, a held tail that may begin a marker, the header so
far, and the call's JSON rewriting.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from typing import Annotated

import msgspec
from msgspec import Meta

from tokenway.parsers import HARMONY_REASONING, HARMONY_TOOLS
from tokenway.wire import ParseContext
from workers.derender import json_canon
from workers.derender.json_canon import CanonState
from workers.derender.tools import Emitted, ToolCallDelta

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
CONSTRAIN = "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")  # harmony's stop tokens: a message's end
_MARKERS = frozenset((START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS))
MAX_HELD = max(len(m) for m in (START, MESSAGE, *ENDS)) - 1
MAX_HEADER = 512  # a real header is a channel, a recipient and a content type

ROLES = ("user", "assistant", "system", "developer", "tool")
BUILTIN_TOOLS = ("python", "browser", "container")  # recipients that are no function
_ASCII_SPACE = re.compile(r"[ \t\n\r\x0c]+")  # what harmony splits a header on
_CHANNEL_END = re.compile(r"[\s<]")


class Phase(enum.IntEnum):
    HEADER = 0  # a message's header, up to <|message|>
    CONTENT = 1  # its content, up to one of ENDS
    BETWEEN = 2  # after a message: up to the next <|start|>
    RAW = 3  # a header that never ended: the rest is content as written


class Kind(enum.IntEnum):
    """What a message is to the answer."""

    DROPPED = 0
    REASONING = 1
    CONTENT = 2
    CALL = 3


# what ends each phase's text
_ENDING: dict[Phase, tuple[str, ...]] = {
    Phase.HEADER: (MESSAGE,),
    Phase.CONTENT: ENDS,
    Phase.BETWEEN: (START,),
}


class HarmonyState(msgspec.Struct, array_like=True, omit_defaults=True):
    phase: Phase = Phase.HEADER
    held: Annotated[str, Meta(max_length=MAX_HELD)] = ""  # may be the start of a marker
    header: Annotated[str, Meta(max_length=MAX_HEADER)] = ""
    started: bool = False  # the header came after a <|start|> (it names its role)
    kind: Kind = Kind.DROPPED
    spoke: bool = False  # the message's text so far is not empty
    said: Annotated[int, Meta(ge=0, le=7)] = 0  # a bit per kind that had a non-empty message
    calls: Annotated[int, Meta(ge=0)] = 0  # calls announced: the next call's index
    canon: CanonState | None = None  # the call's JSON arguments, rewritten


def _keeps_calls(ctx: ParseContext) -> bool:
    """vLLM returns harmony's calls for a forced tool choice, or for "auto" with its tool
    parser (render says "none" where a request has no tools); it drops them otherwise."""
    return ctx.tool_choice in ("required", "named") or (
        ctx.tool_choice == "auto" and ctx.tool_parser == HARMONY_TOOLS
    )


class _Step:
    """One step's output: reasoning and content pieces, and the calls."""

    __slots__ = ("calls", "content", "thought")

    def __init__(self, ctx: ParseContext) -> None:
        self.thought: list[str] = []
        self.calls = Emitted(ctx)
        self.content = self.calls.content

    def text(self, s: HarmonyState, kind: Kind, piece: str) -> None:
        """A piece of the current message's text; a newline first where an earlier message
        of its kind had text."""
        if not piece or kind == Kind.DROPPED:
            return
        if kind == Kind.CALL:
            if s.canon is not None:
                piece = json_canon.step(s.canon, piece)
            self.calls.args(s.calls - 1, piece)
            return
        bit = 1 << kind
        if not s.spoke and s.said & bit:
            piece = "\n" + piece
        s.spoke = True
        s.said |= bit
        (self.thought if kind == Kind.REASONING else self.content).append(piece)


def step(
    ctx: ParseContext, state: HarmonyState, text: str, response_id: str
) -> tuple[str, str, list[ToolCallDelta], HarmonyState]:
    """The next piece of output: (reasoning, content, call deltas, next state)."""
    s, out = _copy(state), _Step(ctx)
    _read(ctx, s, s.held + text, out)
    return "".join(out.thought), "".join(out.content), out.calls.deltas(response_id, False), s


def finish(
    ctx: ParseContext, state: HarmonyState, response_id: str
) -> tuple[str, str, list[ToolCallDelta]]:
    """The end of the output: the held tail, the last message closed, or a header the output
    ended in given back as content."""
    s, out = _copy(state), _Step(ctx)
    held, s.held = s.held, ""
    if s.phase in (Phase.CONTENT, Phase.RAW):
        out.text(s, s.kind, held)
        _close(s, out)
    elif s.phase == Phase.HEADER:
        out.text(s, Kind.CONTENT, (START if s.started else "") + s.header + held)
    return "".join(out.thought), "".join(out.content), out.calls.deltas(response_id, False)


def _copy(state: HarmonyState) -> HarmonyState:
    """A state to step in place: the caller's stays as it was."""
    s = msgspec.structs.replace(state)
    if s.canon is not None:
        s.canon = msgspec.structs.replace(s.canon)
    return s


def _read(ctx: ParseContext, s: HarmonyState, text: str, out: _Step) -> None:
    s.held = ""
    i, n = 0, len(text)
    while i < n:
        if s.phase == Phase.RAW:
            out.text(s, s.kind, text[i:])
            return
        markers = _ENDING[s.phase]
        at, marker = _find(text, i, markers)
        if marker is None:  # up to a tail that may begin one of them
            end = _tail_start(text, i, markers)
            _take(s, text[i:end], out)
            if s.phase == Phase.RAW:
                out.text(s, s.kind, text[end:])
            else:
                s.held = text[end:]
            return
        _take(s, text[i:at], out)
        if s.phase == Phase.RAW:  # the header ran over: the marker is content too
            i = at
            continue
        i = at + len(marker)
        if s.phase == Phase.HEADER:
            _open(ctx, s, out)
        elif s.phase == Phase.CONTENT:
            _close(s, out)
            s.phase = Phase.BETWEEN
        else:
            s.phase, s.header, s.started = Phase.HEADER, "", True


def _take(s: HarmonyState, piece: str, out: _Step) -> None:
    """Text that is no marker, where the parser stands."""
    if not piece:
        return
    if s.phase == Phase.CONTENT:
        out.text(s, s.kind, piece)
    elif s.phase == Phase.HEADER:
        if len(s.header) + len(piece) <= MAX_HEADER:
            s.header += piece
            return
        # Never a header: what came since the last message is content as written.
        raw = (START if s.started else "") + s.header + piece
        s.phase, s.kind, s.spoke, s.header = Phase.RAW, Kind.CONTENT, False, ""
        out.text(s, s.kind, raw)


def _find(text: str, i: int, markers: tuple[str, ...]) -> tuple[int, str | None]:
    best, found = len(text), None
    for m in markers:
        at = text.find(m, i, best + len(m))
        if at != -1 and at < best:
            best, found = at, m
    return best, found


def _tail_start(text: str, i: int, markers: tuple[str, ...]) -> int:
    """Where the text's tail that may begin a marker starts (len(text): none)."""
    at = text.rfind("<", max(i, len(text) - MAX_HELD))
    if at == -1:
        return len(text)
    tail = text[at:]
    return at if any(m.startswith(tail) for m in markers) else len(text)


def _open(ctx: ParseContext, s: HarmonyState, out: _Step) -> None:
    """A header ended: what its message is."""
    header, s.header = s.header, ""
    s.phase, s.spoke, s.canon = Phase.CONTENT, False, None
    read = _header(header, s.started)
    if read is None:  # harmony cannot read it: the message is dropped
        s.phase, s.kind = Phase.BETWEEN, Kind.DROPPED
        return
    role, channel, recipient, content_type = read
    s.kind = _kind(ctx, s, role, channel, recipient)
    if s.kind == Kind.CALL:
        assert recipient is not None
        out.calls.announce(s.calls, recipient.removeprefix("functions."))
        s.calls += 1
        if content_type is None or "json" in content_type:
            s.canon = CanonState(ascii=True)


def _kind(
    ctx: ParseContext, s: HarmonyState, role: str, channel: str | None, recipient: str | None
) -> Kind:
    if role != "assistant":
        return Kind.DROPPED
    if recipient and _is_function(recipient):
        keeps = _keeps_calls(ctx) and (ctx.parallel_tool_calls or s.calls == 0)
        return Kind.CALL if keeps else Kind.DROPPED
    if channel == "analysis":
        return Kind.REASONING if ctx.reasoning_parser == HARMONY_REASONING else Kind.DROPPED
    if channel == "final" or (channel == "commentary" and recipient is None):
        return Kind.CONTENT
    return Kind.DROPPED


def _close(s: HarmonyState, out: _Step) -> None:
    """A message ended: a call's arguments held by the rewrite go out."""
    if s.kind == Kind.CALL and s.canon is not None:
        out.calls.args(s.calls - 1, json_canon.finish(s.canon))
    s.canon, s.kind = None, Kind.DROPPED


def _is_function(recipient: str) -> bool:
    """vLLM's test of a chat recipient: `functions.X`, or a bare name of no built-in tool."""
    if recipient.startswith("<|") or recipient == "assistant":
        return False
    if recipient.startswith("functions."):
        return len(recipient) > len("functions.")
    return recipient.split(".", 1)[0] not in BUILTIN_TOOLS


def _header(text: str, started: bool) -> tuple[str, str | None, str | None, str | None] | None:
    """(role, channel, recipient, content type) as harmony reads a header; None where it
    cannot. The first message's role is the prompt's (the assistant's)."""
    channel = None
    at = text.find(CHANNEL)
    if at != -1:
        after = text[at + len(CHANNEL) :]
        m = _CHANNEL_END.search(after)
        end = len(after) if m is None else m.start()
        if end == 0:
            return None
        channel, text = after[:end], text[:at] + after[end:]
    text = text.strip()
    if CONSTRAIN in text:
        text = text.replace(CONSTRAIN, " " + CONSTRAIN).strip()
    parts = [p for p in _ASCII_SPACE.split(text) if p]
    role = "assistant"
    if started:
        if not parts:
            return None
        if parts[0] in ROLES:
            role = parts[0]
        elif len(parts) > 1 or parts[0].startswith("to="):
            role = "tool"
            parts.pop(0)
        else:
            return None
    if parts and parts[0] == role:
        parts.pop(0)
    recipient = content_type = None
    if parts:
        last = parts.pop()
        if last.startswith("to="):
            recipient = last[3:]
        elif not parts:
            recipient = last
        else:
            content_type = last
            raw = parts.pop()
            recipient = raw[3:] if raw.startswith("to=") else raw
    if parts:  # words harmony cannot place
        return None
    return role, channel, _normalized(recipient), content_type


def _normalized(recipient: str | None) -> str | None:
    """vLLM's cut of a content type an older harmony left in the recipient."""
    if recipient is None:
        return None
    return recipient.split(CONSTRAIN, 1)[0].rstrip() or None


def count(ctx: ParseContext, pieces: Sequence[str]) -> int:
    """How many output tokens (each token's text) are reasoning, as vLLM counts harmony's:
    the text of analysis messages and of calls, not their markers."""
    every = msgspec.structs.replace(
        ctx,
        tool_choice="auto",
        tool_parser=HARMONY_TOOLS,
        reasoning_parser=HARMONY_REASONING,
        parallel_tool_calls=True,
    )
    s, n = HarmonyState(), 0
    for piece in pieces:
        _read(every, s, s.held + piece, _Step(every))
        thinking = s.phase == Phase.CONTENT and s.kind in (Kind.REASONING, Kind.CALL)
        n += thinking and piece not in _MARKERS and bool(piece)
    return n
