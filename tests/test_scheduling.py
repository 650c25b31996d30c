"""Scheduling against real engine bridges on a real bus: P/D handoff, faults, deadlines,
and a hundred cancellations that leave nothing behind."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import nats
import openai
import pytest
from tokenizers import Tokenizer

from engines.bridge import Bridge
from engines.sim import SimConfig, SimEngine
from tests.conftest import Stack, make_settings, recording, start_stack, wait_engines
from tokenway import bus
from tokenway import headers as h
from tokenway.config import Settings

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHAT = [{"role": "user", "content": "Plan the trip."}]


@contextlib.asynccontextmanager
async def pipeline(
    nats_url: str, data: Path, engines: list[SimConfig], **settings: object
) -> AsyncIterator[tuple[Stack, list[SimEngine]]]:
    """The stages plus simulated engines built from `engines` (roles, fault knobs), serving
    a model name of their own so that no other test's engine can take their requests."""
    model = f"model-{data.name}"
    s: Settings = make_settings(data, served_model_name=model, **settings)
    stack = await start_stack(nats_url, s, ["ingress", "render", "schedule", "derender"])
    tokenizer = Tokenizer.from_file(str(stack.ingress.models[0].info.path / "tokenizer.json"))
    sims = [recording(SimEngine(dataclasses.replace(c, model=model), tokenizer)) for c in engines]
    bridges = [Bridge(stack.role("engine"), sim) for sim in sims]
    stack.by_name["engine"] = bridges
    stop = asyncio.Event()
    tasks = [asyncio.create_task(b.run(stack.settings.nats, stop)) for b in bridges]
    try:
        await wait_engines(stack.ingress.registry, len(sims))
        await wait_engines(stack.by_name["schedule"][0].registry, len(sims))
        yield stack, sims
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        await stack.close()


def sim(id: str, role: str = "union", **knobs: object) -> SimConfig:
    return SimConfig(id=id, model="deepseek-v4", eos_token_id=1, role=role, ttft=0, itl=0.001,
                     output_len=30, **knobs)  # type: ignore[arg-type]  # fmt: skip


def client(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="-", max_retries=0)


def model(stack: Stack) -> str:
    return stack.model


async def test_pd_handoff_passes_the_prefill_kv_params_to_the_decode_leg(
    nats_url: str, tmp_path: Path
) -> None:
    engines = [sim("pre-0", "prefill"), sim("dec-0", "decode")]
    async with pipeline(nats_url, tmp_path, engines) as (stack, (prefill, decode)):
        resp = await client(stack).chat.completions.create(
            model=model(stack), messages=CHAT, max_tokens=12
        )
        assert resp.choices[0].message.content
        assert [w.kv_transfer_params for w in prefill.received] == [{"do_remote_decode": True}]
        [handed] = [w.kv_transfer_params for w in decode.received]
        assert handed is not None and handed["do_remote_prefill"] is True
        assert handed["remote_engine_id"] == "pre-0"


async def test_a_generate_request_runs_split_over_a_pd_pair_with_its_token_ids(
    nats_url: str, tmp_path: Path
) -> None:
    """vLLM's token-in/token-out route gets the pool's P/D split like any request: the
    prefill leg's KV parameters reach the decode leg, the client gets the decode leg's
    token IDs and none of the prefill's."""
    engines = [sim("pre-g", "prefill"), sim("dec-g", "decode")]
    async with pipeline(nats_url, tmp_path, engines) as (stack, (prefill, decode)):
        body = {"token_ids": [6366, 33, 1201], "sampling_params": {"max_tokens": 12}}
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
            resp = await http.post("/inference/v1/generate", json=body)
        assert resp.status_code == 200, resp.text
        (choice,) = resp.json()["choices"]
        assert len(choice["token_ids"]) == 12 and choice["finish_reason"] == "length"
        assert [w.kv_transfer_params for w in prefill.received] == [{"do_remote_decode": True}]
        [work] = decode.received
        assert work.kv_transfer_params is not None and work.token_ids == [6366, 33, 1201]


async def test_a_failing_prefill_ends_in_a_clear_error_not_a_hang(
    nats_url: str, tmp_path: Path
) -> None:
    engines = [sim("pre-1", "prefill", fail_first=1), sim("dec-1", "decode")]
    async with pipeline(nats_url, tmp_path, engines) as (stack, (prefill, decode)):
        resp = await client(stack).chat.completions.create(
            model=model(stack), messages=CHAT, max_tokens=8
        )
        # The prefill leg failed; the decode engine then served the request by itself.
        assert resp.choices[0].message.content
        assert prefill.started == 1 and [w.kv_transfer_params for w in decode.received] == [None]


async def test_without_a_pd_pair_a_union_engine_serves(nats_url: str, tmp_path: Path) -> None:
    engines = [sim("pre-2", "prefill"), sim("uni-2")]
    async with pipeline(nats_url, tmp_path, engines) as (stack, (prefill, union)):
        resp = await client(stack).completions.create(model=model(stack), prompt="hi", max_tokens=5)
        assert resp.choices[0].text and prefill.started == 0 and union.started == 1


async def test_an_engine_error_reaches_the_client_as_an_error(
    nats_url: str, tmp_path: Path
) -> None:
    async with pipeline(nats_url, tmp_path, [sim("bad-3", fail_first=5)], breaker_threshold=10) as (
        stack,
        _,
    ):
        with pytest.raises(openai.APIStatusError) as info:
            await client(stack).completions.create(model=model(stack), prompt="x", max_tokens=5)
        assert info.value.status_code == 502
        assert "simulated failure" in str(info.value)


async def test_a_request_past_its_deadline_ends_with_a_timeout_error(
    nats_url: str, tmp_path: Path
) -> None:
    stalls = [sim("stall-4", stall_after=2)]
    async with pipeline(nats_url, tmp_path, stalls, request_timeout=1.0) as (stack, (engine,)):
        async with httpx.AsyncClient(timeout=30) as http:
            body = {"prompt": "wait", "max_tokens": 50, "stream": True, "ignore_eos": True}
            async with http.stream("POST", f"{stack.url}/v1/completions", json=body) as resp:
                raw = b"".join([part async for part in resp.aiter_bytes()]).decode()
        assert '"TimeoutError"' in raw and "deadline" in raw
        assert raw.endswith("data: [DONE]\n\n")
        async with asyncio.timeout(10):
            await stack.by_name["schedule"][0].empty.wait()
            await stack.by_name["engine"][0].idle.wait()  # the abort is a message to the bridge
        assert engine.running == 0


async def test_a_hundred_cancelled_streams_leave_nothing_behind(stack: Stack) -> None:
    schedule = stack.by_name["schedule"][0]
    engines = stack.by_name["engine"]
    router = stack.ingress.router
    # One request first: clients create some subscriptions lazily on first use.
    await client(stack).completions.create(model="deepseek-v4", prompt="warm", max_tokens=2)
    async with asyncio.timeout(30):
        await schedule.empty.wait()
    subs_before = len(router.nc._subs), len(schedule._nc._subs)

    async def leave_after_first_chunk(http: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": f"story {i}", "max_tokens": 100_000, "ignore_eos": True, "stream": True}
        async with http.stream("POST", f"{stack.url}/v1/completions", json=body) as resp:
            async for _ in resp.aiter_bytes():
                break

    limits = httpx.Limits(max_connections=100)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        await asyncio.gather(*(leave_after_first_chunk(http, i) for i in range(100)))
    async with asyncio.timeout(30):
        await schedule.empty.wait()
        for bridge in engines:
            await bridge.idle.wait()
        await router.idle.wait()
    assert not schedule.requests and not schedule.dispatcher.seqs
    assert not schedule.dispatcher.tokens
    assert all(b.engine.running == 0 and not b.tasks for b in engines)
    assert (len(router.nc._subs), len(schedule._nc._subs)) == subs_before
    per_request = {"ScheduleService._own", "ScheduleService._derender_and_commit", "Bridge._run"}
    left = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ in per_request]
    assert not left, left


async def test_a_cancelled_request_delivered_again_is_not_run_again(stack: Stack) -> None:
    """JetStream delivers a request again when its owner's ack came late (a loop busy past
    the ack wait): once its client has left, no delivery may run it again for nobody."""
    schedule = stack.by_name["schedule"][0]
    nc, rid = await nats.connect(stack.observer), ""
    try:
        seen = await nc.subscribe(bus.sched_subject(stack.model))
        body = {"prompt": "An endless tale", "max_tokens": 100_000, "ignore_eos": True,
                "stream": True}  # fmt: skip
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", f"{stack.url}/v1/completions", json=body) as resp:
                async for _ in resp.aiter_bytes():
                    break
        first = await seen.next_msg(timeout=10)
        rid = first.headers[h.RID]
        async with asyncio.timeout(30):
            await schedule.empty.wait()
        js = nc.jetstream()
        again = {**first.headers, h.MSG_ID: f"{rid}:delivered-again"}
        ack = await js.publish(first.subject, first.data, headers=again)
        consumer = bus.sched_consumer(stack.settings, stack.model).durable
        async with asyncio.timeout(30):  # until the worker has taken its decision on it
            while True:
                info = await js.consumer_info(bus.SCHED_STREAM, consumer)
                if schedule.owned(first.headers[h.REPLY], rid) is not None:
                    break
                if info.delivered.stream_seq >= ack.seq and info.num_ack_pending == 0:
                    break
                await asyncio.sleep(0.05)
        assert schedule.owned(first.headers[h.REPLY], rid) is None
    finally:
        if rid:  # a request run again must not outlive the test
            await nc.publish(bus.cancel_subject(first.headers[h.REPLY], rid), b"")
        await nc.close()


async def test_shared_prefix_requests_stick_to_one_engine_while_load_allows(
    nats_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="workers.schedule")
    engines = [sim("aff-a"), sim("aff-b"), sim("aff-c")]
    system = "You are a meticulous travel planner. " * 40  # a long shared system prompt
    async with pipeline(nats_url, tmp_path, engines) as (stack, sims):
        for i in range(6):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": f"#{i}"}]
            await client(stack).chat.completions.create(
                model=model(stack), messages=messages, max_tokens=3
            )
        assert sorted(s.started for s in sims) == [0, 0, 6]
    routed = [r.getMessage() for r in caplog.records if " → " in r.getMessage()]
    assert len(routed) == 6 and "overlap 0/" in routed[0], routed
    # every later request found the system prompt's blocks where the first one ran
    assert all(re.search(r"→ engine aff-\w \(overlap [1-9]\d*/", m) for m in routed[1:]), routed
    ended = [r.getMessage() for r in caplog.records if " ended: " in r.getMessage()]
    line = re.compile(r"request \w+ ended: model \S+, engine aff-\w, \d+ prompt \+ 3 output "
                      r"tokens, ttft \d+\.\d{3}s, \d+\.\d{3}s, length$")  # fmt: skip
    assert len(ended) == 6 and all(line.match(m) for m in ended), ended


async def test_an_engine_that_keeps_failing_is_taken_out_of_rotation(
    nats_url: str, tmp_path: Path
) -> None:
    engines = [sim("brk-a", fail_first=100), sim("brk-b")]
    async with pipeline(nats_url, tmp_path, engines, breaker_threshold=2) as (stack, sims):
        bad, good = sims
        outcomes = []
        for i in range(6):
            try:
                await client(stack).completions.create(
                    model=model(stack), prompt=f"p{i}", max_tokens=3
                )
                outcomes.append("ok")
            except openai.APIStatusError as exc:
                outcomes.append(exc.status_code)
        assert bad.started == 2  # then its breaker opened: no third request reached it
        # The two it failed went on to the good engine: nothing had been committed yet.
        assert outcomes == ["ok"] * 6
        assert good.started == 6
