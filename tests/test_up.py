"""Every public surface through `tokenway up` as it ships, a process of its own, with the
real SDKs: its own least-privilege bus users, once without API keys and once with a key
file of two tenants. What broke before broke here: the Batch API under `up`'s own users,
the direct-publish examples that could not reach `up`'s bus, the ready block printed
before the stages said they serve."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import stat
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import nats
import openai
import pytest
import pytest_asyncio

from tests.conftest import env_file
from tests.test_cli import ENV, TOKENWAY, stop
from tests.test_least_privilege import render_queue_taken
from tokenway import bus
from tokenway.client import Client
from tokenway.config import load_settings

pytestmark = pytest.mark.asyncio(loop_scope="session")

ROOT = Path(__file__).resolve().parents[1]
MODEL = "deepseek-v4"
KEYS = {"acme": "sk-acme-0123456789abcdef", "rival": "sk-rival-0123456789abcdef"}


@dataclass
class Up:
    """A running `tokenway up`: where its API is, its data dir, what it printed."""

    proc: asyncio.subprocess.Process
    data: Path
    url: str  # http://127.0.0.1:PORT
    block: str  # the ready block
    key: str  # a key of tenant acme's ("-" without keys)
    tenant: str  # the tenant `key` is of, whose client file a job loads

    def env(self, role: str) -> dict[str, str]:
        """What a process of `role` loads: the file `up` wrote for it."""
        return env_file(self.data / "nats-auth" / f"{role}.env")

    @property
    def log(self) -> str:
        return (self.data / "up.log").read_text()

    def openai(self, key: str | None = None) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=key or self.key,
                                  max_retries=0)  # fmt: skip

    def http(self, key: str | None = None) -> httpx.AsyncClient:
        bearer = {"Authorization": f"Bearer {key or self.key}"}
        return httpx.AsyncClient(base_url=self.url, timeout=60, headers=bearer)


async def start_up(data: Path, *flags: str, env: dict[str, str] | None = None) -> Up:
    """`tokenway up` on `data`, once it printed its ready block (its log in `up.log`)."""
    data.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - a test's set-up
    with open(data / "up.log", "wb") as log:  # noqa: ASYNC230
        proc = await asyncio.create_subprocess_exec(
            *TOKENWAY, "up", "--data-dir", str(data), "--port", "0", "--log-level", "info",
            *flags, env={**ENV, **(env or {})}, stdout=asyncio.subprocess.PIPE, stderr=log,
        )  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []
    async with asyncio.timeout(90):
        while not lines or not lines[-1].lstrip().startswith("metrics"):
            line = (await proc.stdout.readline()).decode()
            assert line, f"`up` exited: {(data / 'up.log').read_text()[-2000:]}"
            lines.append(line.rstrip("\n"))
    block = "\n".join(lines)
    url = re.search(r"at (http://\S+)/v1", block)
    assert url is not None, block
    return Up(proc, data, url.group(1), block, "-", "default")


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=["open", "keyed"])
async def up(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Up]:
    """`up` as a newcomer starts it, and as a team with a key file of two tenants does."""
    data = tmp_path_factory.mktemp(f"up-{request.param}")
    flags: list[str] = []
    if request.param == "keyed":
        (data / "keys").write_text("".join(f"{t} {k}\n" for t, k in KEYS.items()))
        flags = ["--api-key-file", str(data / "keys")]
    running = await start_up(data, *flags)
    if request.param == "keyed":
        running.key, running.tenant = KEYS["acme"], "acme"
    try:
        yield running
    finally:
        await stop(running.proc, signal.SIGKILL)


async def command(up: Up, role: str, *args: str) -> tuple[int, str, str]:
    """A `tokenway` command run as the README says: with its role's env file loaded."""
    proc = await asyncio.create_subprocess_exec(
        *TOKENWAY, *args, env={**ENV, **up.env(role)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    return proc.returncode or 0, out.decode(), err.decode()


def chat(text: str, **more: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 8,
            **more}  # fmt: skip


async def test_the_ready_block_comes_after_every_stage_serves_and_names_the_jobs_file(
    up: Up,
) -> None:
    log = up.log  # written before the block was printed
    for serving in ("render serving", "owning", "running batches", "listening on", "serving"):
        assert serving in log, log
    assert f"client-{up.tenant}.env" in up.block and "(README: Publishing directly)" in up.block
    assert stat.S_IMODE(os.stat(up.data / "nats-server.log").st_mode) == 0o600


async def test_chat_and_completions_whole_and_streamed(up: Up) -> None:
    async with up.openai() as client:
        done = await client.chat.completions.create(**chat("Hello!"))
        assert done.choices[0].message.content and done.usage.completion_tokens == 8
        stream = await client.chat.completions.create(**chat("Hello!"), stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == done.choices[0].message.content
        completion = await client.completions.create(model=MODEL, prompt="Once", max_tokens=5)
        assert completion.choices[0].text and completion.usage.completion_tokens == 5


async def test_responses_stored_and_continued(up: Up) -> None:
    async with up.openai() as client:
        first = await client.responses.create(model=MODEL, input="Hello!", max_output_tokens=8)
        assert first.output_text and first.status in ("completed", "incomplete")
        assert (await client.responses.retrieve(first.id)).output_text == first.output_text
        items = await client.responses.input_items.list(first.id)
        assert [i.type for i in items.data] == ["message"]
        follow = await client.responses.create(model=MODEL, input="And?", max_output_tokens=8,
                                               previous_response_id=first.id)  # fmt: skip
        assert follow.output_text


async def test_messages_and_count_tokens(up: Up) -> None:
    async with anthropic.AsyncAnthropic(base_url=up.url, api_key=up.key, max_retries=0) as claude:
        message = await claude.messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hello!"}]
        )
        assert message.content[0].type == "text" and message.stop_reason == "max_tokens"
        counted = await claude.messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": "Hello!"}]
        )
        assert counted.input_tokens > 0


async def render_taken(up: Up, batch: bool = False) -> int:
    """Requests the render workers took from their queue, as the ops role reads it."""
    ops = load_settings(env=up.env("ops"))
    return await render_queue_taken(ops.nats or "", ops, MODEL, batch)


async def test_the_ingress_renders_beside_itself_and_jobs_go_through_the_render_queue(
    up: Up,
) -> None:
    """`up` renders an HTTP request in the ingress's process (`--render-placement ingress`):
    it takes no stored hop through the render queue; a job's request published on
    `tw.render.*` is rendered by the render workers, as before."""
    http, lanes = await render_taken(up), await render_taken(up, batch=True)
    async with up.openai() as client:
        reply = await client.chat.completions.create(**chat("Hello"))
        assert reply.choices[0].message.content
        with pytest.raises(openai.BadRequestError) as bad:  # render's refusal, answered directly
            await client.completions.create(model=MODEL, prompt=[10**9], max_tokens=3)
        assert "outside the vocabulary" in str(bad.value.body), bad.value.body
    job = await Client.from_env(MODEL, env={**ENV, **up.env(f"client-{up.tenant}")})
    async with job:
        done = await job.run(chat("Hello"))
    assert done["choices"][0]["message"]["content"]
    assert await render_taken(up) == http
    assert await render_taken(up, batch=True) == lanes + 1


async def test_tokenize_and_detokenize(up: Up) -> None:
    async with up.http() as http:
        tokens = (await http.post("/tokenize", json={"model": MODEL, "prompt": "Hello"})).json()
        assert tokens["count"] == len(tokens["tokens"]) > 0
        text = await http.post("/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]})
        assert text.json()["prompt"] == "Hello"


async def test_a_stream_resumes_from_where_its_client_stopped(up: Up) -> None:
    body = {"model": MODEL, "prompt": "A story", "max_tokens": 12, "stream": True}
    async with up.http() as http:
        whole = await http.post("/v1/completions", json=body)
        rid = whole.headers["x-tokenway-stream-id"]
        rest = await http.get(f"/v1/streams/{rid}", headers={"Last-Event-ID": "3"})
    assert rest.status_code == 200, rest.text
    events = [e for e in whole.text.split("\n\n") if e]
    assert [e for e in rest.text.split("\n\n") if e] == events[3:]
    assert events[-1] == "data: [DONE]"


async def test_files_and_batches_run_and_cancel(up: Up) -> None:
    """The Batch API under `up`'s own users: its runner and the ingress read files as their
    roles may (a file read once timed out on a permission they lacked: `validating` for
    good, a 500 for the file's content)."""
    lines = [{"custom_id": f"q-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": chat(f"Fact {i}?")} for i in range(3)]  # fmt: skip
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    async with up.openai() as client:
        file = await client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        assert (await client.files.content(file.id)).content == data
        batch = await client.batches.create(input_file_id=file.id, completion_window="24h",
                                            endpoint="/v1/chat/completions")  # fmt: skip
        cancelled = await client.batches.create(input_file_id=file.id, completion_window="24h",
                                                endpoint="/v1/chat/completions")  # fmt: skip
        await client.batches.cancel(cancelled.id)
        ended = {b.id: b for b in [await ended_batch(client, b.id) for b in (batch, cancelled)]}
        assert ended[batch.id].status == "completed", ended[batch.id]
        assert ended[batch.id].request_counts.completed == 3
        out = (await client.files.content(ended[batch.id].output_file_id or "")).content
        assert sorted(json.loads(x)["custom_id"] for x in out.splitlines()) == ["q-0", "q-1", "q-2"]
        assert ended[cancelled.id].status == "cancelled"
        if up.key != "-":  # another tenant sees none of it
            async with up.openai(KEYS["rival"]) as rival:
                with pytest.raises(openai.NotFoundError):
                    await rival.batches.retrieve(batch.id)


async def ended_batch(client: openai.AsyncOpenAI, batch_id: str) -> openai.types.Batch:
    async with asyncio.timeout(60):
        while True:
            batch = await client.batches.retrieve(batch_id)
            if batch.status in ("completed", "failed", "cancelled", "expired"):
                return batch
            await asyncio.sleep(0.2)  # another process's progress: polled as a client does


@pytest.mark.parametrize("example", ["rl_tokens.py", "batch_many.py"])
async def test_the_direct_publish_examples_run_with_the_file_up_wrote(up: Up, example: str) -> None:
    """As the README says: load the tenant's client file, run the example."""
    args = ["--model", MODEL] + (["--count", "4"] if example == "batch_many.py" else [])
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "examples" / example), *args, cwd=ROOT,
        env={**ENV, **up.env(f"client-{up.tenant}")},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode == 0, err.decode()
    assert len(out.decode().splitlines()) == 4, out


async def test_status_and_dead_letters_as_the_ops_role(up: Up) -> None:
    """A message nobody can process (a job's undecodable request) is a dead letter that
    `tokenway dlq` lists, and `tokenway status` counts; both as the README runs them."""
    job = up.env(f"client-{up.tenant}")
    nc = await nats.connect(job["TOKENWAY_NATS"], nkeys_seed=job["TOKENWAY_NATS_NKEY_FILE"],
                            inbox_prefix=job["TOKENWAY_NATS_INBOX_PREFIX"])  # fmt: skip
    try:
        rid = f"undecodable-{os.getpid()}"
        reply = bus.tenant_reply(up.tenant, "poison")
        headers = {"Nats-Msg-Id": rid, "Tw-Rid": rid, "Tw-Reply": reply, "Tw-Batch": "1"}
        subject = bus.render_subject(MODEL, True, up.tenant)
        await nc.jetstream().publish(subject, b"not msgpack", headers=headers)
    finally:
        await nc.close()
    async with asyncio.timeout(60):
        while True:  # another process's work: asked as an operator asks
            code, out, err = await command(up, "ops", "dlq", "ls", "--json")
            assert code == 0, err
            letters = [json.loads(line) for line in out.splitlines()]
            if any(d["subject"] == subject and "undecodable" in d["reason"] for d in letters):
                break
            await asyncio.sleep(0.2)
    code, out, err = await command(up, "ops", "status", "--json")
    assert code == 0, err
    status = json.loads(out)
    assert status["dead_letters"]["render"] >= 1 and status["missing"] == []
    assert any(e["alive"] for e in status["engines"])


async def logged(up: Up, text: str) -> None:
    """Until `up` logs `text` (its log is a file: read again as it grows)."""
    async with asyncio.timeout(60):
        while text not in up.log:  # noqa: ASYNC110 - another process writes the file
            await asyncio.sleep(0.05)


async def test_ctrl_c_stops_in_the_order_the_data_flows_within_one_grace(tmp_path: Path) -> None:
    """Ctrl-C during a stream: the stream gets its grace, then an error naming the shutdown;
    the owner lets its request go before the engine stops, so nothing relays, and the whole
    stop takes one grace, not the ingress's and then the owner's. It once stopped the engine
    under the owner, which relayed, waited `--engine-wait` and answered 503: 32 s, not 20."""
    up = await start_up(tmp_path / "data", env={"TOKENWAY_DRAIN_TIMEOUT": "1",
                                                "TOKENWAY_SIM_ITL": "0.02"})  # fmt: skip
    body = {"model": MODEL, "prompt": "A long story", "max_tokens": 100_000, "ignore_eos": True,
            "stream": True}  # fmt: skip
    try:
        async with up.http() as http, http.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.aiter_lines()
            assert (await anext(lines)).startswith("data: ")  # it streams
            up.proc.send_signal(signal.SIGINT)
            rest = [line async for line in lines]
        code = await asyncio.wait_for(up.proc.wait(), 60)
    finally:
        await stop(up.proc, signal.SIGKILL)
    log = up.log
    assert code == 0, log[-3000:]
    assert any("shutting down" in line for line in rest) and rest[-2:] == ["data: [DONE]", ""]
    assert "a second Ctrl-C or SIGTERM stops at once" in log
    assert "relay" not in log and "stopped heartbeating" not in log, log[-3000:]
    assert "Traceback" not in log


async def test_a_second_ctrl_c_stops_at_once_saying_so_in_one_line(tmp_path: Path) -> None:
    up = await start_up(tmp_path / "data", env={"TOKENWAY_SIM_ITL": "0.02"})
    body = {"model": MODEL, "prompt": "A long story", "max_tokens": 100_000, "ignore_eos": True,
            "stream": True}  # fmt: skip
    try:
        async with up.http() as http, http.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            up.proc.send_signal(signal.SIGINT)
            await logged(up, "stops at once")
            up.proc.send_signal(signal.SIGINT)
            code = await asyncio.wait_for(up.proc.wait(), 30)
    finally:
        await stop(up.proc, signal.SIGKILL)
    log = up.log
    assert code == 130
    assert log.rstrip().endswith("tokenway: stopped at once, without draining (a second signal)")
    assert "Traceback" not in log and "Exception in ASGI application" not in log


def chained_grammar(rules: int) -> str:
    """A Lark grammar whose rules refer to each other `rules` deep: llguidance compiles it
    by recursion, which overflowed a thread's default stack (a segfault) near 3,000."""
    chain = "\n".join(f'r{i}: "t" r{i + 1}?' for i in range(rules))
    return f'start: r0\n{chain}\nr{rules}: "t"'


async def test_a_grammar_deep_enough_to_overflow_a_stack_is_served_and_up_lives(
    tmp_path: Path,
) -> None:
    """One client's 52 KB grammar, compiled on the event loop's thread, crashed the whole
    process (every stage of `up` with it)."""
    up = await start_up(tmp_path / "data")
    body = chat("Say t.", max_tokens=4, structured_outputs={"grammar": chained_grammar(3000)})
    try:
        async with up.http() as http:
            deep = await http.post("/v1/chat/completions", json=body)
            assert deep.status_code == 200, deep.text
            calm = await http.post("/v1/chat/completions", json=chat("Hello!"))
            assert calm.status_code == 200, calm.text
        assert up.proc.returncode is None
    finally:
        await stop(up.proc, signal.SIGKILL)
