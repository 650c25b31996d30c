"""Deliberate stops: an ingress exits at once on SIGTERM when it has no open stream, a
draining schedule worker hands its streams to a peer without waiting for anything to expire
and says so, and an engine that stops on purpose is told apart from one that went silent."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import msgspec
import nats
import pytest
from nats.aio.msg import Msg

from tests.conftest import Stack, make_settings, provisioned_bus, start_stack, wait_engines
from tests.streams import Streamed, read, until
from tests.test_cli import free_port, logged, spawn
from tokenway import bus
from tokenway.aio import Signal
from tokenway.wire import HandOver
from workers.schedule import service as schedule_service

pytestmark = pytest.mark.asyncio(loop_scope="session")

# nats-py waits 30 s (its drain_timeout) for a subscription that cannot drain before it
# gives up with a DrainTimeoutError: an exit that waits for less than that either drained
# everything or was never held up. A prompt exit takes well under a second.
BELOW_THE_DRAIN_HANG = 15.0

# Heartbeats one every 200 s (a third of the TTL): an entry no stall of the machine expires.
SLOW_BEATS_TTL = 600.0


async def test_an_ingress_a_resumed_client_left_exits_on_sigterm_without_a_drain_timeout(
    stack: Stack, tmp_path: Path
) -> None:
    """A client resumes a running stream on an ingress process, reads a little and leaves
    (the ingress has no open stream then); the ledger it was reading must not stay
    subscribed, or the connection's drain waits for what nobody reads any more."""
    port = free_port()
    proc = await spawn("ingress", "--data-dir", str(tmp_path), "--port", str(port),
                       env={**stack.bus.env("ingress"), "TOKENWAY_LOG_LEVEL": "info"})  # fmt: skip
    await logged(proc, b"listening on")
    body = {"model": stack.model, "prompt": "Count:", "max_tokens": 3000, "ignore_eos": True,
            "stream": True}  # fmt: skip
    async with httpx.AsyncClient(timeout=30) as http:
        async with http.stream("POST", f"{stack.url}/v1/completions", json=body) as running:
            assert running.status_code == 200
            rid = running.headers["x-tokenway-stream-id"]
            resume = f"http://127.0.0.1:{port}/v1/streams/{rid}"
            async with http.stream("GET", resume) as resumed:
                assert resumed.status_code == 200
                assert (await anext(resumed.aiter_bytes())).startswith(b"data: ")
    proc.send_signal(signal.SIGTERM)
    async with asyncio.timeout(BELOW_THE_DRAIN_HANG):
        _, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()[-2000:]
    assert b"DrainTimeoutError" not in err, err.decode()[-2000:]


def story(model: str, tokens: int) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Tell a long story."}],
            "stream": True, "max_tokens": tokens, "ignore_eos": True}  # fmt: skip


async def chat(http: httpx.AsyncClient, url: str, body: dict, out: Streamed,
               progress: Signal) -> Streamed:  # fmt: skip
    out.started = time.monotonic()
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200, (await resp.aread()).decode()
        await read(resp, out, progress)
    return out


async def streamed_across(
    front: Stack,
    swap: Callable[[], Awaitable[None]],
    tokens: int,
    streams: int = 1,
    within: float | None = None,
) -> list[Streamed]:
    """`streams` chat streams of `tokens` through `front`, `swap` run once each has its first
    chunks, then each read to its end (within `within` seconds where given)."""
    outs, progress = [Streamed() for _ in range(streams)], Signal()
    async with httpx.AsyncClient(timeout=60) as http:
        streaming = [
            asyncio.create_task(chat(http, front.url, story(front.model, tokens), o, progress))
            for o in outs
        ]
        try:
            await until(progress, lambda: all(len(o.times) >= 3 for o in outs))
            await swap()
            async with asyncio.timeout(within):
                await asyncio.gather(*streaming)
        finally:
            for task in streaming:
                task.cancel()
    return outs


async def test_an_engine_that_stops_on_purpose_is_logged_as_left_not_as_silent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine running a stream stops gracefully: its owner relays the stream to another
    engine and says the engine left (stopped), not that it stopped heartbeating (what a
    lost engine is told by). On a bus of its own whose entries outlive any stall of a
    loaded machine: under the session's 3 s TTL, a loop held up that long let the entry
    expire first, and an engine silent for a TTL is rightly told lost."""
    caplog.set_level(logging.INFO)
    async with provisioned_bus(tmp_path / "bus", engine_ttl=SLOW_BEATS_TTL) as own:
        settings = make_settings(tmp_path, served_model_name=f"leave-{uuid.uuid4().hex[:8]}",
                                 engine_ttl=SLOW_BEATS_TTL, sim_itl=0.01)  # fmt: skip
        front = await start_stack(own.url, settings, ["ingress", "render", "schedule"])
        first = await start_stack(own.url, settings, ["sim"])
        await wait_engines(front.ingress.registry, 1)
        second = None

        async def swap() -> None:
            nonlocal second
            second = await start_stack(own.url, settings, ["sim"])
            await wait_engines(front.ingress.registry, 2)
            await first.close()

        try:
            (out,) = await streamed_across(front, swap, 400)
        finally:
            for stack in (second, front):
                if stack is not None:
                    await stack.close()
    assert out.done == 1 and '"error"' not in out.raw.decode()
    gone = first.by_name["engine"][0].id
    said = [r.getMessage() for r in caplog.records if gone in r.getMessage()]
    assert any(f"engine {gone} left (stopped)" in line for line in said), said
    assert not any("stopped heartbeating" in line for line in said), said


async def test_a_draining_schedule_worker_hands_its_stream_to_a_peer_and_says_so(
    nats_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A schedule worker owning a chat stream stops with nothing left of its drain: it hands
    the stream back to TW_SCHED and a peer takes it over where the hand-over says it stands,
    without reading its ledger back message by message (what made a long stream stall for
    seconds); the client sees one unbroken stream. The stopping worker says how many it
    handed over, then that it stopped (it said nothing of either)."""
    caplog.set_level(logging.INFO)
    settings = make_settings(tmp_path, served_model_name=f"hand-{uuid.uuid4().hex[:8]}",
                             sim_itl=0.01, drain_timeout=0)  # fmt: skip
    front = await start_stack(nats_url, settings, ["ingress", "render", "sim"])
    first = await start_stack(nats_url, settings, ["schedule"])
    peer = None

    async def swap() -> None:
        nonlocal peer
        peer = await start_stack(nats_url, settings, ["schedule"])
        await peer.by_name["schedule"][0].started.wait()
        await first.close()

    try:
        (out,) = await streamed_across(front, swap, 300)
    finally:
        for stack in (peer, front):
            if stack is not None:
                await stack.close()
    assert out.done == 1 and '"error"' not in out.raw.decode()
    owner = first.by_name["schedule"][0].owner_id
    said = [r.getMessage() for r in caplog.records]
    handed = f"schedule {owner} handed 1 request back to TW_SCHED"
    taken = next(i for i, line in enumerate(said) if "taken over" in line)
    assert any(line.startswith(handed) for line in said[:taken]), said
    assert "taken over as its last owner handed it over" in said[taken], said[taken]
    assert f"schedule {owner} stopped: 1 request handed over" in said, said


async def test_a_hand_over_onto_a_full_engine_relays_without_waiting_for_its_next_beat(
    tmp_path: Path,
) -> None:
    """Two streams fill an engine of two sequences; their schedule worker stops and hands
    them over. The engine's last beat said it was full, so the peer relays them only once
    it hears of the room the hand-over's aborts made: the engine says so at once, not at
    its next beat. With beats 200 s apart, streams that waited for one would not end within
    the 30 s allowed here (they end in about 3 s)."""
    async with provisioned_bus(tmp_path / "bus", engine_ttl=SLOW_BEATS_TTL) as own:
        settings = make_settings(tmp_path, served_model_name=f"full-{uuid.uuid4().hex[:8]}",
                                 engine_ttl=SLOW_BEATS_TTL, sim_max_seqs=2, sim_itl=0.01,
                                 drain_timeout=0)  # fmt: skip
        front = await start_stack(own.url, settings, ["ingress", "render", "sim"])
        first = await start_stack(own.url, settings, ["schedule"])
        peer = None

        async def swap() -> None:
            nonlocal peer
            peer = await start_stack(own.url, settings, ["schedule"])
            schedule = peer.by_name["schedule"][0]
            await schedule.started.wait()
            # The beat the engine gives at most every 200 s, given now: it is full.
            bridge = front.by_name["engine"][0]
            nc = await nats.connect(own.watch)
            kv = await bus.engines_kv(nc.jetstream(), settings)
            beat = bridge.info()
            beat.updated = time.time()
            assert beat.running == beat.max_seqs == 2
            await kv.put(bus.token(bridge.id), msgspec.msgpack.encode(beat))
            await nc.close()
            await until(schedule.registry.changed,
                        lambda: schedule.registry.engines[bridge.id].running == 2)  # fmt: skip
            await first.close()  # hands both streams over at once

        try:
            outs = await streamed_across(front, swap, 300, streams=2, within=30)
        finally:
            for stack in (peer, front):
                if stack is not None:
                    await stack.close()
    for out in outs:
        assert out.done == 1 and '"error"' not in out.raw.decode(), out.raw[-300:]


async def test_the_hand_overs_an_owner_keeps_for_its_peers_are_bounded_by_their_tokens(
    nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every owner of a model hears every hand-over, and only one takes each: what the others
    keep is bounded by the committed tokens it holds, the oldest forgotten first (its taker
    reads the ledger back instead)."""
    monkeypatch.setattr(schedule_service, "_HANDOVER_TOKENS", 1000)
    settings = make_settings(tmp_path, served_model_name=f"kept-{uuid.uuid4().hex[:8]}")
    stack = await start_stack(nats_url, settings, ["schedule"])
    try:
        owner = stack.by_name["schedule"][0]
        await owner.started.wait()
        for n in range(5):
            handed = HandOver(key=f"k{n}", index_seq=n + 1, out_seq=400, attempt=0,
                              tokens=list(range(400)))  # fmt: skip
            await owner._on_handover(Msg(_client=None, data=msgspec.msgpack.encode(handed)))
        assert list(owner._handovers) == ["k3", "k4"]
        assert owner._handover_tokens == 800
    finally:
        await stack.close()
