"""OpenAI Responses output, made from the same choice output as a chat completion
(`openai_output.Out`): the response object, its output items in the order the model made them
(reasoning, the message, each function call), or the stream's events.

A stream's deltas open one item at a time and add to it; which is open, and how many events
went out (each carries its `sequence_number`), ride in `stream_state`. The closing events
hold each item whole (`.done`) and the whole response (`response.completed`): they are made
from the response the request would get unstreamed, derendered once from every output
token at the end, so the state never holds the output so far."""

from __future__ import annotations

from typing import Any

import msgspec

from tokenway import sse
from tokenway.api.openai_output import Out
from tokenway.api.responses import (
    COMPLETED,
    CUSTOM_INPUT,
    PRIVATE,
    RESPONSE_ID_PREFIX,
    CallName,
    call_names,
    sealed,
)
from tokenway.wire import OutputContext
from workers.derender import tools
from workers.derender.state import Opened
from workers.derender.tools import ToolCallDelta

_json = msgspec.json.Encoder()


_CALL_ID_PREFIXES = {"function_call": "fc", "custom_tool_call": "ctc"}


def _item_id(ctx: OutputContext, kind: str, call_id: str = "") -> str:
    """An output item's id, the same whether a stream opens it or the response holds it."""
    if kind in _CALL_ID_PREFIXES:
        return f"{_CALL_ID_PREFIXES[kind]}_{call_id}"
    rid = ctx.response_id.removeprefix(RESPONSE_ID_PREFIX)
    return f"{'rs' if kind == 'reasoning' else 'msg'}_{rid}"


def response(ctx: OutputContext, out: Out, output_tokens: int, reasoning_tokens: int) -> bytes:
    """The whole response (a request that did not stream); `out.tool_calls` assembled;
    `reasoning_tokens` of the `output_tokens` its reasoning."""
    output: list[dict[str, Any]] = []
    if out.reasoning:
        output.append(_reasoning_item(ctx, out.reasoning))
    if out.text or not (out.reasoning or out.tool_calls):  # as vLLM: no message without text
        text = {"type": "output_text", "text": out.text, "annotations": []}
        output.append(
            {
                "type": "message",
                "id": _item_id(ctx, "message"),
                "status": "completed",
                "role": "assistant",
                "content": [text],
            }
        )
    names = _names(ctx)
    for call in out.tool_calls:
        output.append(_call_item(ctx, names, call["id"], call["function"]))
    cut = out.finish_reason == "length"
    return _json.encode(
        {
            **_echoed(ctx),
            "id": ctx.response_id,
            "object": "response",
            "created_at": ctx.created,
            "status": "incomplete" if cut else "completed",
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "model": ctx.model,
            "output": output,
            "usage": {
                "input_tokens": ctx.prompt_tokens,
                "input_tokens_details": {"cached_tokens": ctx.cached_tokens or 0},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": ctx.prompt_tokens + output_tokens,
            },
        }
    )


def _echoed(ctx: OutputContext) -> dict[str, Any]:
    """The request's fields its response repeats."""
    echoed = _decode.decode(ctx.response_fields) if ctx.response_fields else {}
    echoed.pop(PRIVATE, None)
    return echoed


def _private(ctx: OutputContext) -> dict[str, Any]:
    """What render put in the echoed fields for derender alone."""
    return _decode.decode(ctx.response_fields).get(PRIVATE, {}) if ctx.response_fields else {}


def _summarized(ctx: OutputContext) -> bool:
    """Whether the request asked for a reasoning summary (`reasoning.summary`)."""
    return bool((_echoed(ctx).get("reasoning") or {}).get("summary"))


def _reasoning_item(ctx: OutputContext, text: str) -> dict[str, Any]:
    """The reasoning item: the reasoning as its content; as its summary too when one is asked
    for (there is no shorter one to give, and Codex shows only summaries); `sealed` as its
    `encrypted_content` when `include` asks for that, for a stateless client to send back."""
    summary = [{"type": "summary_text", "text": text}] if _summarized(ctx) else []
    item = {
        "type": "reasoning",
        "id": _item_id(ctx, "reasoning"),
        "summary": summary,
        "content": [{"type": "reasoning_text", "text": text}],
    }
    if _private(ctx).get("sealed_reasoning"):
        item["encrypted_content"] = sealed(text)
    return item


def _names(ctx: OutputContext) -> dict[str, CallName]:
    """What each shown function's calls are (`tokenway.api.responses.call_names`)."""
    return call_names(_echoed(ctx).get("tools") or [])


def _call_item(
    ctx: OutputContext, names: dict[str, CallName], call_id: str, function: dict[str, Any]
) -> dict[str, Any]:
    """A whole call's output item: a function call (in its namespace), or a custom tool's
    call with its input, as its tool makes them."""
    called = names.get(function["name"], CallName(function["name"]))
    kind = "custom_tool_call" if called.custom else "function_call"
    item = {
        "type": kind,
        "id": _item_id(ctx, kind, call_id),
        "call_id": call_id,
        "name": called.name,
    }
    if called.namespace:
        item["namespace"] = called.namespace
    if called.custom:
        return {**item, "input": _custom_input(function["arguments"])}
    return {**item, "arguments": function["arguments"], "status": "completed"}


def _custom_input(arguments: str) -> str:
    """A custom tool's input: the one string its function was called with (arguments that
    are not that: as they are)."""
    try:
        given = _decode.decode(arguments)
    except msgspec.DecodeError:
        return arguments
    text = given.get(CUSTOM_INPUT) if isinstance(given, dict) else None
    return text if isinstance(text, str) else arguments


def _shell(ctx: OutputContext, status: str) -> dict[str, Any]:
    """The response while it runs: no output, no usage yet."""
    return {
        **_echoed(ctx),
        "id": ctx.response_id,
        "object": "response",
        "created_at": ctx.created,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "model": ctx.model,
        "output": [],
        "usage": None,
    }


class _Events:
    """A stream's events of one delta, numbered on from where the stream was."""

    def __init__(self, opened: Opened, summarized: bool) -> None:
        self.opened = opened
        self.summarized = summarized  # a reasoning item has its summary part
        self.docs: list[bytes] = []

    def add(self, kind: str, **fields: Any) -> None:
        doc = {"type": kind, "sequence_number": self.opened.sent, **fields}
        self.opened = msgspec.structs.replace(self.opened, sent=self.opened.sent + 1)
        self.docs.append(sse.named(kind, _json.encode(doc)))

    def open(self, index: int, item: dict[str, Any]) -> None:
        """An output item begins (a message or reasoning: with its one content part)."""
        self.add("response.output_item.added", output_index=index, item=item)
        part = _PARTS.get(item["type"])
        if item["type"] == "reasoning" and self.summarized:
            self.add(
                "response.reasoning_summary_part.added",
                item_id=item["id"],
                output_index=index,
                summary_index=0,
                part=_SUMMARY,
            )
        if part is not None:
            self.add(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            )


_PARTS = {
    "message": {"type": "output_text", "text": "", "annotations": []},
    "reasoning": {"type": "reasoning_text", "text": ""},
}
_SUMMARY = {"type": "summary_text", "text": ""}


def _item_shell(ctx: OutputContext, kind: str, call: ToolCallDelta | None) -> dict[str, Any]:
    """An output item as a stream opens it: nothing in it yet."""
    if call is None:
        shell = {"type": kind, "id": _item_id(ctx, kind)}
        if kind == "reasoning":
            return {**shell, "summary": [], "content": []}
        return {**shell, "status": "in_progress", "role": "assistant", "content": []}
    name = call.function.name if call.function and call.function.name else ""
    item = _call_item(ctx, _names(ctx), _call_id(ctx, call), {"name": name, "arguments": ""})
    return {**item, "status": "in_progress"} if kind == "function_call" else item


def _call_kind(ctx: OutputContext, opened: Opened, call: ToolCallDelta) -> str:
    """The item a call's delta adds to: its first delta names the function, the rest add
    to the call it opened."""
    if call.function is None or not call.function.name:
        return opened.kind if opened.call == call.index else "function_call"
    custom = _names(ctx).get(call.function.name, CallName("")).custom
    return "custom_tool_call" if custom else "function_call"


def _call_id(ctx: OutputContext, call: ToolCallDelta) -> str:
    """A call's id on every delta of it (only its first one carries it)."""
    return tools.call_id(ctx.response_id, call.index)


def events(
    ctx: OutputContext, out: Out, opened: Opened, first: bool, final: bytes | None
) -> tuple[list[bytes], Opened]:
    """A streamed delta's events, and the open item after them. `final`: on the last delta,
    the whole response (as a request that did not stream gets it), whose items the closing
    events hold."""
    e = _Events(opened, _summarized(ctx))
    if first:
        e.add("response.created", response=_shell(ctx, "in_progress"))
        e.add("response.in_progress", response=_shell(ctx, "in_progress"))
    if out.reasoning:
        item = _switch(e, ctx, "reasoning")
        e.add(
            "response.reasoning_text.delta",
            item_id=item,
            output_index=e.opened.index,
            content_index=0,
            delta=out.reasoning,
        )
        if _summarized(ctx):
            e.add(
                "response.reasoning_summary_text.delta",
                item_id=item,
                output_index=e.opened.index,
                summary_index=0,
                delta=out.reasoning,
            )
    if out.text:
        item = _switch(e, ctx, "message")
        e.add(
            "response.output_text.delta",
            item_id=item,
            output_index=e.opened.index,
            content_index=0,
            delta=out.text,
            logprobs=[],
        )
    for call in out.tool_calls:
        kind = _call_kind(ctx, e.opened, call)
        item = _switch(e, ctx, kind, call)
        # a custom tool's input is whole at its end (its deltas are of the JSON around it)
        if kind == "function_call" and call.function is not None and call.function.arguments:
            e.add(
                "response.function_call_arguments.delta",
                item_id=item,
                output_index=e.opened.index,
                delta=call.function.arguments,
            )
    if final is not None:
        _close(e, _decode.decode(final))
    return e.docs, e.opened


def _switch(e: _Events, ctx: OutputContext, kind: str, call: ToolCallDelta | None = None) -> str:
    """The item of `kind` (and `call`) open: the open one, or the next; its id."""
    o = e.opened
    index = -1 if call is None else call.index
    if not (o.kind == kind and o.call == index):
        e.opened = Opened(kind=kind, index=o.index + 1, call=index, sent=o.sent)
        e.open(e.opened.index, _item_shell(ctx, kind, call))
    return _item_id(ctx, kind, _call_id(ctx, call) if call else "")


def _emptied(item: dict[str, Any]) -> dict[str, Any]:
    """An item as it is added before its text: without it."""
    if item["type"] == "reasoning":
        return {**item, "summary": [], "content": []}
    return {**item, "content": []} if "content" in item else item


def _close(e: _Events, response: dict[str, Any]) -> None:
    """The closing events: each item's end, whole (items no delta opened begin here too),
    then the response's."""
    for index, item in enumerate(response["output"]):
        if index > e.opened.index:
            e.open(index, _emptied(item))
        ids = {"item_id": item["id"], "output_index": index}
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            e.add("response.reasoning_text.done", **ids, content_index=0, text=text)
            e.add("response.content_part.done", **ids, content_index=0, part=item["content"][0])
            for part in item["summary"]:
                e.add(
                    "response.reasoning_summary_text.done",
                    **ids,
                    summary_index=0,
                    text=part["text"],
                )
                e.add("response.reasoning_summary_part.done", **ids, summary_index=0, part=part)
        elif item["type"] == "message":
            text = item["content"][0]["text"]
            e.add("response.output_text.done", **ids, content_index=0, text=text, logprobs=[])
            e.add("response.content_part.done", **ids, content_index=0, part=item["content"][0])
        elif item["type"] == "custom_tool_call":
            e.add("response.custom_tool_call_input.done", **ids, input=item["input"])
        else:
            e.add(
                "response.function_call_arguments.done",
                **ids,
                name=item["name"],
                arguments=item["arguments"],
            )
        e.add("response.output_item.done", output_index=index, item=item)
    # completed, whatever its status says (incomplete: the budget ran out), as vLLM sends it:
    # the SDK's final response comes from this event alone
    e.add(COMPLETED, response=response)


_decode = msgspec.json.Decoder()
