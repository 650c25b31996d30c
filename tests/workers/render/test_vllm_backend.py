"""`--render-backend vllm` against a fake vLLM render server over real HTTP: healthy answers are
used, each fault falls back to the local tokenizer (loaded only then) with the same result as
local rendering, and a 400/422 is the request's own error, neither retried nor rendered."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from prometheus_client import REGISTRY

from program.stages import build_stages
from tests.conftest import make_settings
from tests.fakes.vllm_render import FakeVllmRender, Knobs
from tests.test_cli import free_port
from tokenway.errors import InvalidRequest, ModelNotFound, Unprocessable
from tokenway.model import load_model_info
from tokenway.parsers import ParserFlags
from tokenway.served import DEFAULT_PARSERS
from tokenway.wire import Api, RenderRequest
from workers.render.backend import VllmBackend, render_backend
from workers.render.core import Renderer

pytestmark = pytest.mark.asyncio(loop_scope="session")

MODEL = "deepseek-v4"
HELLO = [{"role": "user", "content": "Hello!"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def fake(renderer: Renderer) -> AsyncIterator[FakeVllmRender]:
    async with FakeVllmRender(renderer) as server:
        yield server


def backend_for(
    model_dir: Path, url: str, flags: ParserFlags | None = None, **settings: Any
) -> VllmBackend:
    s = make_settings(
        model_dir.parent, render_backend="vllm", render_url=url, render_timeout=0.5, **settings
    )
    backend = render_backend(s, load_model_info(model_dir), MODEL, flags or ParserFlags())
    assert isinstance(backend, VllmBackend)
    return backend


@pytest_asyncio.fixture(loop_scope="session")
async def backend(fake: FakeVllmRender, model_dir: Path) -> AsyncIterator[VllmBackend]:
    fake.reset()
    b = backend_for(model_dir, fake.url)
    yield b
    await b.aclose()


def request(api: Api = "chat", **body: Any) -> RenderRequest:
    if api == "chat":
        body.setdefault("messages", HELLO)
    else:
        body.setdefault("prompt", "Once upon a time")
    body.setdefault("max_tokens", 20)
    return RenderRequest(api=api, request_id="r1", body=json.dumps(body).encode(), created=1)


def fallbacks(reason: str) -> float:
    return REGISTRY.get_sample_value("tokenway_render_fallbacks_total", {"reason": reason}) or 0.0


@pytest.mark.parametrize("api", ["chat", "completion"])
async def test_a_healthy_server_renders_and_the_local_tokenizer_stays_unloaded(
    backend: VllmBackend, fake: FakeVllmRender, renderer: Renderer, api: Api
) -> None:
    fake.knobs.prefix = [7, 8, 9]  # a rendering local rendering never gives
    generate = await backend.render(request(api))
    local = renderer.render(request(api))
    assert generate.token_ids == [7, 8, 9, *local.token_ids]
    assert generate.context.prompt_tokens == len(local.token_ids) + 3
    assert [c.api for c in fake.calls] == [api]
    assert not backend.local_loaded


async def test_the_servers_sampling_defaults_are_kept_but_not_the_output_fields(
    backend: VllmBackend, fake: FakeVllmRender, renderer: Renderer
) -> None:
    # A generation config's temperature is the server's to apply; n, max_tokens and stop are
    # what derender and the scheduler act on, so they stay as tokenway parsed them.
    fake.knobs.params = {"temperature": 0.6, "top_k": 20, "n": 3, "max_tokens": 5, "stop": ["x"]}
    generate = await backend.render(request(n=2, stop=["END"]))
    params = generate.sampling_params
    assert (params.temperature, params.top_k) == (0.6, 20)
    assert (params.n, params.max_tokens, params.stop) == (2, 20, ["END"])
    assert generate.context.n == 2 and generate.context.stop == ["END"]


async def test_the_parse_plan_from_server_tokens_is_the_local_one(
    fake: FakeVllmRender, model_dir: Path
) -> None:
    # Reasoning starts where the rendered prompt's last marker says: found without the local
    # tokenizer; tool choice comes from the body.
    fake.reset()
    flags = dataclasses.replace(DEFAULT_PARSERS, strict_tool_calling=False)  # as the fake's
    backend = backend_for(model_dir, fake.url, flags)
    local = Renderer(load_model_info(model_dir), MODEL, flags)
    try:
        for kwargs in ({"thinking": True}, {"thinking": False}):
            body = {"chat_template_kwargs": kwargs, "tools": [TOOL], "tool_choice": "required"}
            generate = await backend.render(request(**body))
            assert generate == local.render(request(**body))
            assert generate.context.parse is not None
        assert not backend.local_loaded
    finally:
        await backend.aclose()


async def test_a_forced_call_is_read_as_the_render_server_constrained_it(
    fake: FakeVllmRender, model_dir: Path
) -> None:
    """The fake renders as vLLM's render server does without a tool parser: a forced call
    held to the tools' JSON schema, which derender reads as JSON, whatever tokenway's own
    flags would have built."""
    fake.reset()
    backend = backend_for(model_dir, fake.url, DEFAULT_PARSERS)
    try:
        generate = await backend.render(request(tools=[TOOL], tool_choice="required"))
        so = generate.sampling_params.structured_outputs
        assert so is not None and so.json is not None and so.structural_tag is None
        parse = generate.context.parse
        assert parse is not None and parse.tool_choice == "required" and not parse.native_calls
    finally:
        await backend.aclose()


FAULTS = [
    ("die", None, "connection"),
    ("hang", None, "timeout"),
    ("garbage", None, "undecodable"),
    ("shape", None, "shape"),
    ("empty", None, "empty"),
    ("vocab", None, "vocab"),
    (None, 500, "server_error"),
    (None, 503, "server_error"),
    (None, 404, "status"),
]


@pytest.mark.parametrize(("fault", "status", "reason"), FAULTS)
@pytest.mark.parametrize("api", ["chat", "completion"])
async def test_each_fault_falls_back_to_the_local_tokenizer_loaded_only_then(
    backend: VllmBackend,
    fake: FakeVllmRender,
    renderer: Renderer,
    api: Api,
    fault: Any,
    status: int | None,
    reason: str,
) -> None:
    assert not backend.local_loaded
    before = fallbacks(reason)
    fake.knobs = Knobs(fault=fault, status=status, prefix=[7, 8, 9])
    extra = {"stream": True, "logprobs": True if api == "chat" else 2, "stop": ["."]}
    generate = await backend.render(request(api, **extra))
    assert generate == renderer.render(request(api, **extra))
    assert backend.local_loaded
    assert fallbacks(reason) == before + 1
    assert len(fake.calls) == 1  # one try, then local: no retry


async def test_a_refused_connection_falls_back(model_dir: Path, renderer: Renderer) -> None:
    backend = backend_for(model_dir, f"http://127.0.0.1:{free_port()}")
    before = fallbacks("connection")
    try:
        assert await backend.render(request()) == renderer.render(request())
    finally:
        await backend.aclose()
    assert fallbacks("connection") == before + 1


async def test_a_server_gone_between_requests_falls_back_then_serves_again(
    backend: VllmBackend, fake: FakeVllmRender, renderer: Renderer
) -> None:
    fake.knobs.prefix = [5]
    assert (await backend.render(request())).token_ids[0] == 5  # a kept-alive connection
    await fake.stop()
    try:
        assert await backend.render(request()) == renderer.render(request())
    finally:
        await fake.start()
    assert (await backend.render(request())).token_ids[0] == 5


@pytest.mark.parametrize(("status", "error"), [(400, InvalidRequest), (422, Unprocessable)])
async def test_a_400_or_422_is_the_requests_own_error_with_the_servers_message(
    backend: VllmBackend, fake: FakeVllmRender, status: int, error: type
) -> None:
    fake.knobs = Knobs(status=status, message=f"the server says no ({status})")
    with pytest.raises(error) as info:
        await backend.render(request())
    assert (info.value.status, info.value.message) == (status, f"the server says no ({status})")
    assert len(fake.calls) == 1 and not backend.local_loaded


async def test_what_the_server_refuses_is_not_rendered_locally(
    backend: VllmBackend, fake: FakeVllmRender
) -> None:
    parts = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(InvalidRequest, match="image_url") as info:
        await backend.render(request(messages=parts))
    assert info.value.param == "messages[0].content"
    assert not backend.local_loaded


async def test_what_tokenway_refuses_never_reaches_the_server(
    backend: VllmBackend, fake: FakeVllmRender
) -> None:
    with pytest.raises(ModelNotFound):
        await backend.render(request(model="other"))
    with pytest.raises(InvalidRequest, match="bare token id"):
        await backend.render(request("completion", prompt=["a", 5]))
    assert fake.calls == []


async def test_several_prompts_are_tokenized_locally(
    backend: VllmBackend, fake: FakeVllmRender, renderer: Renderer
) -> None:
    """vLLM's render route takes one prompt; a multi-prompt request does not go there."""
    several = request("completion", prompt=["a", "b c"])
    got = await backend.render(several)
    assert got == renderer.render(several) and got.prompts is not None
    assert fake.calls == [] and backend.local_loaded


async def test_the_budget_is_checked_on_the_servers_tokens(
    backend: VllmBackend, fake: FakeVllmRender, renderer: Renderer
) -> None:
    local = renderer.render(request())
    fits = renderer.builder.info.context_length - len(local.token_ids)
    fake.knobs.prefix = [7] * 5  # the server's prompt is longer than the local one
    with pytest.raises(InvalidRequest, match="maximum context length") as info:
        await backend.render(request(max_tokens=fits))
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "max_tokens")


async def test_vllm_without_a_url_refuses_to_start(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, render_backend="vllm")
    with pytest.raises(SystemExit, match="--render-backend vllm needs --render-url"):
        build_stages(settings, ["render"])
