"""Where chat templates are applied: OpenAI messages → the prompt text."""

from __future__ import annotations

from typing import Any

import jinja2
import msgspec

from tokenway.api.openai import ChatCompletionRequest, Message, TokenizeChatRequest, Tool
from tokenway.errors import InvalidRequest

# What a chat template is applied to: a chat request, or the messages `/tokenize` is given.
Chat = ChatCompletionRequest | TokenizeChatRequest

# apply_chat_template's own arguments: a client may not smuggle them in as template kwargs.
_RESERVED = {
    "conversation",
    "messages",
    "tools",
    "tokenize",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "documents",
    "return_dict",
}


def _content(msg: Message, index: int) -> str | None:
    """Content parts are joined with newlines, as vLLM does for string-content templates."""
    if msg.content is None or isinstance(msg.content, str):
        return msg.content
    texts = []
    for part in msg.content:
        if part.type != "text" or part.text is None:
            raise InvalidRequest(
                f"content part of type {part.type!r} is not supported; only text parts are",
                param=f"messages[{index}].content",
            )
        texts.append(part.text)
    return "\n".join(texts)


def conversation(req: Chat) -> list[dict[str, Any]]:
    out = []
    for i, msg in enumerate(req.messages):
        item: dict[str, Any] = {
            "role": "system" if msg.role == "developer" else msg.role,
            "content": _content(msg, i),
        }
        if msg.tool_calls:
            item["tool_calls"] = msgspec.to_builtins(msg.tool_calls)
        if msg.tool_call_id is not None:
            item["tool_call_id"] = msg.tool_call_id
        if msg.name is not None:
            item["name"] = msg.name
        out.append(item)
    return out


def template_tool(tool: Tool) -> dict[str, Any]:
    """A tool as vLLM hands it to a chat template, whatever order the client wrote it in:
    `type`, then `function` with `name`, `description` and `parameters` (null when absent)
    and `strict` when given. A template that writes tools as JSON (Qwen's do) then renders
    the prompt vLLM renders."""
    fn = tool.function
    function: dict[str, Any] = {
        "name": fn.name,
        "description": fn.description,
        "parameters": fn.parameters,
    }
    if fn.strict is not None:
        function["strict"] = fn.strict
    return {"type": tool.type, "function": function}


def template_kwargs(req: Chat) -> dict[str, Any]:
    kwargs = dict(req.chat_template_kwargs or {})
    clash = _RESERVED.intersection(kwargs)
    if clash:
        raise InvalidRequest(
            f"chat_template_kwargs may not set {sorted(clash)}", param="chat_template_kwargs"
        )
    return kwargs


def apply_template(tokenizer: Any, req: Chat) -> str:
    if req.continue_final_message and req.add_generation_prompt:
        raise InvalidRequest(
            "continue_final_message and add_generation_prompt cannot both be true",
            param="continue_final_message",
        )
    tools = [template_tool(t) for t in req.tools] if req.tools else None
    try:
        return tokenizer.apply_chat_template(
            conversation(req),
            tools=tools,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            tokenize=False,
            **template_kwargs(req),
        )
    except (jinja2.TemplateError, ValueError) as exc:
        raise InvalidRequest(f"chat template failed: {exc}", param="messages") from exc
