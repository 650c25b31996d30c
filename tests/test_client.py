"""`tokenway.client` against the real pipeline: OpenAI bodies and token-only requests,
results read live or later, many at once under backpressure, an id never run twice, and
the examples as a user runs them."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TypeVar

import nats
import nats.errors
import pytest

from tests.conftest import Logged, Stack, guarded_bus, make_settings, start_stack
from tests.streams import until
from tokenway import bus
from tokenway.client import Client, Refused, RequestFailed
from tokenway.errors import CannotStart
from tokenway.wire import GenerateRequest, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="session")

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["schedule", "derender", "sim"]
T = TypeVar("T")


def chat(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Fact #{i}?"}], "max_tokens": 6}


def engine_runs(stack: Stack, rid: str) -> int:
    return sum(w.request_id == rid for b in stack.by_name["engine"] for w in b.engine.received)


async def test_an_openai_body_and_a_token_request_run_and_read_back_later(stack: Stack) -> None:
    async with await stack.direct() as tw:
        done = await tw.run(chat(1))
        assert done["object"] == "chat.completion" and done["choices"][0]["message"]["content"]
        params = SamplingParams(max_tokens=5, logprobs=0, seed=2)
        tokens = await tw.run(
            GenerateRequest(request_id="", token_ids=[6366, 33], sampling_params=params,
                            return_token_ids=True), rid="tok-1",
        )  # fmt: skip
        (choice,) = tokens["choices"]
        assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) == 5
        rid = await tw.submit({"prompt": "Later", "max_tokens": 3})
        reply = tw.reply
    # another process, later: the same names find the stored output
    async with await stack.direct(reply=reply) as later:
        assert (await later.result(rid))["usage"]["completion_tokens"] == 3
        assert (await later.result("tok-1"))["choices"] == tokens["choices"]
        with pytest.raises(RequestFailed) as failed:
            await later.run({"messages": [], "max_tokens": 3})
    assert failed.value.status == 400


async def test_many_at_once_each_run_once_even_submitted_again(stack: Stack) -> None:
    named = [(f"many-{i}", chat(i)) for i in range(12)]
    async with await stack.direct() as tw:
        first = {rid: r async for rid, r in tw.submit_many(named, concurrency=4)}
        again = {rid: r async for rid, r in tw.submit_many(named, concurrency=4)}
    assert sorted(first) == sorted(rid for rid, _ in named) and again == first
    assert all(isinstance(r, dict) for r in first.values())
    assert all(engine_runs(stack, rid) == 1 for rid, _ in named)


async def test_a_full_queue_is_waited_out_not_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One message fits each queue: the client waits at the render queue, render at the
    schedule queue, and every request is answered once the schedulers start."""
    caplog.set_level(logging.INFO, logger="workers.render.service")
    held = Logged("waits for room in the schedule queue")
    logging.getLogger("workers.render.service").addHandler(held)
    stacks = []
    try:
        async with guarded_bus(tmp_path / "nats") as own:
            settings = make_settings(tmp_path / "d", queue_max_msgs=1)
            nc = await bus.connect(own.url, "provision", own.role(settings, "provision"))
            await bus.provision_streams(nc.jetstream(), settings)
            await nc.close()
            async with await Client.connect(own.url, "deepseek-v4", **own.client_options()) as tw:
                bodies = [chat(i) for i in range(4)]
                waiting = asyncio.create_task(_collect(tw.submit_many(bodies)))
                await until(tw.waited, lambda: tw.waits > 0)
                stacks.append(await start_stack(own.url, settings, ["render"]))
                async with asyncio.timeout(30):
                    await held.event.wait()  # the schedule queue is full: render holds on
                stacks.append(await start_stack(own.url, settings, STAGES))
                results = await asyncio.wait_for(waiting, 60)
            for stack in stacks:
                await stack.close()
    finally:
        logging.getLogger("workers.render.service").removeHandler(held)
    assert len(results) == 4 and all(isinstance(r, dict) for _, r in results), results


async def _collect(results: AsyncIterator[T]) -> list[T]:
    return [item async for item in results]


@pytest.mark.parametrize("example", ["rl_tokens.py", "batch_many.py"])
async def test_the_examples_run_as_their_docstrings_say(stack: Stack, example: str) -> None:
    """With the environment of the file `up` writes for a tenant's jobs, and nothing else."""
    args = ["--model", stack.model]
    if example == "batch_many.py":
        args += ["--count", "6", "--job", f"example-{os.getpid()}"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "examples" / example), *args, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **stack.bus.env("client-default")},
    )  # fmt: skip
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    lines = out.decode().splitlines()
    assert len(lines) == (4 if example == "rl_tokens.py" else 6), out


async def test_a_client_closed_right_after_a_result_leaves_no_failing_task(stack: Stack) -> None:
    """The read of a result is closed when it is had, not finalized later against a closed
    connection (which failed a task nobody awaited: "Task exception was never retrieved")."""
    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: errors.append(context))
    observer = await nats.connect(stack.observer)
    try:
        before = {c.name for c in await observer.jetstream().consumers_info(bus.OUT_STREAM)}
        async with await stack.direct() as tw:
            assert (await tw.run(chat(7)))["choices"]
        for _ in range(3):  # what closing the client scheduled runs
            await asyncio.sleep(0)
        gc.collect()  # a failed task nobody awaited is reported when it is collected
        after = {c.name for c in await observer.jetstream().consumers_info(bus.OUT_STREAM)}
    finally:
        loop.set_exception_handler(old)
        await observer.close()
    assert not errors, errors
    assert after <= before  # its consumer deleted once the result was had


async def test_a_wait_for_a_result_ends_when_its_reader_cannot_go_on(stack: Stack) -> None:
    """The connection goes: whoever waits for a result hears it, instead of waiting for
    ever on a reader that stopped."""
    tw = await stack.direct()
    async with tw.finished() as finished:
        waiting = asyncio.ensure_future(finished.wait("never-sent"))
        await tw.nc.close()
        with pytest.raises(nats.errors.Error):
            async with asyncio.timeout(30):
                await waiting


async def test_a_client_the_bus_refuses_hears_it_at_once(stack: Stack) -> None:
    """No credentials, or a publish its user may not make (another tenant's lane): an error
    naming the refusal, not a request that waits for ever."""
    with pytest.raises(CannotStart, match="refused this process's credentials"):
        await Client.connect(stack.settings.nats or "", stack.model)
    options = {**stack.bus.client_options("acme"), "tenant": "rival"}
    async with await Client.connect(stack.settings.nats or "", stack.model, **options) as tw:
        for _ in range(2):  # and every call after the first refusal
            with pytest.raises(Refused, match="permissions violation"):
                async with asyncio.timeout(30):
                    await tw.run(chat(1))
