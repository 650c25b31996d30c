"""The Responses API as coding agents use it (Codex CLI, issue 31): their default tools
(functions, a namespace of functions, hosted tools such as web search), their items sent
back as history, tool outputs given as parts, custom (freeform) tools, and the fields they
read (reasoning summaries, reasoning tokens, verbosity, encrypted reasoning). Bodies are
written for these tests in the shape Codex sends them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio

from tests.conftest import Stack

pytestmark = pytest.mark.asyncio(loop_scope="session")

SHELL = {
    "type": "function", "name": "shell", "description": "Runs a shell command.",
    "strict": False,
    "parameters": {"type": "object", "properties": {
        "command": {"type": "array", "items": {"type": "string"}},
        "workdir": {"type": "string"}}, "required": ["command"],
        "additionalProperties": False},
}  # fmt: skip
PLAN = {
    "type": "function", "name": "update_plan", "description": "Updates the plan.",
    "strict": False,
    "parameters": {"type": "object", "properties": {"explanation": {"type": "string"}},
                   "required": ["explanation"], "additionalProperties": False},
}  # fmt: skip


def namespace(name: str, *functions: str) -> dict[str, Any]:
    """A namespace of function tools, as Codex groups its agent tools."""
    tools = [{"type": "function", "name": f, "description": f"The {f} tool.", "strict": False,
              "parameters": {"type": "object", "properties": {"target": {"type": "string"}},
                             "required": ["target"], "additionalProperties": False}}
             for f in functions]  # fmt: skip
    return {"type": "namespace", "name": name, "description": f"The {name} tools.",
            "tools": tools}  # fmt: skip


AGENTS = namespace("agents", "spawn_agent", "send_input")
WEB_SEARCH = {"type": "web_search", "external_web_access": False}
CODEX_TOOLS = [SHELL, PLAN, AGENTS, WEB_SEARCH]


def codex_body(stack: Stack, **fields: Any) -> dict[str, Any]:
    """A request as Codex makes one: instructions, a developer and a user message, its
    tools, stateless (store: false) and streamed."""
    return {
        "model": stack.model, "instructions": "You are a coding agent.",
        "input": [
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "Sandbox: workspace-write."}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "List the files."}]},
        ],
        "tools": CODEX_TOOLS, "tool_choice": "auto", "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"}, "store": False, "stream": True,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "c0ffee",
        "max_output_tokens": 60,
        **fields,
    }  # fmt: skip


@pytest_asyncio.fixture(loop_scope="session")
async def client(stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="-", max_retries=0) as c:
        yield c


async def streamed(http: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed response's events (a refusal: its error body raised as an assertion)."""
    async with http.stream("POST", "/v1/responses", json=body) as resp:
        text = (await resp.aread()).decode()
    assert resp.status_code == 200, text
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


async def both_ways(client: openai.AsyncOpenAI, asks: dict[str, Any]) -> tuple[Any, list[Any], Any]:
    """A request's response unstreamed, and streamed: its events and final response."""
    whole = await client.responses.create(**asks)
    async with client.responses.stream(**asks) as stream:
        events = [event async for event in stream]
        return whole, events, await stream.get_final_response()


async def refused(http: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    """The 400's error object a body is answered with."""
    resp = await http.post("/v1/responses", json={**body, "stream": False})
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]


async def test_codex_default_tools_complete_a_turn(http: httpx.AsyncClient, stack: Stack) -> None:
    """Functions, a namespace of functions and a web search the deployment cannot run: the
    turn completes, streamed as Codex reads it."""
    events = await streamed(http, codex_body(stack))
    assert events[-1]["type"] == "response.completed", events[-1]
    done = events[-1]["response"]
    assert done["output"] and done["status"] in ("completed", "incomplete")
    alone = await streamed(http, codex_body(stack, tools=[WEB_SEARCH]))
    assert alone[-1]["type"] == "response.completed"


async def test_a_namespaced_function_is_called_by_its_name_in_its_namespace(
    client: openai.AsyncOpenAI, stack: Stack
) -> None:
    """The model is shown `agents__spawn_agent`; the call comes back as `spawn_agent` in the
    namespace `agents`, whether the choice names it by its own name or the flat one, whole
    or streamed; sent back (as Codex replays its calls), it is the same call in history."""
    for chosen in ("spawn_agent", "agents__spawn_agent"):
        asks = {"model": stack.model, "input": "Start a helper.", "tools": CODEX_TOOLS,
                "tool_choice": {"type": "function", "name": chosen}, "store": False,
                "max_output_tokens": 200}  # fmt: skip
        whole, events, final = await both_ways(client, asks)
        for done in (whole, final):
            (call,) = [item for item in done.output if item.type == "function_call"]
            assert (call.name, call.namespace) == ("spawn_agent", "agents"), call
            assert set(json.loads(call.arguments)) == {"target"}
        added = [e.item for e in events if e.type == "response.output_item.added"
                 and e.item.type == "function_call"]  # fmt: skip
        assert [(i.name, i.namespace) for i in added] == [("spawn_agent", "agents")]
        (args_done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert args_done.name == "spawn_agent"
    answered = await client.responses.create(
        model=stack.model, tools=CODEX_TOOLS, store=False, max_output_tokens=8,
        input=[{"role": "user", "content": "Start a helper."}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "started"}],
    )  # fmt: skip
    assert answered.status in ("completed", "incomplete")


async def test_a_choice_of_a_name_two_namespaces_hold_is_a_400(
    http: httpx.AsyncClient, stack: Stack
) -> None:
    twice = [namespace("a", "open"), namespace("b", "open")]
    body = codex_body(stack, tools=twice, tool_choice={"type": "function", "name": "open"})
    error = await refused(http, body)
    assert error["param"] == "tool_choice" and "a__open" in error["message"], error
    assert "b__open" in error["message"]
    chosen = codex_body(stack, tools=twice, tool_choice={"type": "function", "name": "b__open"})
    events = await streamed(http, chosen)
    (call,) = [i for i in events[-1]["response"]["output"] if i["type"] == "function_call"]
    assert (call["name"], call["namespace"]) == ("open", "b")


@pytest.mark.parametrize(("tools", "choice", "named"), [
    ([SHELL, {"type": "local_shell"}], "auto", "local_shell"),
    ([SHELL], {"type": "web_search"}, "web_search"),
    ([{"type": "telepathy"}], "auto", "telepathy"),
])  # fmt: skip
async def test_what_no_model_call_here_can_be_is_refused_by_name(
    http: httpx.AsyncClient, stack: Stack, tools: list[Any], choice: Any, named: str
) -> None:
    """A tool the client runs that tokenway cannot give it the call items of (local_shell),
    a choice that forces a hosted tool that is not run here, a tool type unknown."""
    error = await refused(http, codex_body(stack, tools=tools, tool_choice=choice))
    assert named in error["message"] and error["param"] in ("tools", "tool_choice"), error


async def test_hosted_calls_replayed_as_history_are_taken(
    http: httpx.AsyncClient, stack: Stack
) -> None:
    """A web search call another server ran, sent back with the history: it told the model
    nothing it can use here, and the turn goes on; a local shell call is refused by name."""
    history = [
        {"type": "message", "role": "user", "content": "Find the docs."},
        {"type": "web_search_call", "id": "ws_1", "status": "completed",
         "action": {"type": "search", "query": "docs"}},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Found them."}]},
        {"type": "message", "role": "user", "content": "Thanks."},
    ]  # fmt: skip
    events = await streamed(http, codex_body(stack, input=history))
    assert events[-1]["type"] == "response.completed"
    shell = {"type": "local_shell_call", "id": "lsh_1", "call_id": "c1", "status": "completed",
             "action": {"type": "exec", "command": ["ls"], "env": {}}}  # fmt: skip
    error = await refused(http, codex_body(stack, input=[*history, shell]))
    assert "local_shell_call" in error["message"] and error["param"] == "input[4]", error


async def prompt_of(http: httpx.AsyncClient, stack: Stack, response_id: str) -> str:
    """The prompt the engine was given for a response, as text."""
    (work,) = [w for b in stack.by_name["engine"] for w in b.engine.received
               if w.request_id == response_id.removeprefix("resp_")]  # fmt: skip
    back = await http.post("/detokenize", json={"tokens": work.token_ids})
    return back.json()["prompt"]


def called(stack: Stack, call: dict[str, Any], output: Any) -> dict[str, Any]:
    """A body that sends back a call and its output, as the next turn's input."""
    kind = "custom_tool_call_output" if call["type"] == "custom_tool_call" else (
        "function_call_output")  # fmt: skip
    return {"model": stack.model, "tools": [SHELL, APPLY_PATCH], "store": False,
            "max_output_tokens": 8, "input": [
                {"role": "user", "content": "List the files."}, call,
                {"type": kind, "call_id": call["call_id"], "output": output}]}  # fmt: skip


CALL = {"type": "function_call", "call_id": "call_1", "name": "shell",
        "arguments": '{"command": ["ls"]}'}  # fmt: skip


async def test_a_tool_output_of_text_parts_is_their_text(
    http: httpx.AsyncClient, stack: Stack
) -> None:
    """`function_call_output.output` as `input_text` parts, as Codex and the Agents SDK may
    send it: the model reads their text."""
    parts = [
        {"type": "input_text", "text": "README.md\n"},
        {"type": "input_text", "text": "setup.py"},
    ]
    done = await http.post("/v1/responses", json=called(stack, CALL, parts))
    assert done.status_code == 200, done.text
    assert "README.md\nsetup.py" in await prompt_of(http, stack, done.json()["id"])


@pytest.mark.parametrize("part", [
    {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo=", "detail": "auto"},
    {"type": "input_file", "file_id": "file-1"},
])  # fmt: skip
async def test_a_tool_output_of_an_image_or_file_is_refused_by_name(
    http: httpx.AsyncClient, stack: Stack, part: dict[str, Any]
) -> None:
    """Images and files need multimodal input, which is not served yet: a 400 naming the
    part, not one about the output's type."""
    parts = [{"type": "input_text", "text": "A screenshot:"}, part]
    resp = await http.post("/v1/responses", json=called(stack, CALL, parts))
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert part["type"] in error["message"] and error["param"] == "input[2].output", error


async def test_a_reasoning_summary_is_the_reasoning(
    client: openai.AsyncOpenAI, stack: Stack
) -> None:
    """`reasoning.summary` asked: the reasoning item's summary holds its reasoning (Codex
    shows summaries only), whole and streamed, and the usage counts its tokens;
    `text.verbosity` is echoed."""
    asks = {"model": stack.model, "input": "Describe a city.", "store": False,
            "reasoning": {"effort": "high", "summary": "auto"}, "max_output_tokens": 300,
            "text": {"verbosity": "low"}}  # fmt: skip
    whole, events, final = await both_ways(client, asks)
    for done in (whole, final):
        (thought,) = [item for item in done.output if item.type == "reasoning"]
        assert [s.text for s in thought.summary] == [thought.content[0].text], thought
        assert done.text.verbosity == "low" and done.reasoning.summary == "auto"
        assert 0 < done.usage.output_tokens_details.reasoning_tokens <= done.usage.output_tokens
    deltas = [e.delta for e in events if e.type == "response.reasoning_summary_text.delta"]
    assert "".join(deltas) == thought.content[0].text
    kinds = [e.type for e in events]
    assert kinds.count("response.reasoning_summary_part.added") == 1
    assert kinds.count("response.reasoning_summary_part.done") == 1
    unasked = await client.responses.create(**{**asks, "reasoning": {"effort": "high"}})
    assert unasked.output[0].type == "reasoning" and unasked.output[0].summary == []


async def test_encrypted_reasoning_goes_back_as_the_reasoning(
    http: httpx.AsyncClient, stack: Stack
) -> None:
    """`include: ["reasoning.encrypted_content"]` (Codex, with store: false): the reasoning
    item carries it, and the item sent back with only that is the turn's reasoning again."""
    body = codex_body(stack, stream=False, tools=[SHELL], max_output_tokens=300,
                      tool_choice={"type": "function", "name": "shell"})  # fmt: skip
    resp = await http.post("/v1/responses", json=body)
    assert resp.status_code == 200, resp.text
    thought, call = resp.json()["output"][:2]
    assert thought["type"] == "reasoning" and thought["encrypted_content"], thought
    reasoning = thought["content"][0]["text"]
    assert reasoning not in thought["encrypted_content"]
    sent_back = {"type": "reasoning", "id": thought["id"], "summary": [],
                 "encrypted_content": thought["encrypted_content"]}  # fmt: skip
    again = await http.post(
        "/v1/responses",
        json={
            **called(stack, call, "README.md"),
            "input": [
                {"role": "user", "content": "List the files."},
                sent_back,
                call,
                {"type": "function_call_output", "call_id": call["call_id"], "output": "README.md"},
            ],
        },
    )
    assert again.status_code == 200, again.text  # what it reads back: tests/tokenway
    unasked = await http.post("/v1/responses", json={**body, "include": []})
    assert "encrypted_content" not in unasked.json()["output"][0]


APPLY_PATCH = {
    "type": "custom", "name": "apply_patch", "description": "Applies a patch to files.",
    "format": {"type": "grammar", "syntax": "lark",
               "definition": 'start: "*** Begin Patch" /(.|\\n)*/ "*** End Patch"'},
}  # fmt: skip


async def test_a_custom_tool_is_called_with_its_input(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient, stack: Stack
) -> None:
    """A custom (freeform) tool is shown as a function of one string, as vLLM shows it; its
    call is a `custom_tool_call` item holding that string, whole or streamed, and sent back
    with its output it is that call in history."""
    asks = {"model": stack.model, "input": "Fix the typo.", "tools": [SHELL, APPLY_PATCH],
            "tool_choice": {"type": "custom", "name": "apply_patch"}, "store": False,
            "max_output_tokens": 200}  # fmt: skip
    whole, events, final = await both_ways(client, asks)
    for done in (whole, final):
        (call,) = [item for item in done.output if item.type == "custom_tool_call"]
        assert call.name == "apply_patch" and isinstance(call.input, str), call
        assert not call.input.startswith("{"), call.input  # the string, not its JSON
    (added,) = [e.item for e in events if e.type == "response.output_item.added"
                and e.item.type != "reasoning"]  # fmt: skip
    assert (added.type, added.name) == ("custom_tool_call", "apply_patch")
    (input_done,) = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert input_done.input == call.input
    body = called(stack, call.model_dump(exclude_none=True), "Done.")
    answered = await http.post("/v1/responses", json=body)
    assert answered.status_code == 200, answered.text
    prompt = await prompt_of(http, stack, answered.json()["id"])
    assert json.dumps(call.input)[1:-1][:30] in prompt and "Done." in prompt
