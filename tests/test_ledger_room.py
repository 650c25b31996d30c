"""The ledger keeps every running request's records: a flood cannot push a long stream's
output out of a small `TW_OUT` while that stream is relayed, taken over and resumed. The
flood is refused (503, Retry-After) once the ledger nears full; the stream's client, and a
client resuming it from its first event, get every event."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import nats
import openai
import pytest
from tokenizers import Tokenizer

from engines.bridge import Bridge
from engines.sim import SimConfig, SimEngine
from tests.conftest import Stack, guarded_bus, make_settings, start_stack, wait_engines
from tests.stages import ENV, READY, TIMING
from tests.streams import IDS, Streamed, post, read, until
from tests.test_batches import chat_line, finished, jsonl
from tests.test_cli import spawn, stop
from tests.test_relay import assert_same_stream, body
from tokenway import bus
from tokenway.aio import Signal

pytestmark = pytest.mark.asyncio(loop_scope="session")

LEDGER = 4 << 20  # TW_OUT's bytes: the long stream's whole output is a tenth of it
RESERVE = 0.5  # kept for what running requests still write once the flood is refused
LONG = 800  # tokens of the long stream: 8 s at 10 ms a token
FLOODERS = 8
BATCH_LINES = 20


@dataclass
class Owner:
    """A schedule process, its log read as it comes (a full pipe would stop it)."""

    proc: asyncio.subprocess.Process
    lines: list[bytes] = field(default_factory=list)
    said: Signal = field(default_factory=Signal)

    async def read(self) -> None:
        assert self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            self.lines.append(line)
            self.said.fire()

    async def logged(self, text: bytes) -> None:
        await until(self.said, lambda: any(text in line for line in self.lines))


@dataclass
class Flood:
    """Streams of another client, as fast as they are taken, each as long as it lasts;
    a refusal is waited out as its Retry-After says."""

    url: str
    model: str
    served: int = 0
    refused: list[httpx.Response] = field(default_factory=list)
    other: list[int] = field(default_factory=list)
    refusing: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            while not stop.is_set():
                ask = {**body(self.model, 40), "seed": None}
                async with http.stream("POST", f"{self.url}/v1/completions", json=ask) as r:
                    if r.status_code == 200:
                        async for _ in r.aiter_bytes():
                            pass
                        self.served += 1
                        continue
                    await r.aread()
                    if r.status_code not in (429, 503):
                        self.other.append(r.status_code)
                        return
                    self.refused.append(r)
                    self.refusing.set()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), float(r.headers["retry-after"]))


@contextlib.asynccontextmanager
async def deployment(tmp: Path) -> AsyncIterator[tuple[Stack, str]]:
    """A bus of its own with a small TW_OUT; ingress, render and derender in process, two
    simulated engines (the first fails its first request mid-stream), and no owner: the
    test runs its owners as processes, to kill one."""
    async with guarded_bus(tmp / "nats") as own:
        model = f"ledger-{tmp.name}"
        settings = make_settings(tmp / "data", served_model_name=model, out_max_bytes=LEDGER,
                                 out_reserve=RESERVE, **TIMING)  # fmt: skip
        stack = await start_stack(own.url, settings, ["ingress", "render", "derender", "batch"])
        tokenizer = Tokenizer.from_file(str(stack.ingress.models[0].info.path / "tokenizer.json"))
        sims = [SimEngine(SimConfig(id=f"{name}-{tmp.name}", model=model, eos_token_id=1,
                                    ttft=0, itl=0.01, output_len=30, fail_after=fail), tokenizer)
                for name, fail in (("a-flaky", 60), ("b-steady", None))]  # fmt: skip
        bridges = [Bridge(stack.role("engine"), s) for s in sims]
        halt = asyncio.Event()
        tasks = [asyncio.create_task(b.run(stack.settings.nats, halt)) for b in bridges]
        try:
            await wait_engines(stack.ingress.registry, 2)
            yield stack, model
        finally:
            halt.set()
            await asyncio.gather(*tasks)
            await stack.close()


async def filled(stack: Stack, flood: Flood) -> None:
    """Until the ledger is near full: the flood is refused, or (without admission keeping
    its room) the ledger has discarded its first message, the long stream's."""
    nc = await nats.connect(stack.observer)
    try:
        async with asyncio.timeout(60):
            while not flood.refusing.is_set():
                if (await nc.jetstream().stream_info(bus.OUT_STREAM)).state.first_seq > 1:
                    return
                with contextlib.suppress(TimeoutError):  # the flood's progress is polled
                    await asyncio.wait_for(flood.refusing.wait(), 0.2)
    finally:
        await nc.close()


async def held_back(stack: Stack, http: httpx.AsyncClient) -> str:
    """A batch made while the ledger is near full: the runner takes it, and runs none of its
    lines (none is in the ledger) while its look at the ledger refuses; its id."""
    (runner,) = stack.by_name["batch"]
    room = runner.ledger_room
    await until(room.looked, lambda: room.refusal() is not None)
    lines = jsonl([chat_line(i) for i in range(BATCH_LINES)])
    up = await http.post(f"{stack.url}/v1/files", data={"purpose": "batch"},
                         files={"file": ("b.jsonl", lines)})  # fmt: skip
    made = await http.post(f"{stack.url}/v1/batches", json={
        "input_file_id": up.json()["id"], "endpoint": "/v1/chat/completions",
        "completion_window": "24h"})  # fmt: skip
    batch = made.json()["id"]
    taken = f"{stack.url}/v1/batches/{batch}"
    async with asyncio.timeout(30):
        while (await http.get(taken)).json()["status"] != "in_progress":  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # the runner's progress: polled as a client does
    for _ in range(3):  # three more looks, each still refusing: no line may have run
        await room.looked.waiter().wait()
    nc = await nats.connect(stack.observer)
    try:
        ledgers = bus.out_subject(bus.token(batch), "*")
        info = await nc.jetstream().stream_info(bus.OUT_STREAM, subjects_filter=ledgers)
    finally:
        await nc.close()
    assert not info.state.subjects and room.refusal() is not None
    return batch


async def owner(stack: Stack, tmp: Path, group: asyncio.TaskGroup) -> Owner:
    proc = await spawn("schedule", "--data-dir", str(tmp / "data"), "--served-model-name",
                       stack.model, env={**ENV, **stack.bus.env("schedule")})  # fmt: skip
    started = Owner(proc)
    group.create_task(started.read())
    await started.logged(READY["schedule"])
    return started


async def test_a_flood_cannot_push_a_running_streams_records_out_of_the_ledger(
    tmp_path: Path,
) -> None:
    async with (
        deployment(tmp_path) as (stack, model),
        httpx.AsyncClient(timeout=120) as http,
        asyncio.TaskGroup() as group,
    ):
        owners = [await owner(stack, tmp_path, group)]
        try:
            long, progress = Streamed(), Signal()
            reading = group.create_task(post(http, stack.url, body(model, LONG), long, progress))
            await until(progress, lambda: len(long.times) >= 5)  # it runs, on a-flaky
            flood, flooding = Flood(stack.url, model), asyncio.Event()
            floods = [group.create_task(flood.run(flooding)) for _ in range(FLOODERS)]
            await until(progress, lambda: len(long.times) >= 80)  # relayed at 60 tokens
            owners.append(await owner(stack, tmp_path, group))  # the one to take it over
            await filled(stack, flood)
            batch = await held_back(stack, http)  # the batch runner waits too
            owners[0].proc.send_signal(signal.SIGKILL)
            await owners[1].logged(b"taken over")
            taken = len(long.times)
            await until(progress, lambda: len(long.times) > taken + 20)  # the new owner's
            resumed = Streamed(rid=long.rid)  # another client, from the first event on
            headers = {"Last-Event-ID": "0", **IDS}
            async with http.stream("GET", f"{stack.url}/v1/streams/{long.rid}",
                                   headers=headers) as r:  # fmt: skip
                assert r.status_code == 200, await r.aread()
                await read(r, resumed, None)
            await reading
            flooding.set()
            await asyncio.gather(*floods)
            room = stack.ingress.ledger_room  # the ledger has room again once they ended
            await until(room.looked, lambda: room.refusal() is None)
            clean = Streamed()  # the same request, alone and without a fault
            await post(http, stack.url, body(model, LONG), clean)
            client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="-", max_retries=0)
            ran = await finished(client, batch)
            nc = await nats.connect(stack.observer)
            try:
                ledger = (await nc.jetstream().stream_info(bus.OUT_STREAM)).state
            finally:
                await nc.close()
        finally:
            for o in owners:
                await stop(o.proc, signal.SIGKILL)
    assert_same_stream(long, clean, LONG)
    assert_same_stream(resumed, clean, LONG)
    assert flood.served and flood.refused and not flood.other
    for refusal in flood.refused:
        assert refusal.status_code == 503 and int(refusal.headers["retry-after"]) >= 1
        assert refusal.json()["error"]["code"] == "ledger_full"
    assert ledger.bytes <= LEDGER
    assert ran.status == "completed" and ran.request_counts.completed == BATCH_LINES
    print(
        f"flood: {flood.served} streams served, {len(flood.refused)} refused; the ledger "
        f"holds {ledger.bytes} of {LEDGER} bytes from message {ledger.first_seq} on"
    )
