"""W3C Trace Context: the client's `traceparent` (or a new one) rides every hop to the
engine's generate call, the bus included."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio
from tokenizers import Tokenizer

from engines.bridge import Bridge
from engines.vllm_http import VllmEndpoint, VllmEngine
from tests.conftest import Stack, make_settings, resolve_model, start_stack, wait_engines
from tests.fakes.otlp import Collector
from tests.fakes.vllm_engine import FakeVllm, Knobs
from tokenway import spans

pytestmark = pytest.mark.asyncio(loop_scope="session")

CLIENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
VALID = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def traced(
    nats_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[Stack, FakeVllm]]:
    """The pipeline in front of one fake vLLM that records every call's headers."""
    tmp_path = tmp_path_factory.mktemp("trace")
    settings = make_settings(tmp_path, served_model_name=f"trace-{tmp_path.name}")
    resolved, served = resolve_model(settings)
    tokenizer = Tokenizer.from_file(str(resolved.path / "tokenizer.json"))
    fake = FakeVllm.for_tokenizer(tokenizer, resolved.eos_token_ids[0], Knobs(itl=0.001))
    stack = await start_stack(nats_url, settings, ["ingress", "render", "schedule"])
    stop = asyncio.Event()
    await fake.__aenter__()
    engine = VllmEngine(VllmEndpoint(url=fake.url, id="trace-0", model=served, max_seqs=8))
    bridged = Bridge(stack.role("engine"), engine)
    bridge = asyncio.create_task(bridged.run(stack.settings.nats, stop))
    try:
        await wait_engines(stack.by_name["schedule"][0].registry, 1)
        yield stack, fake
    finally:
        stop.set()
        await bridge
        await engine.aclose()
        await fake.__aexit__(None, None, None)
        await stack.close()


async def complete(stack: Stack, headers: dict[str, str], prompt: str | list[str]) -> None:
    body = {"model": stack.settings.served_model_name, "prompt": prompt, "max_tokens": 3}
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
        resp = await http.post("/v1/completions", headers=headers, json=body)
    assert resp.status_code == 200, resp.text


async def test_the_clients_traceparent_reaches_the_engine(
    traced: tuple[Stack, FakeVllm],
) -> None:
    stack, fake = traced
    before = len(fake.requests)
    await complete(stack, {"traceparent": CLIENT}, "hi")
    await complete(stack, {"traceparent": CLIENT}, ["one", "two"])  # each prompt on its own
    sent = [r.headers.get("traceparent") for r in fake.requests[before:]]
    assert sent == [CLIENT] * 3


@pytest.mark.parametrize(
    "given",
    [None, "garbage", "00-00000000000000000000000000000000-00f067aa0ba902b7-01"],
    ids=["none", "malformed", "zero-trace"],
)
async def test_without_a_valid_one_each_request_starts_its_own_trace(
    traced: tuple[Stack, FakeVllm], given: str | None
) -> None:
    stack, fake = traced
    before = len(fake.requests)
    headers = {} if given is None else {"traceparent": given}
    await complete(stack, headers, "hi")
    await complete(stack, headers, "hi")
    sent = [r.headers.get("traceparent", "") for r in fake.requests[before:]]
    assert len(sent) == 2 and all(VALID.fullmatch(t) for t in sent), sent
    assert sent[0] != sent[1] and given not in sent


async def test_with_an_otlp_endpoint_each_stage_exports_its_span_of_the_request(
    traced: tuple[Stack, FakeVllm],
) -> None:
    stack, fake = traced
    before = len(fake.requests)
    async with Collector() as collector:
        spans.configure(collector.url)
        try:
            await complete(stack, {"traceparent": CLIENT}, "hi")
            await stack.by_name["schedule"][0].empty.wait()  # the owner's span has ended
        finally:
            await asyncio.to_thread(spans.shutdown)  # exports what is batched, then off
        found = await collector.until(4, CLIENT.split("-")[1])
    by_name = {s.name: s for s in found}
    assert set(by_name) == {"POST /v1/completions", "render", "schedule", "generate"}
    ingress, owner, attempt = (
        by_name["POST /v1/completions"],
        by_name["schedule"],
        by_name["generate"],
    )
    assert (ingress.parent, ingress.kind) == (CLIENT.split("-")[2], 2)  # the client's child
    assert by_name["render"].parent == owner.parent == ingress.span_id
    assert (attempt.parent, attempt.kind) == (owner.span_id, 3)
    # vLLM's own spans join under the bridge's call
    (call,) = fake.requests[before:]
    assert call.headers["traceparent"].split("-")[2] == attempt.span_id
    rid = ingress.attributes["tokenway.request_id"]
    assert all(s.attributes["tokenway.request_id"] == rid for s in found)
    assert ingress.attributes["tokenway.status"] == 200 and not any(s.error for s in found)
    assert owner.attributes["tokenway.engine"] == "trace-0"
    assert owner.attributes["tokenway.output_tokens"] == 3
    assert owner.events == ["dispatched → " + owner.events[0].split("→ ", 1)[1], "first token"]
    assert {s.service for s in found} == {"tokenway"}
    # off again: the context travels on untouched
    await complete(stack, {"traceparent": CLIENT}, "hi")
    assert fake.requests[-1].headers["traceparent"] == CLIENT
