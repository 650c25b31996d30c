"""Chaos: under concurrent streaming load, one fault at a time, caused for real.

Each case runs a stage as OS processes (two of them, or one for the ingress) beside the rest
of the pipeline in-process, streams a load once without a fault, then again while the fault
happens: an engine, a schedule worker, a derender worker or a render worker is SIGKILLed, an
ingress is SIGKILLed and its clients resume on another with `Last-Event-ID`, or the NATS
server (file storage) restarts. Every stream must end with the text of the fault-free run,
consecutive event ids and one [DONE] (or with an explicit error event), and nothing may be
left behind: owned requests, engine capacity or sequences, ingress routes and
subscriptions, consumers. The longest any client waited across the fault is the fault's
recovery time; run with `-s` to see it.
"""

from __future__ import annotations

import asyncio
import re
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import nats
import pytest

from tests.conftest import guarded_bus
from tests.stages import StageProcesses, stage_processes
from tests.streams import Streamed, post, resume, until
from tests.test_cancel import consumer_names
from tests.test_cli import free_port
from tokenway import bus
from tokenway.aio import Signal

pytestmark = pytest.mark.asyncio(loop_scope="session")

STREAMS = 6
TOKENS = 150  # a stream lasts TOKENS × ITL (tests/stages.py)


def load(model: str) -> list[dict]:
    return [
        {
            "model": model,
            "prompt": f"Chaos stream {i}: tell a long story.",
            "stream": True,
            "max_tokens": TOKENS,
            "ignore_eos": True,
            "seed": i,
            "stream_options": {"include_usage": True},
        }
        for i in range(STREAMS)
    ]


async def run_load(
    c: StageProcesses,
    url: str,
    when: Callable[[list[Streamed]], bool] | None = None,
    fault: Callable[[], Awaitable[None]] | None = None,
) -> list[Streamed]:
    """Every stream of the load at once; `fault` once `when` holds."""
    bodies = load(c.stack.model)
    out = [Streamed() for _ in bodies]
    progress = Signal()
    async with httpx.AsyncClient(timeout=120) as http:
        tasks = [
            asyncio.create_task(post(http, url, b, s, progress))
            for b, s in zip(bodies, out, strict=True)
        ]
        if fault is not None and when is not None:
            await until(progress, lambda: when(out))
            await fault()
        await asyncio.gather(*tasks)
        for s in out:
            if s.cut:  # its ingress died: the client comes back to another one
                await resume(http, c.stack.url, s)
    return out


def check(got: list[Streamed], expected: list[Streamed], errors_allowed: bool) -> int:
    """Each stream equals its fault-free run, or ended with an error event; the count of those."""
    failed = 0
    for g, e in zip(got, expected, strict=True):
        assert g.ids == list(range(1, len(g.ids) + 1)), "a gap or a duplicated event"
        assert g.done == 1
        if g.error is not None:
            assert errors_allowed, g.error
            failed += 1
            continue
        assert g.text == e.text and g.usage is not None and e.usage is not None
        # The prompt tokens found cached are the engine's word on the attempt that ended the
        # stream: a relay's engine, which prefilled the prompt before, finds it cached.
        assert _counts(g.usage) == _counts(e.usage)
        assert g.usage["prompt_tokens_details"]["cached_tokens"] <= g.usage["prompt_tokens"]
        assert g.usage["completion_tokens"] == TOKENS
    return failed


def _counts(usage: dict) -> dict:
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}


async def nothing_left(c: StageProcesses, consumers: set[str]) -> None:
    """No owned request, engine capacity or sequence, route or consumer left behind, in
    this process and (through the bus) in the stage processes."""
    stack = c.stack
    async with asyncio.timeout(15):
        for schedule in stack.by_name.get("schedule", []):
            await schedule.empty.wait()
            assert not schedule.dispatcher.seqs and not schedule.dispatcher.tokens
        for bridge in stack.by_name.get("engine", []):
            await bridge.idle.wait()
        await stack.ingress.router.idle.wait()
        registry = stack.ingress.registry
        while True:  # engines report their running sequences with every heartbeat
            changed = registry.changed.waiter()
            if all(e.running == 0 for e in registry.alive()):
                break
            await changed.wait()
    assert all(not b.tasks for b in stack.by_name.get("engine", []))
    assert not stack.ingress.router.slots
    # none added: one another test left may expire meanwhile (a ledger reader's)
    assert await consumer_names(stack.observer) <= consumers
    nc = await nats.connect(servers=bus.seeds(stack.observer))
    try:
        js = nc.jetstream()
        model = stack.model
        for spec in (bus.render_consumer(stack.settings, model),
                     bus.sched_consumer(stack.settings, model)):  # fmt: skip
            info = await js.consumer_info(spec.stream, spec.durable)
            assert (info.num_pending, info.num_ack_pending) == (0, 0), spec.durable
    finally:
        await nc.close()


def report(
    fault: str, got: list[Streamed], baseline: list[Streamed], failed: int, also: str = ""
) -> None:
    normal = max(s.longest_wait for s in baseline)
    waited = max(s.longest_wait for s in got)
    print(
        f"\nchaos {fault}: longest client wait {waited:.2f} s (fault-free {normal:.2f} s){also}, "
        f"{len(got) - failed}/{len(got)} streams completed, {failed} explicit errors"
    )


def started(n: int) -> Callable[[list[Streamed]], bool]:
    return lambda streams: all(len(s.times) >= n for s in streams)


@pytest.mark.parametrize("stage", ["engine", "schedule", "derender", "render"])
async def test_killing_a_worker_process_loses_nothing(
    nats_url: str, tmp_path: Path, stage: str
) -> None:
    async with stage_processes(nats_url, tmp_path, stage, processes=2) as c:
        consumers = await consumer_names(nats_url)
        expected = await run_load(c, c.url)
        doomed = c.procs[0]

        async def kill() -> None:
            doomed.send_signal(signal.SIGKILL)

        # Render works before the first token: its fault comes while requests are rendered.
        when = (lambda streams: True) if stage == "render" else started(5)
        got = await run_load(c, c.url, when, kill)
        failed = check(got, expected, errors_allowed=False)
        report(stage, got, expected, failed)
        await nothing_left(c, consumers)


async def test_killing_the_clients_ingress_then_resuming_elsewhere_loses_nothing(
    nats_url: str, tmp_path: Path
) -> None:
    async with stage_processes(nats_url, tmp_path, "ingress", processes=1) as c:
        consumers = await consumer_names(nats_url)
        expected = await run_load(c, c.stack.url)
        (doomed,) = c.procs

        async def kill() -> None:
            doomed.send_signal(signal.SIGKILL)  # no cancel goes out: the owners go on

        got = await run_load(c, c.url, started(5), kill)
        assert all(s.rid for s in got)
        failed = check(got, expected, errors_allowed=False)
        report("ingress", got, expected, failed)
        await nothing_left(c, consumers)


async def test_restarting_the_nats_server_mid_stream_loses_nothing_silently(
    tmp_path: Path,
) -> None:
    """The server stops and starts again on the same port and file store while every stream
    runs: core NATS messages in flight are lost, connections reconnect, streams and
    consumers come back from disk. Every stream completes, or ends with an explicit error."""
    async with guarded_bus(tmp_path / "nats", port=free_port()) as server:
        assert server.natsd is not None
        natsd = server.natsd
        async with stage_processes(server.url, tmp_path, "engine", processes=2) as c:
            expected = await run_load(c, c.url)

            async def restart() -> None:
                await asyncio.to_thread(natsd.stop)
                await natsd.start()

            got = await run_load(c, c.url, started(5), restart)
            failed = check(got, expected, errors_allowed=True)
            report("nats", got, expected, failed)
            await nothing_left(c, await consumer_names(server.watch))
            async with httpx.AsyncClient() as http:  # the ingress counted losing NATS
                page = (await http.get(f"{c.url}/metrics")).text
            lost = re.search(r'^tokenway_bus_errors_total\{stage="ingress"\} (\S+)$', page, re.M)
            assert lost is not None and float(lost.group(1)) >= 1, page


async def test_a_stopping_schedule_worker_hands_its_requests_to_a_peer_at_once(
    nats_url: str, tmp_path: Path
) -> None:
    """SIGTERM with no drain time left: what the worker owns goes to its peer at once (a
    NAK), not after the owner's ack wait, here far longer than the clients would wait."""
    async with stage_processes(nats_url, tmp_path, "schedule", processes=0) as c:
        slow = ["--owner-ack-wait", "300", "--drain-timeout", "0"]
        doomed, _ = await asyncio.gather(c.spawn("schedule", *slow), c.spawn("schedule", *slow))
        consumers = await consumer_names(nats_url)
        expected = await run_load(c, c.url)

        async def term() -> None:
            doomed.send_signal(signal.SIGTERM)

        async with asyncio.timeout(60):
            got = await run_load(c, c.url, started(5), term)
            assert await doomed.wait() == 0
        assert doomed.stderr is not None
        said = (await doomed.stderr.read()).decode()
        assert re.search(r"draining: [1-9]\d* requests", said), said  # it had some to hand over
        failed = check(got, expected, errors_allowed=False)
        report("schedule SIGTERM", got, expected, failed)
        await nothing_left(c, consumers)
