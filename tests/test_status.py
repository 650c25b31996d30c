"""`tokenway status`: what an operator reads of a running deployment, from NATS alone."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import msgspec
import nats
import pytest

from tests.conftest import Stack, dead_letter_one
from tests.test_cli import spawn
from tokenway import bus
from tokenway.wire import EngineInfo

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def status(stack: Stack, *flags: str) -> tuple[int, str, str]:
    """`tokenway status` run as an operator runs it: with the `ops` role's env file."""
    proc = await spawn("status", *flags, env=stack.bus.env("ops"))
    out, err = await proc.communicate()
    return proc.returncode or 0, out.decode(), err.decode()


async def test_status_shows_engines_queues_dead_letters_and_streams(stack: Stack) -> None:
    await dead_letter_one(stack.observer)
    code, out, err = await status(stack, "--json")
    assert code == 0, err
    doc = json.loads(out)
    ours = {bridge.id for bridge in stack.by_name["engine"]}
    engines = {e["id"]: e for e in doc["engines"] if e["id"] in ours}
    assert set(engines) == ours
    assert all(e["alive"] and e["max_seqs"] > 0 and e["role"] == "union" for e in engines.values())
    streams = {s["name"]: s for s in doc["streams"]}
    assert set(streams) >= {bus.RENDER_STREAM, bus.SCHED_STREAM, bus.OUT_STREAM, bus.DLQ_STREAM}
    # A lone server: every stream has the one replica it can (nothing below it to flag).
    assert {s["replicas"] for s in streams.values()} == {1} and doc["replicas_default"] == 1
    assert not any(s["replicas_low"] for s in streams.values())
    queues = {c["name"] for s in streams.values() for c in s["consumers"]}
    assert {"render-deepseek-v4", "schedule-deepseek-v4"} <= queues
    assert doc["dead_letters"]["render"] >= 1 and doc["missing"] == []
    code, text, err = await status(stack)
    assert code == 0, err
    for heading in ("engines", "queues", "dead letters", "batches", "streams"):
        assert f"\n{heading}\n" in f"\n{text}"
    assert "render-deepseek-v4" in text and "TW_OUT" in text
    assert "R1" in text.split("\nstreams\n")[1] and "below the cluster" not in text


async def test_status_shows_what_each_owner_holds(stack: Stack) -> None:
    body = {"model": stack.model, "prompt": "Count to a million:", "max_tokens": 100_000,
            "ignore_eos": True, "stream": True}  # fmt: skip
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
        async with http.stream("POST", "/v1/completions", json=body) as running:
            assert running.status_code == 200
            lines = running.aiter_lines()  # kept: a dropped one closes the stream
            assert (await anext(lines)).startswith("data: ")  # it runs on an engine
            code, out, err = await status(stack, "--json")
            _, text, _ = await status(stack)
    assert code == 0, err
    owners = {o["id"]: o for o in json.loads(out)["owners"]}
    ours = {owner.owner_id for owner in stack.by_name["schedule"]}
    assert set(owners) >= ours
    holding = [owners[i] for i in ours if owners[i]["owned"]]
    assert len(holding) == 1 and holding[0]["running"] == 1, owners
    assert holding[0]["model"] == stack.model and holding[0]["tenants"] == {"": 1}
    assert "\nowners\n" in text and f"{holding[0]['id']}" in text


async def test_status_shows_the_batches_that_run(stack: Stack) -> None:
    line = {"custom_id": "long", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": "On and on", "max_tokens": 100_000, "ignore_eos": True}}  # fmt: skip
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
        up = await http.post("/v1/files", data={"purpose": "batch"},
                             files={"file": ("s.jsonl", json.dumps(line).encode())})  # fmt: skip
        made = await http.post("/v1/batches", json={
            "input_file_id": up.json()["id"], "endpoint": "/v1/completions",
            "completion_window": "24h"})  # fmt: skip
        batch_id = made.json()["id"]
        try:
            async with asyncio.timeout(30):  # until its one line runs
                while not stack.by_name["schedule"][0].requests:  # noqa: ASYNC110 - the runner's
                    await asyncio.sleep(0.05)
            code, out, err = await status(stack, "--json")
            _, text, _ = await status(stack)
        finally:
            await http.post(f"/v1/batches/{batch_id}/cancel")
    assert code == 0, err
    (run,) = [b for b in json.loads(out)["batches"] if b["id"] == batch_id]
    assert run["status"] == "in_progress" and run["total"] == 1 and run["runner"]
    assert "\nbatches\n" in text and batch_id in text


async def test_status_without_nats_says_how() -> None:
    proc = await spawn("status")
    _, err = await proc.communicate()
    assert proc.returncode == 1 and "status: no NATS server to join; pass --nats" in err.decode()


@pytest.mark.parametrize("command", [["status"], ["dlq", "ls"]])
async def test_a_command_against_an_unreachable_nats_fails_at_once(command: list[str]) -> None:
    """It used to retry for ever (nats-py's default without reconnects)."""
    proc = await spawn(*command, "--nats", "nats://127.0.0.1:1")
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1 and "cannot connect to NATS" in err.decode()
    assert "Traceback" not in err.decode()


async def test_an_engine_beating_while_status_reads_the_registry_is_listed(
    stack: Stack,
) -> None:
    """Heartbeats replace an engine's entry every third of a TTL. Listing the bucket's keys
    with a watch could come back without an entry replaced while the watch started (a
    status in CI once showed no engines); the listing is the server's own, at one instant."""
    from program.status import _engines

    nc = await nats.connect(stack.observer)
    js = nc.jetstream()
    kv = await js.key_value(bus.ENGINES_BUCKET)
    key, stop = "beating-fast", asyncio.Event()
    beat = msgspec.msgpack.encode(EngineInfo(id=key, model="m", updated=time.time()))

    async def beating() -> None:
        while not stop.is_set():
            await kv.put(key, beat)

    await kv.put(key, beat)
    running = asyncio.create_task(beating())
    try:
        missed = 0
        for _ in range(100):
            missed += key not in {e.id for e in await _engines(js, 5.0)}
        assert missed == 0, f"{missed} of 100 listings missed an engine that beat throughout"
    finally:
        stop.set()
        await running
        await kv.delete(key)
        await nc.close()
