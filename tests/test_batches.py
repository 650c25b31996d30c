"""The OpenAI Batch API through the `openai` SDK's own `files` and `batches` calls, on the
whole pipeline with its batch runner: every line answered once, in OpenAI's shapes, errors
in the error file, a bad file failing the batch, a cancel stopping it, and another tenant
seeing none of it."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import msgspec
import nats
import openai
import pytest
import pytest_asyncio
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from tests.conftest import Stack, guarded_bus, make_settings, start_stack
from tests.test_cli import logged, spawn, stop
from tokenway import batches, bus
from tokenway import headers as h
from tokenway.batch_store import BatchStore
from tokenway.client import Client
from tokenway.wire import EngineWork
from workers.batch.service import RUNS

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest_asyncio.fixture(loop_scope="session")
async def client(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="-", max_retries=0)


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def chat_line(i: int, **body: object) -> dict:
    return {"custom_id": f"q-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": f"Fact {i}?"}], "max_tokens": 5,
                     **body}}  # fmt: skip


async def finished(
    client: openai.AsyncOpenAI, batch_id: str, timeout: float = 60
) -> openai.types.Batch:
    """The batch once it ended (the runner's progress shows in its counts meanwhile)."""
    async with asyncio.timeout(timeout):
        while True:
            batch = await client.batches.retrieve(batch_id)
            if batch.status in ("completed", "failed", "cancelled", "expired"):
                return batch
            await asyncio.sleep(0.2)  # another process's progress: polled as a client does


async def answered(client: openai.AsyncOpenAI, batch_id: str) -> int:
    return (await client.batches.retrieve(batch_id)).request_counts.completed


async def run(client: openai.AsyncOpenAI, lines: list[dict]) -> openai.types.Batch:
    file = await client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    assert file.purpose == "batch" and file.bytes == len(jsonl(lines))
    batch = await client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                        completion_window="24h", metadata={"job": "t"})  # fmt: skip
    assert batch.status == "validating" and batch.metadata == {"job": "t"}
    return await finished(client, batch.id)


async def lines_of(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in (await client.files.content(file_id)).content.splitlines()]


async def test_every_line_is_answered_once_in_openais_shapes(client: openai.AsyncOpenAI) -> None:
    lines = [chat_line(i) for i in range(250)]  # three parts of output
    lines[7] = chat_line(7, max_tokens=-1)  # refused by render: the error file
    batch = await run(client, lines)
    assert batch.status == "completed", batch
    assert batch.request_counts.total == 250
    assert (batch.request_counts.completed, batch.request_counts.failed) == (249, 1)
    out = await lines_of(client, batch.output_file_id)
    errors = await lines_of(client, batch.error_file_id)
    assert [o["custom_id"] for o in out] == [f"q-{i}" for i in range(250) if i != 7]
    assert len({o["id"] for o in out}) == 249
    response = out[0]["response"]
    assert response["status_code"] == 200 and response["body"]["object"] == "chat.completion"
    assert response["body"]["choices"][0]["message"]["content"]
    (error,) = errors
    assert error["custom_id"] == "q-7" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["param"] == "max_tokens"
    listed = await client.batches.list()
    assert batch.id in [b.id for b in listed.data]
    files = {f.id: f.purpose for f in (await client.files.list()).data}
    assert files[batch.input_file_id] == "batch" and files[batch.output_file_id] == "batch_output"


async def test_a_tenants_batch_runs_as_the_tenant_on_its_lane(stack: Stack, tmp_path: Path) -> None:
    """A keyed client's batch: its lines are its tenant's requests (the owners' turns
    count them so), on the tenant's lane and replies. They once ran as nobody's."""
    key = "sk-batch-tenant-0123456789abcdef"
    keyed = await start_stack(stack.settings.nats, make_settings(tmp_path, api_key=key),
                              ["ingress"])  # fmt: skip
    nc = await nats.connect(stack.observer)
    try:
        async with openai.AsyncOpenAI(base_url=f"{keyed.url}/v1", api_key=key,
                                      max_retries=0) as client:  # fmt: skip
            batch = await run(client, [chat_line(i) for i in range(3)])
        assert batch.status == "completed" and batch.request_counts.completed == 3
        reply = bus.tenant_reply("default", bus.token(batch.id))
        last = await nc.jetstream().get_last_msg(
            bus.OUT_STREAM, bus.out_subject(reply, batches.line_rid(batch.id, 0))
        )
        assert (last.headers or {})[h.TENANT] == "default"
    finally:
        await nc.close()
        await keyed.close()


async def test_a_bad_input_file_fails_the_batch_with_each_lines_error(
    client: openai.AsyncOpenAI,
) -> None:
    lines = [chat_line(0), {**chat_line(1), "url": "/v1/completions"}, chat_line(0)]
    batch = await run(client, lines)
    assert batch.status == "failed" and batch.errors is not None
    found = [(e.code, e.line) for e in batch.errors.data or []]
    assert found == [("mismatched_url", 2), ("duplicate_custom_id", 3)]


async def test_a_cancelled_batch_stops_its_lines_in_flight(
    client: openai.AsyncOpenAI, stack: Stack
) -> None:
    lines = [chat_line(i, max_tokens=100_000, ignore_eos=True) for i in range(6)]
    file = await client.files.create(file=("c.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = await client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")  # fmt: skip
    schedule = stack.by_name["schedule"][0]
    async with asyncio.timeout(30):
        while len(schedule.requests) < 6:  # noqa: ASYNC110 - the runner's lines, owned
            await asyncio.sleep(0.05)
    cancelling = await client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling"
    ended = await finished(client, batch.id)
    assert ended.status == "cancelled" and ended.cancelled_at
    assert ended.request_counts.completed == 0 and ended.output_file_id is None
    async with asyncio.timeout(30):
        await schedule.empty.wait()  # every line in flight was cancelled at its owner
    with pytest.raises(openai.ConflictError):
        await client.batches.cancel(batch.id)


async def test_files_and_batches_are_refused_clearly(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="purpose"):
        await client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    with pytest.raises(openai.NotFoundError):
        await client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions",
                                    completion_window="24h")  # fmt: skip
    with pytest.raises(openai.NotFoundError):
        await client.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        await client.files.content("file-nope")


async def test_a_runner_killed_midway_leaves_every_line_answered_once(tmp_path: Path) -> None:
    """1,000 lines; the runner process is SIGKILLed with some answered, another takes the
    batch over when the lease lapses: 1,000 answers, each line run once by the engine."""
    async with guarded_bus(tmp_path / "nats") as own:
        env = {**own.env("batch"), "TOKENWAY_BATCH_LEASE": "2", "TOKENWAY_BATCH_CONCURRENCY": "20"}
        settings = make_settings(tmp_path / "d", sim_output_len=60)
        stack = await start_stack(own.url, settings, ["ingress", "render", "schedule",
                                                      "derender", "sim"])  # fmt: skip
        runners = []
        try:
            runners.append(await spawn("batch", "run", env=env))
            await logged(runners[0], b"running batches")
            client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="-", max_retries=0)
            lines = [chat_line(i, max_tokens=40, ignore_eos=True) for i in range(1000)]
            file = await client.files.create(file=("k.jsonl", io.BytesIO(jsonl(lines))),
                                             purpose="batch")  # fmt: skip
            batch = await client.batches.create(input_file_id=file.id, completion_window="24h",
                                                endpoint="/v1/chat/completions")  # fmt: skip
            async with asyncio.timeout(60):
                while await answered(client, batch.id) < 150:  # noqa: ASYNC110 - another process
                    await asyncio.sleep(0.1)
            runners[0].kill()
            await runners[0].wait()
            runners.append(await spawn("batch", "run", env=env))
            ended = await finished(client, batch.id, timeout=120)
            assert ended.status == "completed", ended
            out = await lines_of(client, ended.output_file_id)
            assert [o["custom_id"] for o in out] == [f"q-{i}" for i in range(1000)]
            runs = Counter(w.request_id for b in stack.by_name["engine"] for w in b.engine.received)
            assert len(runs) == 1000 and set(runs.values()) == {1}
        finally:
            for proc in runners:
                await stop(proc)
            await stack.close()


async def test_the_shell_submits_waits_and_prints_the_results(stack: Stack, tmp_path: Path) -> None:
    path = tmp_path / "shell.jsonl"
    path.write_bytes(jsonl([chat_line(i) for i in range(5)]))
    batch_role = stack.bus.env("batch")  # the env file `up` writes for the batch role
    proc = await spawn("batch", "submit", str(path), "--wait", env=batch_role)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    batch_id = out.decode().strip()
    assert "completed" in err.decode() and "5/5" in err.decode()  # the progress line
    proc = await spawn("batch", "results", batch_id, env=batch_role)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert [json.loads(x)["custom_id"] for x in out.splitlines()] == [f"q-{i}" for i in range(5)]
    proc = await spawn("batch", "cancel", batch_id, env=batch_role)
    _, err = await proc.communicate()
    assert proc.returncode == 1 and "completed already" in err.decode()


@contextlib.asynccontextmanager
async def own_stack(
    stack: Stack, tmp_path: Path, name: str, **settings: object
) -> AsyncIterator[tuple[Stack, NATS, Client]]:
    """A pipeline of its own (model `name`, an owner that pulls only what fits) on the
    session's NATS, the test's connection to it, and a batch job publishing there (as the
    tenant `default`'s client)."""
    s = make_settings(tmp_path, sim_itl=0.005, owner_lookahead=0, served_model_name=name,
                      **settings)  # fmt: skip
    own = await start_stack(stack.settings.nats, s, ["ingress", "render", "schedule", "sim"])
    nc = await nats.connect(stack.observer)
    job = await own.direct()
    try:
        yield own, nc, job
    finally:
        await job.nc.close()
        await nc.close()
        await own.close()


def chat_body(model: str, max_tokens: int) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Go on."}],
            "max_tokens": max_tokens, "ignore_eos": True}  # fmt: skip


async def ended_as(job: Client, rid: str, ended: list[str]) -> None:
    """Wait for a batch line's end, and note it in `ended`."""
    await job.result(rid, timeout=60)
    ended.append("batch")


async def test_batch_lines_leave_an_interactive_request_room_on_the_engine(
    stack: Stack, tmp_path: Path
) -> None:
    """An engine of four sequences and six long batch lines: the lines take three, so a
    short interactive request sent while they run starts at once, next, and ends first. It
    once waited for a line to end, all four sequences being the batch's."""
    room_for = {"sim_max_seqs": 4, "batch_headroom": 0.25}
    async with own_stack(stack, tmp_path, "room", **room_for) as (room, nc, job):
        engine = room.by_name["engine"][0].engine.info().id
        dispatched: asyncio.Queue[EngineWork] = asyncio.Queue()  # what the owner starts

        async def seen(msg: Msg) -> None:
            await dispatched.put(msgspec.msgpack.decode(msg.data, type=EngineWork))

        await nc.subscribe(bus.engine_subject(engine, "generate"), cb=seen)
        ended: list[str] = []
        rids = [await job.submit(chat_body("room", 300)) for _ in range(6)]
        lines = [asyncio.create_task(ended_as(job, rid, ended)) for rid in rids]
        for _ in range(3):  # the lines the engine takes
            await asyncio.wait_for(dispatched.get(), timeout=30)
        async with httpx.AsyncClient(base_url=room.url, timeout=60) as http:
            resp = await http.post("/v1/chat/completions", json=chat_body("room", 5))
        assert resp.status_code == 200, resp.text
        ended.append("interactive")
        fourth = await asyncio.wait_for(dispatched.get(), timeout=30)
        assert fourth.sampling_params.max_tokens == 5  # before any other line
        await asyncio.gather(*lines)
        assert ended[0] == "interactive", ended


async def test_batch_lines_yield_the_engine_while_interactive_requests_run(
    stack: Stack, tmp_path: Path
) -> None:
    """An engine of eight sequences, an interactive stream running and six batch lines:
    the lines take the busy share, two, until the stream ends; then the rest start. They
    once took six beside it (and the CPU that goes with them)."""
    shares = {"sim_max_seqs": 8, "batch_headroom": 0.0, "batch_busy_share": 0.25}
    async with own_stack(stack, tmp_path, "busy", **shares) as (busy, nc, job):
        engine = busy.by_name["engine"][0].engine.info().id
        seen: asyncio.Queue[tuple[str, int]] = asyncio.Queue()  # (verb, max_tokens), in order

        async def on_engine(msg: Msg) -> None:
            verb = msg.subject.rsplit(".", 1)[1]
            tokens = 0
            if verb == "generate":
                work = msgspec.msgpack.decode(msg.data, type=EngineWork)
                tokens = work.sampling_params.max_tokens or 0
            await seen.put((verb, tokens))

        await nc.subscribe(bus.engine_subject(engine, "*"), cb=on_engine)
        endless = {**chat_body("busy", 100_000), "stream": True}
        async with httpx.AsyncClient(base_url=busy.url, timeout=60) as http:
            async with http.stream("POST", "/v1/chat/completions", json=endless) as resp:
                lines = resp.aiter_lines()
                await anext(lines)  # it runs
                assert (await seen.get()) == ("generate", 100_000)
                rids = [await job.submit(chat_body("busy", 100)) for _ in range(6)]
                for _ in range(2):
                    assert (await asyncio.wait_for(seen.get(), timeout=30)) == ("generate", 100)
                results = asyncio.gather(*(job.result(rid, timeout=60) for rid in rids))
        # the client left: its abort goes out, and only then do the other four start
        assert (await asyncio.wait_for(seen.get(), timeout=30))[0] == "abort"
        assert len(await results) == 6
        later = [seen.get_nowait() for _ in range(seen.qsize())]
        assert [v for v, _ in later].count("generate") == 4, later


async def test_an_interactive_request_goes_before_queued_batch_lines(
    stack: Stack, tmp_path: Path
) -> None:
    """An engine of one sequence, an owner that pulls only what fits, and six batch lines
    queued before an interactive request: the interactive one runs as soon as the line in
    the engine ends. It once waited in the schedule queue behind all six, first in, first
    out, where an owner's line could not rank it."""
    async with own_stack(stack, tmp_path, "lanes", sim_max_seqs=1) as (lanes, nc, job):
        queued: asyncio.Queue[object] = asyncio.Queue()  # each rendered request, either lane

        async def seen(msg: object) -> None:
            await queued.put(msg)

        for batch in (False, True):
            await nc.subscribe(bus.sched_subject("lanes", batch), cb=seen)
        ended: list[str] = []
        rids = [await job.submit(chat_body("lanes", 100)) for _ in range(6)]
        lines = [asyncio.create_task(ended_as(job, rid, ended)) for rid in rids]
        for _ in rids:  # every line rendered and queued for the owner
            await asyncio.wait_for(queued.get(), timeout=30)
        async with httpx.AsyncClient(base_url=lanes.url, timeout=60) as http:
            resp = await http.post("/v1/chat/completions", json=chat_body("lanes", 100))
        assert resp.status_code == 200, resp.text
        ended.append("interactive")
        await asyncio.gather(*lines)
        # The line running when it came, and at most the one that started as it was queued.
        assert ended.index("interactive") <= 2, ended


async def test_a_batch_its_runners_cannot_run_fails_saying_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A batch whose every run fails (a bug, a permission its runner lacks) ends `failed`
    with the reason after a few tries, each later than the last. Such a batch once stayed
    `validating` for good, taken again every few seconds with a traceback each time."""

    async def broken(self: BatchStore, file_id: str, tenant: str) -> bytes:
        raise RuntimeError("the input cannot be read")

    monkeypatch.setattr(BatchStore, "content", broken)
    async with guarded_bus(tmp_path / "nats") as own:
        settings = make_settings(tmp_path / "d", batch_lease=0.3)
        stack = await start_stack(own.url, settings, ["ingress", "batch"])
        try:
            async with openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="-",
                                          max_retries=0) as client:  # fmt: skip
                batch = await run(client, [chat_line(0)])
        finally:
            await stack.close()
    assert batch.status == "failed" and batch.failed_at is not None
    (error,) = batch.errors.data if batch.errors else []
    assert error.code == "batch_failed" and f"{RUNS} runs" in error.message
    tries = [r for r in caplog.records if batch.id in r.getMessage() and r.exc_info]
    assert len(tries) == RUNS


async def test_a_runner_that_cannot_list_the_batches_for_a_moment_runs_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """JetStream busy or electing a leader when the runner looks: it looks again later. The
    error once ended the runner, and with it every stage of `tokenway up`."""
    looks: list[int] = []
    looked_again = asyncio.Event()
    listed = BatchStore.records

    async def flaky(self: BatchStore) -> list[batches.Record]:
        looks.append(1)
        if len(looks) == 1:
            raise nats.errors.TimeoutError
        looked_again.set()
        return await listed(self)

    monkeypatch.setattr(BatchStore, "records", flaky)
    async with guarded_bus(tmp_path / "nats") as own:
        stack = await start_stack(own.url, make_settings(tmp_path / "d", batch_lease=0.3),
                                  ["ingress", "batch"])  # fmt: skip
        try:
            async with asyncio.timeout(30):
                await looked_again.wait()
            assert not stack.task.done()
        finally:
            await stack.close()
