"""A request's fault stays its own: what an engine refuses about a request (a grammar it
cannot compile) is that request's 400 with the engine's reason, never relayed and never
counted against the engine, so one client sending such requests cannot take the engine
away from everyone else; and what render can tell is refused is refused before anything is
queued. Through the whole pipeline, with the simulated engine and with a fake vLLM speaking
vLLM's wire."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
from prometheus_client import REGISTRY
from tokenizers import Tokenizer

from engines.bridge import Bridge
from engines.vllm_http import VllmEndpoint, VllmEngine
from tests.conftest import Stack, make_settings, resolve_model, start_stack, wait_engines
from tests.fakes.vllm_engine import FakeVllm, Knobs
from tests.test_errors import assert_error
from tokenway import bus

pytestmark = pytest.mark.asyncio(loop_scope="session")

HI = [{"role": "user", "content": "hi"}]
# Well formed, as vLLM's xgrammar takes it, but a format the simulated engine cannot decode.
QWEN = {"type": "qwen_xml_parameter", "json_schema": {"type": "object"}}
UNDECODABLE = {"type": "structural_tag", "format": QWEN}
# What vLLM refuses: a format kind it does not know (the request), no format, a tag
# without content, the older form with nothing in it or a structure no trigger opens, a
# list with nothing in it, a tag whose free text never ends.
REFUSED = {
    "unknown-kind": ({"type": "structural_tag", "format": {"type": "nope"}}, '"nope"'),
    "no-format": ({"type": "structural_tag"}, "structural_tag specification"),
    "tag-without-content": (
        {"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>"}},
        "content"),
    "old-form-empty": ({"type": "structural_tag", "structures": [], "triggers": []},
                       "structures"),
    "old-form-untriggered": (
        {"type": "structural_tag", "triggers": ["<b"],
         "structures": [{"begin": "<a>", "schema": {"type": "object"}, "end": "</a>"}]},
        "none of the triggers"),
    "empty-sequence": ({"type": "structural_tag", "format": {"type": "sequence", "elements": []}},
                       "at least one element"),
    "endless-tag": (
        {"type": "structural_tag",
         "format": {"type": "tag", "begin": "<a>", "content": {"type": "any_text"}, "end": ""}},
        "end must be a non-empty string"),
}  # fmt: skip


def chat(model: str, response_format: dict[str, Any], stream: bool = False) -> dict[str, Any]:
    return {"model": model, "messages": HI, "max_tokens": 4, "stream": stream,
            "response_format": response_format}  # fmt: skip


def relays(model: str) -> float:
    return REGISTRY.get_sample_value("tokenway:relays_total", {"model_name": model}) or 0.0


async def queued(stack: Stack) -> int:
    """The last sequence of TW_SCHED: how many requests were ever queued for an owner."""
    nc = await nats.connect(stack.observer)
    try:
        return (await nc.jetstream().stream_info(bus.SCHED_STREAM)).state.last_seq
    finally:
        await nc.close()


async def test_a_tag_render_refuses_is_a_400_naming_it_before_anything_is_queued(
    stack: Stack,
) -> None:
    """The issue's request (`{"type": "nope"}`) and the other forms vLLM refuses passed
    render's checks and failed at the engine (a 502 after three relays, the engine's breaker
    open); now each is a 400 naming `response_format`, and nothing reaches the queue."""
    engine = stack.by_name["engine"][0].engine
    seen, before = len(engine.received), await queued(stack)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        for tag, says in REFUSED.values():
            for stream in (False, True):
                resp = await http.post("/v1/chat/completions", json=chat(stack.model, tag, stream))
                error = assert_error(resp, 400, says)
                assert error["param"] == "response_format", error
        # what vLLM takes is served: the older form, a grammar format (EBNF, as xgrammar's)
        structure = {"begin": "<a>", "schema": {"type": "object"}, "end": "</a>"}
        old = {"type": "structural_tag", "triggers": ["<a"], "structures": [structure]}
        grammar = {"type": "grammar", "grammar": 'root ::= "yes" | "no"'}
        around = {"type": "tag", "begin": "<a>", "content": grammar, "end": "</a>"}
        tagged = {"type": "structural_tag", "format": around}
        for served in (old, tagged):
            resp = await http.post("/v1/chat/completions",
                                   json=chat(stack.model, served) | {"max_tokens": 32})  # fmt: skip
            assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] in ("<a>yes</a>", "<a>no</a>")
    assert await queued(stack) == before + 2  # the ones served
    assert len(engine.received) == seen + 2


async def test_a_constraint_the_engine_refuses_is_the_requests_400_and_spares_the_engine(
    stack: Stack,
) -> None:
    """A tag vLLM takes but the simulated engine cannot decode: the engine's refusal was
    relayed three times and counted as four engine failures, so each such request opened
    the engine's breaker (a back-off up to 60 s for every tenant). Now it is the request's
    400 with the engine's reason, the engine ran it once, and the next request is served."""
    bridge = stack.by_name["engine"][0]
    schedule = stack.by_name["schedule"][0]
    relayed, seen = relays(stack.model), len(bridge.engine.received)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        for stream in (False, True, False):
            resp = await http.post("/v1/chat/completions",
                                   json=chat(stack.model, UNDECODABLE, stream))  # fmt: skip
            error = assert_error(resp, 400, "cannot decode this constraint", "qwen_xml_parameter")
            assert error["type"] == "BadRequestError"
        assert len(bridge.engine.received) == seen + 3  # once each: never relayed
        assert relays(stack.model) == relayed
        assert schedule.dispatcher.breakers.state(bridge.id, time.monotonic()) == "closed"
        calm = await http.post("/v1/chat/completions", json={
            "model": stack.model, "messages": HI, "max_tokens": 4})  # fmt: skip
        assert calm.status_code == 200, calm.text
        assert len(bridge.engine.received) == seen + 4


@contextlib.asynccontextmanager
async def vllm_pipeline(
    nats_url: str, tmp_path: Path, knobs: Knobs, **settings: object
) -> AsyncIterator[tuple[Stack, FakeVllm, str]]:
    """The stages in front of one fake vLLM (its bridge as the engine role), serving a
    model of their own; yields the stack, the fake and the engine's id."""
    model = f"fault-{tmp_path.name}"
    s = make_settings(tmp_path, served_model_name=model, **settings)
    resolved, served = resolve_model(s)
    tokenizer = Tokenizer.from_file(str(resolved.path / "tokenizer.json"))
    fake = FakeVllm.for_tokenizer(tokenizer, resolved.eos_token_ids[0], knobs)
    stop = asyncio.Event()
    async with fake:
        stack = await start_stack(nats_url, s, ["ingress", "render", "schedule", "derender"])
        engine = VllmEngine(VllmEndpoint(url=fake.url, id=f"{model}-vllm", model=served))
        running = asyncio.create_task(Bridge(stack.role("engine"), engine).run(stack.settings.nats,
                                                                               stop))  # fmt: skip
        try:
            await wait_engines(stack.by_name["schedule"][0].registry, 1)
            await wait_engines(stack.ingress.registry, 1)
            yield stack, fake, f"{model}-vllm"
        finally:
            stop.set()
            await running
            await engine.aclose()
            await stack.close()


VLLM_REFUSES = "Invalid structural tag specification."


@pytest.mark.parametrize(
    "knobs",
    [Knobs(fail_status=400, error_message=VLLM_REFUSES),
     Knobs(error_after=0, error_status=400, error_message=VLLM_REFUSES)],
    ids=["http-400", "error-event-400"],
)  # fmt: skip
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_vllm_refusing_a_request_is_its_400_not_relayed_and_no_breaker_moves(
    nats_url: str, tmp_path: Path, knobs: Knobs, stream: bool
) -> None:
    """vLLM answers a grammar it cannot compile with a 400 (or, once its stream began, an
    error event with code 400): the client gets that 400 with vLLM's reason; the request is
    not sent again, and the engine's breaker (opened here by one failure) stays closed."""
    async with vllm_pipeline(nats_url, tmp_path, knobs, breaker_threshold=1) as (stack, fake, id_):
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
            for _ in range(2):
                resp = await http.post(
                    "/v1/completions",
                    json={"model": stack.model, "prompt": "hi", "max_tokens": 4, "stream": stream},
                )
                error = assert_error(resp, 400, VLLM_REFUSES)
                assert error["type"] == "BadRequestError"
        assert len(fake.requests) == 2  # each once
        assert relays(stack.model) == 0
        breakers = stack.by_name["schedule"][0].dispatcher.breakers
        assert breakers.state(id_, time.monotonic()) == "closed"


async def test_vllm_failing_a_request_with_a_500_is_still_relayed(
    nats_url: str, tmp_path: Path
) -> None:
    """A 5xx is the engine's fault, as before: the attempt is relayed (here to the same,
    only engine) and the client gets its answer."""
    knobs = Knobs(fail_status=500, fail_first=1)
    async with vllm_pipeline(nats_url, tmp_path, knobs) as (stack, fake, _):
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
            resp = await http.post("/v1/completions", json={
                "model": stack.model, "prompt": "hi", "max_tokens": 4})  # fmt: skip
        assert resp.status_code == 200, resp.text
        assert [r.status for r in fake.requests] == [500, 200]
        assert relays(stack.model) == 1
