"""Where chat templates are applied: OpenAI messages → the prompt text."""

from __future__ import annotations

import json
from typing import Any

import jinja2

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


# Claude Code's first system line: its version and a hash of the request (`cch=`), new on
# every request, so a prompt that kept it would miss the prefix cache from there on.
_BILLING = "x-anthropic-billing-header"


def _content(msg: Message, index: int) -> str:
    """The text a template gets: parts joined with newlines, as vLLM joins them for a
    string-content template (a system part's Claude Code billing line dropped, as vLLM
    drops it); no content is ""."""
    if msg.content is None:
        return ""
    parts = [msg.content] if isinstance(msg.content, str) else []
    for part in msg.content if not isinstance(msg.content, str) else ():
        if part.type != "text" or part.text is None:
            raise InvalidRequest(
                f"content part of type {part.type!r} is not supported; only text parts are",
                param=f"messages[{index}].content",
            )
        parts.append(part.text)
    if msg.role == "system":
        parts = [p for p in map(_unbilled, parts) if p is not None]
    return "\n".join(parts)


def _unbilled(text: str) -> str | None:
    """A system part without Claude Code's billing line; None when nothing else is in it."""
    if not text.startswith(_BILLING):
        return text
    return text.partition("\n")[2] or None


def _arguments(arguments: str | dict[str, Any]) -> dict[str, Any]:
    """A tool call's arguments as a template gets them from vLLM: the object the JSON
    says; {} for none, for JSON that is no object, or for text that is no JSON (the turn
    stays renderable)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _message(msg: Message, index: int) -> dict[str, Any]:
    """One message as vLLM hands it to a template, key for key."""
    item: dict[str, Any] = {"role": msg.role, "content": _content(msg, index)}
    if msg.role == "assistant":
        if msg.tool_calls:  # an empty list is dropped: templates take the plain path
            item["tool_calls"] = [
                {
                    **({"id": call.id} if call.id is not None else {}),
                    "function": {
                        "arguments": _arguments(call.function.arguments),
                        "name": call.function.name,
                    },
                    "type": call.type,
                }
                for call in msg.tool_calls
            ]
        reasoning = msg.reasoning if msg.reasoning is not None else msg.reasoning_content
        if reasoning is not None:  # earlier reasoning, for templates that interleave it
            item["reasoning"] = item["reasoning_content"] = reasoning
    elif msg.role == "tool" and msg.tool_call_id is not None:
        item["tool_call_id"] = msg.tool_call_id
    if msg.name is not None:
        item["name"] = msg.name
    if msg.role == "developer":
        item["tools"] = None
    return item


def conversation(req: Chat, template: str = "") -> list[dict[str, Any]]:
    """The messages as vLLM hands them to the chat template `template`: a template that
    does not name the developer role gets developer messages as system ones, every system
    message then merged into one at the start (some templates take a system message only
    there)."""
    out = [_message(msg, i) for i, msg in enumerate(req.messages)]
    if any(m["role"] == "developer" for m in out) and not _names_developer(template):
        out = [
            {k: v for k, v in m.items() if k != "tools"} | {"role": "system"}
            if m["role"] == "developer"
            else m
            for m in out
        ]
        out = _one_system(out)
    return out


def _names_developer(template: str) -> bool:
    return '"developer"' in template or "'developer'" in template


def _one_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    systems = [i for i, m in enumerate(messages) if m["role"] == "system"]
    if not systems or systems == [0]:
        return messages
    merged = "\n\n".join(messages[i]["content"] for i in systems if messages[i]["content"])
    rest = [m for m in messages if m["role"] != "system"]
    return [{"role": "system", "content": merged}, *rest]


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
            conversation(req, template_text(tokenizer, tools)),
            tools=tools,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            tokenize=False,
            **template_kwargs(req),
        )
    except (jinja2.TemplateError, ValueError, TypeError) as exc:
        # a template that refuses its input (or trips over it) is the request's 400
        raise InvalidRequest(f"chat template failed: {exc}", param="messages") from exc


def template_text(tokenizer: Any, tools: list[dict[str, Any]] | None) -> str:
    """The chat template the tokenizer applies: a named set's `tool_use` one with tools,
    else its `default`."""
    found = getattr(tokenizer, "chat_template", None)
    if isinstance(found, dict):
        found = (tools and found.get("tool_use")) or found.get("default")
    return found if isinstance(found, str) else ""
