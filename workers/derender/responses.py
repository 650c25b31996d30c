"""OpenAI Responses output, made from the same choice output as a chat completion
(`chunks.Out`): the response object, its output items in the order the model made them
(reasoning, the message, each function call)."""

from __future__ import annotations

from typing import Any

import msgspec

from tokenway.wire import OutputContext
from workers.derender.chunks import Out

_json = msgspec.json.Encoder()


def response(ctx: OutputContext, out: Out, output_tokens: int) -> bytes:
    """The whole response (a request that did not stream); `out.tool_calls` assembled."""
    rid = ctx.response_id.removeprefix("resp_")
    output: list[dict[str, Any]] = []
    if out.reasoning:
        output.append({"type": "reasoning", "id": f"rs_{rid}", "summary": [],
                       "content": [{"type": "reasoning_text", "text": out.reasoning}]})  # fmt: skip
    if out.text or not out.tool_calls:
        text = {"type": "output_text", "text": out.text, "annotations": []}
        output.append({"type": "message", "id": f"msg_{rid}", "status": "completed",
                       "role": "assistant", "content": [text]})  # fmt: skip
    for call in out.tool_calls:
        function = call["function"]
        output.append({"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"],
                       "name": function["name"], "arguments": function["arguments"],
                       "status": "completed"})  # fmt: skip
    cut = out.finish_reason == "length"
    return _json.encode({
        "id": ctx.response_id, "object": "response", "created_at": ctx.created,
        "status": "incomplete" if cut else "completed", "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "model": ctx.model, "output": output, "store": False,
        "usage": {"input_tokens": ctx.prompt_tokens,
                  "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": output_tokens,
                  "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": ctx.prompt_tokens + output_tokens},
    })  # fmt: skip
