"""A Responses request as the chat request it is (`tokenway.api.responses.to_chat`): the items
agents send back as history (issue 31)."""

from __future__ import annotations

from typing import Any

import msgspec

from tokenway.api import responses
from tokenway.api.openai import Message


def history(*items: dict[str, Any], **fields: Any) -> list[Message]:
    body = {"model": "m", "input": [{"role": "user", "content": "Go."}, *items], **fields}
    return responses.to_chat(responses.ResponsesDecoder.decode(msgspec.json.encode(body))).messages


def test_sealed_reasoning_sent_back_is_the_turns_reasoning() -> None:
    """A reasoning item with only the `encrypted_content` tokenway made (a stateless client's)
    is the reasoning of the turn after it; another server's is not read (the turn goes on
    without it), and its text, where sent, wins."""
    call = {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"}
    sealed = responses.sealed("I should list the files.")
    assert "list the files" not in sealed
    for encrypted, text, expected in [
        (sealed, None, "I should list the files."),
        ("gAAAAABo-openai-opaque", None, ""),
        (sealed, [{"type": "reasoning_text", "text": "As sent."}], "As sent."),
    ]:
        item = {"type": "reasoning", "summary": [], "encrypted_content": encrypted}
        if text:
            item["content"] = text
        _, turn = history(item, call)
        assert turn.reasoning_content == expected and turn.tool_calls, turn


def test_namespaced_and_custom_calls_sent_back_are_the_calls_the_model_made() -> None:
    """A `function_call` in a namespace is the call of its flat name; a `custom_tool_call`
    the call of its function with its input as the one argument; their outputs (text parts
    too) the tool's messages."""
    _, turn, out1, out2 = history(
        {"type": "function_call", "call_id": "c1", "name": "spawn_agent", "namespace": "agents",
         "arguments": '{"target": "x"}'},
        {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch",
         "input": '*** Begin Patch\n"quoted"\n*** End Patch'},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        {"type": "custom_tool_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "Applied."}]},
    )  # fmt: skip
    first, second = turn.tool_calls
    assert first.function.name == "agents__spawn_agent"
    assert second.function.name == "apply_patch"
    assert msgspec.json.decode(second.function.arguments) == {
        "input": '*** Begin Patch\n"quoted"\n*** End Patch'
    }
    assert (out1.content, out2.content) == ("ok", "Applied.")
