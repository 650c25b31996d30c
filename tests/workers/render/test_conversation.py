"""The conversation a chat template is handed, as vLLM 0.33 hands it (held to vLLM's render
server on the vLLM tier: tests/vllm/test_real_render.py)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from tokenway.api.bodies import decode_body
from tokenway.api.openai import ChatCompletionRequest
from tokenway.errors import InvalidRequest
from workers.render.chat import conversation


def chat(*messages: dict[str, Any]) -> ChatCompletionRequest:
    body = {"model": "m", "messages": list(messages)}
    return msgspec.json.decode(json.dumps(body).encode(), type=ChatCompletionRequest)


def test_tool_call_arguments_reach_the_template_as_objects() -> None:
    """Qwen's templates iterate a call's arguments: JSON text could not be (a 500), so vLLM
    hands an object; {} for none, for JSON that is no object, for text that is no JSON."""
    calls = [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}},
        {"id": "b", "type": "function", "function": {"name": "g", "arguments": ""}},
        {"id": "c", "type": "function", "function": {"name": "h", "arguments": "[1]"}},
        {"id": "d", "type": "function", "function": {"name": "i", "arguments": "{oops"}},
    ]
    (msg,) = conversation(chat({"role": "assistant", "content": None, "tool_calls": calls}))
    assert msg == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "a", "function": {"arguments": {"x": 1}, "name": "f"}, "type": "function"},
            {"id": "b", "function": {"arguments": {}, "name": "g"}, "type": "function"},
            {"id": "c", "function": {"arguments": {}, "name": "h"}, "type": "function"},
            {"id": "d", "function": {"arguments": {}, "name": "i"}, "type": "function"},
        ],
    }
    (empty,) = conversation(chat({"role": "assistant", "content": "x", "tool_calls": []}))
    assert "tool_calls" not in empty


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_an_assistant_turns_reasoning_reaches_the_template(field: str) -> None:
    (msg,) = conversation(chat({"role": "assistant", "content": "A", field: "because"}))
    assert msg == {"role": "assistant", "content": "A", "reasoning": "because",
                   "reasoning_content": "because"}  # fmt: skip


def test_developer_messages_become_one_system_message_unless_the_template_names_them() -> None:
    req = chat(
        {"role": "system", "content": "one"},
        {"role": "user", "content": "hi"},
        {"role": "developer", "content": "two"},
        {"role": "system", "content": "x-anthropic-billing-header: cch=1;\nthree"},
    )
    assert conversation(req) == [
        {"role": "system", "content": "one\n\ntwo\n\nthree"},
        {"role": "user", "content": "hi"},
    ]
    assert conversation(req, "{% if m.role == 'developer' %}")[2] == {
        "role": "developer",
        "content": "two",
        "tools": None,
    }


def test_what_is_not_text_is_refused() -> None:
    req = chat({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]})
    with pytest.raises(InvalidRequest, match="image_url"):
        conversation(req)


@pytest.mark.parametrize(
    ("body", "kwargs"),
    [
        ({"reasoning_effort": "high"}, {"reasoning_effort": "high", "enable_thinking": True}),
        ({"reasoning_effort": "none"}, {"reasoning_effort": "none", "enable_thinking": False}),
        # the client's own switch stands; the effort still reaches the template
        ({"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}},
         {"enable_thinking": False, "reasoning_effort": "low"}),
        ({}, None),
    ],
)  # fmt: skip
def test_reasoning_effort_reaches_the_template_and_the_thinking_switch(
    body: dict[str, Any], kwargs: dict[str, Any] | None
) -> None:
    """As vLLM 0.33 builds a chat's template kwargs: `reasoning_effort` passes as itself and,
    unless the client set it, as `enable_thinking` (off for "none"), which the reasoning
    parsers read too. It was silently dropped."""
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], **body})
    assert decode_body("chat", raw.encode()).chat_template_kwargs == kwargs


def test_an_unknown_reasoning_effort_is_a_400() -> None:
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                      "reasoning_effort": "extreme"})  # fmt: skip
    with pytest.raises(InvalidRequest, match="reasoning_effort"):
        decode_body("chat", raw.encode())
