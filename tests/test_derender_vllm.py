"""The derender backend `vllm` through the whole pipeline (real NATS, stages, HTTP, clients):
a healthy derender server gives the client the local backend's output, with the client's
body and the carried state on every call; a failing server ends the request with an explicit
502/504, never silence; its 400/422 reaches the client with its message."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest
import pytest_asyncio

from program.stages import build_stages
from tests.conftest import Stack, make_settings, resolve_model, start_stack
from tests.fakes.vllm_render import FakeVllmRender, Knobs
from workers.render.core import Renderer

pytestmark = pytest.mark.asyncio(loop_scope="session")

MODEL = "derender-vllm"
CHAT: dict[str, Any] = {
    "messages": [{"role": "user", "content": "Tell me about rivers and lakes."}],
    "max_tokens": 24,
}
COMPLETION: dict[str, Any] = {"prompt": "The history of bridges", "max_tokens": 24}
USAGE = {"stream_options": {"include_usage": True}}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def fake(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[FakeVllmRender]:
    settings = make_settings(tmp_path_factory.mktemp("fake-derender"), served_model_name=MODEL)
    async with FakeVllmRender(Renderer(*resolve_model(settings))) as server:
        yield server


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=["owner", "pool"])
async def vllm_stack(
    nats_url: str,
    fake: FakeVllmRender,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> AsyncIterator[Stack]:
    """The backend in each schedule worker, or in the derender pool."""
    # Render stays local: only derender goes to the fake, which `--render-url` names.
    settings = make_settings(
        tmp_path_factory.mktemp("derender-vllm"), served_model_name=MODEL,
        derender_backend="vllm", render_url=fake.url, derender_server_timeout=1.0,
        derender_placement=request.param,
    )  # fmt: skip
    s = await start_stack(nats_url, settings, ["ingress", "render", "schedule", "derender", "sim"])
    yield s
    await s.close()


async def ask(stack: Stack, path: str, body: dict[str, Any]) -> tuple[int, list[dict], dict]:
    """(HTTP status, the stream's documents or the one response, the error if any)."""
    async with httpx.AsyncClient(timeout=30) as http:
        resp = await http.post(f"{stack.url}/v1/{path}", json=body)
    if resp.status_code != 200:
        return resp.status_code, [], resp.json()["error"]
    if not body.get("stream"):
        return 200, [resp.json()], {}
    docs = [
        json.loads(line[6:])
        for line in resp.text.splitlines()
        if line.startswith("data: {")  # the [DONE] line is not a document
    ]
    errors = [d["error"] for d in docs if "error" in d]
    return 200, docs, errors[0] if errors else {}


def text(docs: list[dict]) -> dict[int, str]:
    """Each choice's text, from stream chunks or a response."""
    out: dict[int, str] = {}
    for doc in docs:
        for c in doc.get("choices", []):
            part = c.get("delta", {}).get("content") or c.get("message", {}).get("content")
            out[c["index"]] = out.get(c["index"], "") + (part or c.get("text") or "")
    return out


def finishes(docs: list[dict]) -> dict[int, str]:
    return {c["index"]: c["finish_reason"] for d in docs for c in d.get("choices", [])
            if c.get("finish_reason")}  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("chat/completions", {**CHAT, "stream": True, **USAGE}),
        ("chat/completions", CHAT),
        ("completions", {**COMPLETION, "stream": True, **USAGE}),
        ("completions", COMPLETION),
        ("chat/completions", {**CHAT, "n": 2, "seed": 3, "stream": True, **USAGE}),
        ("chat/completions", {**CHAT, "n": 2, "seed": 3, "logprobs": True, "top_logprobs": 2}),
        ("completions", {**COMPLETION, "prompt": ["Rain", "Snow"], "stream": True, **USAGE}),
        ("completions", {**COMPLETION, "prompt": ["Rain", "Snow"], "n": 2, "seed": 5}),
    ],
    ids=[
        "chat-stream",
        "chat",
        "completion-stream",
        "completion",
        "n2-stream",
        "n2-logprobs",
        "prompts-stream",
        "prompts-n2",
    ],
)
async def test_a_healthy_derender_server_gives_the_local_output(
    stack: Stack, vllm_stack: Stack, fake: FakeVllmRender, path: str, body: dict[str, Any]
) -> None:
    fake.reset()
    status, local, _ = await ask(stack, path, {**body, "model": stack.model})
    assert status == 200
    sent = {**body, "model": MODEL}
    status, remote, error = await ask(vllm_stack, path, sent)
    assert status == 200 and not error
    assert text(remote) == text(local) and all(text(remote).values())
    assert finishes(remote) == finishes(local)
    usage = [d["usage"] for d in remote if d.get("usage")]
    # vLLM's derender server makes usage anew, without the engine's prefix-cache count
    said = [{k: v for k, v in d["usage"].items() if k != "prompt_tokens_details"}
            for d in local if d.get("usage")]  # fmt: skip
    assert usage == said and len(usage) == 1
    if not body.get("stream"):
        assert remote[0]["choices"][0].get("logprobs") == local[0]["choices"][0].get("logprobs")
    assert len({d["created"] for d in remote}) == 1  # one response, one timestamp
    for doc in remote if body.get("stream") else []:  # vLLM's empty answers are not sent
        shown = [
            c.get("text")
            or c.get("finish_reason")
            or c["delta"].get("role")
            or c["delta"].get("content")
            for c in doc["choices"]
        ]
        assert doc.get("usage") or any(shown), doc

    calls = [c for c in fake.calls if c.derender]
    assert calls and not [c for c in fake.calls if not c.derender]  # render stayed local
    key = "chat_request" if path.startswith("chat") else "completion_request"
    assert all(c.body[key] == sent for c in calls)  # the client's body, as it sent it
    if body.get("stream"):
        carried = [c.body["stream_state"] for c in calls if c.body.get("stream_state")]
        assert carried and all("tw" in s for s in carried)  # the server's own state came back


@pytest.mark.parametrize("knobs", [Knobs(fault="die", times=1), Knobs(status=503, times=2)],
                         ids=["die-once", "503-twice"])  # fmt: skip
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_a_derender_server_failing_briefly_is_tried_again(
    stack: Stack, vllm_stack: Stack, fake: FakeVllmRender, knobs: Knobs, stream: bool
) -> None:
    """The same delta and state again (derender is pure): the client sees no difference."""
    body = {**CHAT, "stream": stream}
    _, local, _ = await ask(stack, "chat/completions", {**body, "model": stack.model})
    fake.reset(knobs)
    status, remote, error = await ask(vllm_stack, "chat/completions", {**body, "model": MODEL})
    assert status == 200 and not error and text(remote) == text(local)
    assert fake.knobs.times is not None and fake.knobs.times < 0  # every fault was served


@pytest.mark.parametrize(
    ("knobs", "status"),
    [
        (Knobs(fault="die"), 502),
        (Knobs(fault="hang"), 504),
        (Knobs(status=503), 502),
        (Knobs(fault="garbage"), 502),
    ],
    ids=["die", "hang", "503", "garbage"],
)
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_a_failing_derender_server_ends_the_request_with_an_error(
    vllm_stack: Stack, fake: FakeVllmRender, knobs: Knobs, status: int, stream: bool
) -> None:
    fake.reset(knobs)
    code, docs, error = await ask(vllm_stack, "chat/completions", {**CHAT, "model": MODEL,
                                                                   "stream": stream})  # fmt: skip
    assert error, f"no error reached the client: {code} {docs}"
    assert (error.get("code") if code == 200 else code) == status
    assert not text(docs).get(0)  # nothing was derendered
    assert any(c.derender for c in fake.calls)


async def test_a_state_past_the_bound_ends_the_stream_with_an_error(
    vllm_stack: Stack, fake: FakeVllmRender
) -> None:
    """vLLM's parser path grows its state with the output: past the header bound, the stream
    ends with an error naming it rather than committing a state no owner could read back."""
    fake.reset(Knobs(state_pad=20_000))
    body = {**CHAT, "model": MODEL, "stream": True}
    code, docs, error = await ask(vllm_stack, "chat/completions", body)
    assert (error.get("code") if code == 200 else code) == 502
    assert "stream_state grew" in error["message"] and not text(docs).get(0)


@pytest.mark.parametrize(
    ("knobs", "body", "status", "message"),
    [
        (Knobs(status=422, message="no such parser"), {}, 422, "no such parser"),
        (Knobs(status=400, message="bad tokens"), {"stream": True}, 400, "bad tokens"),
        (Knobs(), {"stream": True, "stop": ["river"]}, 400, "stop strings are not supported"),
    ],
    ids=["422", "400-stream", "stream-stop-strings"],
)
async def test_a_derender_refusal_reaches_the_client_with_its_message(
    vllm_stack: Stack, fake: FakeVllmRender, knobs: Knobs, body: dict, status: int, message: str
) -> None:
    fake.reset(knobs)
    code, _, error = await ask(vllm_stack, "chat/completions", {**CHAT, "model": MODEL, **body})
    assert (error.get("code") if code == 200 else code) == status
    assert message in error["message"]


async def test_vllm_derender_without_a_url_refuses_to_start(tmp_path) -> None:
    settings = make_settings(tmp_path, derender_backend="vllm")
    with pytest.raises(SystemExit, match="--derender-url"):
        build_stages(settings, ["derender"])
    too_slow = msgspec.structs.replace(
        settings, derender_url="http://127.0.0.1:9", derender_server_timeout=20.0
    )
    with pytest.raises(SystemExit, match="must be below"):
        build_stages(too_slow, ["derender"])


async def test_derender_calls_too_big_for_the_bus_are_split_or_refused(
    vllm_stack: Stack, fake: FakeVllmRender
) -> None:
    """The client's body rides on every entry: entries that outgrow the bus's payload limit
    (8 MiB here) together go to the pool as several calls; a whole response's choices cannot
    be split (derender merges them), so one too big for a call is the client's 400 naming the
    limit, not silence. A schedule worker derendering in process has no such limit."""
    fake.reset()
    pad = "x" * (2 << 20)  # an extra field: ignored by the parser, carried in the body
    body = {**CHAT, "model": MODEL, "seed": 1, "user": pad}
    whole = {**body, "n": 2}  # two such requests finishing together: one call of ~8.4 MB
    answers = await asyncio.gather(*(ask(vllm_stack, "chat/completions", whole) for _ in "ab"))
    for status, docs, error in answers:
        assert status == 200 and not error and sorted(text(docs)) == [0, 1], error
    for stream in (True, False):
        status, docs, error = await ask(
            vllm_stack, "chat/completions", {**body, "n": 5, "stream": stream}
        )
        if stream or vllm_stack.settings.derender_placement == "owner":
            assert status == 200 and not error and sorted(text(docs)) == [0, 1, 2, 3, 4]
        else:
            assert (error.get("code") if status == 200 else status) == 400
            assert "over the bus's message limit" in error["message"]
