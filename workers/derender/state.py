"""`stream_state`: everything a chunk needs from the past, small and bounded.

Only derender reads it. Everyone else (the owner, the ledger, the `Tw-Stream-State`
header) carries it as opaque bytes, so its shape can change with derender alone.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec
from msgspec import Struct

from tokenway.errors import InvalidRequest
from tokenway.parsers import is_harmony
from tokenway.wire import OutputContext
from workers.derender import logprobs, reasoning, stops
from workers.derender.harmony import HarmonyState
from workers.derender.logprobs import LogprobState
from workers.derender.reasoning import ReasoningState
from workers.derender.stops import StopState
from workers.derender.tools import ToolState

T = TypeVar("T")

MAX_WINDOW_TOKENS = 512
# A few hundred bytes plus the tool call being streamed; far more is tampering or a bug.
MAX_STATE_BYTES = 12 * 1024


class DetokState(Struct, array_like=True):
    """The incremental detokenizer's bounded window (vLLM's prefix/read offsets)."""

    tokens: list[int]
    prefix_offset: int
    read_offset: int


class Opened(Struct, array_like=True, omit_defaults=True):
    """A Messages or Responses stream's open part (a content block, an output item): its
    kind ("" for none), index and, for a tool call's, the call it is; and how many events
    the stream sent (a Responses stream numbers them); a Messages thinking block's digest
    so far (its signature's)."""

    kind: str = ""
    index: int = -1
    call: int = -1
    sent: int = 0
    digest: int = 0


class StreamState(Struct, array_like=True, omit_defaults=True):
    detok: DetokState
    completion_tokens: int = 0
    role_sent: bool = False
    finished: bool = False
    stop: StopState | None = None  # text held back as a possible stop-string start
    reasoning: ReasoningState | None = None
    tools: ToolState | None = None
    tools_called: bool = False  # any tool call streamed: finish "stop" becomes "tool_calls"
    logprobs: LogprobState | None = None
    opened: Opened | None = None  # a Messages or Responses stream's open part
    harmony: HarmonyState | None = None  # gpt-oss's channels (reasoning and tools both)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StreamState)


def encode(state: StreamState) -> bytes:
    return _encoder.encode(state)


def bounded(raw: bytes, decoder: msgspec.msgpack.Decoder[T], limit: int) -> T:
    """A carried state of at most `limit` bytes, decoded; the client's 400 otherwise."""
    if len(raw) > limit:
        raise InvalidRequest(
            f"stream_state of {len(raw)} bytes is over {limit}", param="stream_state"
        )
    try:
        return decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"malformed stream_state: {exc}", param="stream_state") from exc


def decode(raw: bytes, vocab_size: int, ctx: OutputContext) -> StreamState:
    """A state from the wire; refuse one that no derender could have produced."""
    state = bounded(raw, _decoder, MAX_STATE_BYTES)
    problem = _problem(state, vocab_size) or _parts_problem(state, ctx)
    if problem:
        raise InvalidRequest(problem, param="stream_state")
    return state


def _problem(state: StreamState, vocab_size: int) -> str | None:
    d = state.detok
    if state.finished:
        return "stream_state belongs to a finished stream"
    if len(d.tokens) > MAX_WINDOW_TOKENS:
        return f"stream_state window of {len(d.tokens)} tokens is over {MAX_WINDOW_TOKENS}"
    if not 0 <= d.prefix_offset <= d.read_offset <= len(d.tokens):
        return (
            f"stream_state offsets {d.prefix_offset}/{d.read_offset} do not fit a window of "
            f"{len(d.tokens)} tokens"
        )
    out_of_vocab = d.tokens and (min(d.tokens) < 0 or max(d.tokens) >= vocab_size)
    if out_of_vocab or state.completion_tokens < 0:
        return "stream_state holds values out of range"
    return None


def _parts_problem(state: StreamState, ctx: OutputContext) -> str | None:
    """Each stage's own check of its part of the state."""
    parse = ctx.parse
    if state.harmony is not None and not (
        parse is not None and is_harmony(parse.reasoning_parser, parse.tool_parser)
    ):
        return "stream_state has harmony state for a request whose output is not harmony's"
    if state.reasoning is not None:
        if parse is None or parse.reasoning_parser is None:
            return "stream_state has reasoning state for a request without a reasoning parser"
        if problem := reasoning.problem(parse.reasoning_parser, state.reasoning):
            return problem
    if state.stop is not None and (problem := stops.problem(state.stop, ctx.stop)):
        return problem
    if state.logprobs is not None:
        return logprobs.problem(state.logprobs)
    return None
