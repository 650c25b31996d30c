"""Anthropic Messages output, made from the same choice output as a chat completion
(`openai_output.Out`: reasoning, content, tool-call deltas): the whole message, or the stream's
events, each framed as Anthropic frames them (`event: <type>` and its `data:`).

A stream opens one content block at a time, in the order the output shows them (thinking,
text, each tool call), and closes it when another starts or the message ends; which block is
open rides in `stream_state` (`Opened`), so any derender worker can go on with the stream.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from tokenway import sse
from tokenway.api.anthropic import fold_thinking, signature, stop_reason
from tokenway.api.openai_output import Out
from tokenway.wire import OutputContext
from workers.derender.state import Opened
from workers.derender.tools import ToolCallDelta

_json = msgspec.json.Encoder()


def _event(doc: dict[str, Any]) -> bytes:
    return sse.named(doc["type"], _json.encode(doc))


def _usage(ctx: OutputContext, output_tokens: int) -> dict[str, int]:
    """Anthropic's usage, whose `input_tokens` are the prompt's tokens after the cache: those
    the engine found in its prefix cache are `cache_read_input_tokens`. None are counted as
    written to a cache: that is what `cache_control` asks of Anthropic's, and here the
    engine caches every prompt by itself."""
    cached = ctx.cached_tokens or 0
    return {
        "input_tokens": ctx.prompt_tokens - cached,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _stop_sequence(out: Out) -> str | None:
    return out.stop_reason if isinstance(out.stop_reason, str) else None


def message(ctx: OutputContext, out: Out, output_tokens: int) -> bytes:
    """The whole message (a request that did not stream); `out.tool_calls` assembled."""
    content: list[dict[str, Any]] = []
    if out.reasoning:
        content.append(
            {
                "type": "thinking",
                "thinking": out.reasoning,
                "signature": signature(fold_thinking(0, out.reasoning)),
            }
        )
    if out.text:
        content.append({"type": "text", "text": out.text})
    for call in out.tool_calls:
        function = call["function"]
        content.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": function["name"],
                "input": _arguments(function["arguments"]),
            }
        )
    return _json.encode(
        {
            "id": ctx.response_id,
            "type": "message",
            "role": "assistant",
            "model": ctx.model,
            "content": content,
            "stop_reason": stop_reason(out.finish_reason, out.stop_reason, bool(out.tool_calls)),
            "stop_sequence": _stop_sequence(out),
            "usage": _usage(ctx, output_tokens),
        }
    )


def _arguments(text: str) -> dict[str, Any]:
    """A call's input: its arguments' JSON object (anything else the model wrote, such as
    unfinished JSON, as text under `arguments`)."""
    try:
        parsed = json.loads(text or "{}")
    except json.JSONDecodeError:
        parsed = None
    return parsed if isinstance(parsed, dict) else {"arguments": text}


def events(
    ctx: OutputContext, out: Out, blocks: Opened, first: bool, output_tokens: int, called: bool
) -> tuple[list[bytes], Opened]:
    """A streamed delta's events, and the open block after them (`called`: whether the
    stream called a tool so far)."""
    docs: list[dict[str, Any]] = []
    if first:
        docs.append(
            {
                "type": "message_start",
                "message": {
                    "id": ctx.response_id,
                    "type": "message",
                    "role": "assistant",
                    "model": ctx.model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": _usage(ctx, 0),
                },
            }
        )
        docs.append({"type": "ping"})  # as Anthropic's streams begin; clients skip it
    if out.reasoning:
        blocks = _open(docs, blocks, "thinking", {"thinking": "", "signature": ""})
        docs.append(_delta(blocks, {"type": "thinking_delta", "thinking": out.reasoning}))
        blocks = msgspec.structs.replace(blocks, digest=fold_thinking(blocks.digest, out.reasoning))
    if out.text:
        blocks = _open(docs, blocks, "text", {"text": ""})
        docs.append(_delta(blocks, {"type": "text_delta", "text": out.text}))
    for call in out.tool_calls:
        blocks = _tool(docs, blocks, call)
    if out.finish_reason is not None:
        if blocks.kind:
            _close(docs, blocks)
            blocks = Opened(index=blocks.index)
        docs.append(
            {
                "type": "message_delta",
                "delta": {
                    "stop_reason": stop_reason(out.finish_reason, out.stop_reason, called),
                    "stop_sequence": _stop_sequence(out),
                },
                "usage": _usage(ctx, output_tokens),
            }
        )
        docs.append({"type": "message_stop"})
    return [_event(d) for d in docs], blocks


def _open(
    docs: list[dict[str, Any]], blocks: Opened, kind: str, empty: dict[str, Any], call: int = -1
) -> Opened:
    """The block of `kind` (and `call`) open: the one open already, or the next one."""
    if blocks.kind == kind and blocks.call == call:
        return blocks
    if blocks.kind:
        _close(docs, blocks)
    opened = Opened(kind=kind, index=blocks.index + 1, call=call)
    docs.append(
        {
            "type": "content_block_start",
            "index": opened.index,
            "content_block": {"type": kind, **empty},
        }
    )
    return opened


def _close(docs: list[dict[str, Any]], blocks: Opened) -> None:
    """The open block's stop; a thinking block's signature first, as Anthropic sends it."""
    if blocks.kind == "thinking":
        docs.append(
            _delta(blocks, {"type": "signature_delta", "signature": signature(blocks.digest)})
        )
    docs.append({"type": "content_block_stop", "index": blocks.index})


def _delta(blocks: Opened, delta: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": blocks.index, "delta": delta}


def _tool(docs: list[dict[str, Any]], blocks: Opened, call: ToolCallDelta) -> Opened:
    function = call.function
    name = function.name if function and function.name else ""
    blocks = _open(
        docs, blocks, "tool_use", {"id": call.id or "", "name": name, "input": {}}, call.index
    )
    if function is not None and function.arguments:
        docs.append(
            _delta(blocks, {"type": "input_json_delta", "partial_json": function.arguments})
        )
    return blocks
