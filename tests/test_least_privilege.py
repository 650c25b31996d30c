"""Least privilege on the bus (`tokenway.roles`, `tokenway nats-auth`), on a real
nats-server that lets in the generated users only: every stage runs end to end as its own
role, and each attack of an outsider fails for every role that has no business doing it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import msgspec
import nats
import openai
import pytest
import pytest_asyncio

from program.stages import serve
from tests.conftest import Logged, make_settings, nats_server, start_stack
from tests.test_cli import spawn
from tokenway import bus
from tokenway.config import Settings
from tokenway.nats_users import NatsUsers
from tokenway.natsd import server_binary
from tokenway.roles import roles

TENANTS = ["acme"]  # a client role on the bus: `client-acme`
ROLES = [r.name for r in roles(TENANTS)]
# What an outsider did to an open bus, and the roles whose work it is.
ATTACKS: dict[str, tuple[str, str, set[str]]] = {
    "read every message": ("sub", ">", set()),
    "read the request bodies": ("sub", "tw.render.>", set()),
    "read the output ledger as it is written": ("sub", "tw.out.>", set()),
    "read another role's replies": ("sub", "_INBOX.>", set()),
    "read an ingress's streams live": ("sub", "tw.sse.i0123", {"ingress", "schedule"}),
    "read an hour of everyone's output": (
        "pub",
        "$JS.API.CONSUMER.CREATE.TW_OUT",
        {"ingress", "batch", "provision"},  # the batch runner reads its lines' ledgers
    ),
    "read every batch file": (
        "pub",
        "$JS.API.CONSUMER.CREATE.OBJ_tw-files",
        {"ingress", "batch", "provision"},
    ),
    "rewrite a batch": ("pub", "$KV.tw-batches.batch_0123", {"ingress", "batch"}),
    "forge a final response": ("pub", "tw.out.i0123.r0123", {"render", "schedule"}),
    "register a fake engine": ("pub", "$KV.tw-engines.fake", {"engine"}),
    "free a tenant's slots": ("pub", "$KV.tw-tenants.acme", {"render", "schedule"}),
    "free a tenant's storage quota": ("pub", "$KV.tw-stored.acme", {"ingress", "batch"}),
    "race a token delta": ("pub", "tw.tok.o0123", {"engine"}),
    "call an engine": ("pub", "tw.engine.e0123.generate", {"schedule"}),
    "run free inference": ("pub", "tw.sched.deepseek-v4", {"render", "schedule", "ops"}),
    "cancel another client's request": (
        "pub",
        "tw.cancel.i0123.r0123",
        {"ingress", "schedule", "batch"},
    ),
    "cancel another tenant's request": ("pub", "tw.cancel.tenant.rival.j1.r0123", {"batch"}),
    "flood the render queue": ("pub", "tw.render.deepseek-v4", {"ingress", "ops"}),
    "flood the batch lane": ("pub", "tw.render.deepseek-v4.batch._", {"batch", "ops"}),
    "flood another tenant's lane": ("pub", "tw.render.deepseek-v4.batch.rival", {"batch", "ops"}),
    "queue a free batch line": (
        "pub",
        "tw.sched.deepseek-v4.batch._",
        {"render", "schedule", "ops"},
    ),
    "queue a line as another tenant": ("pub", "tw.sched.deepseek-v4.batch.rival", {"ops"}),
    "read another tenant's results": (
        "pub",
        "$JS.API.CONSUMER.CREATE.TW_OUT.r1.tw.out.tenant.rival.j1.*",
        {"ingress", "batch", "provision"},
    ),
    "read an ingress's results by a named consumer": (
        "pub",
        "$JS.API.CONSUMER.CREATE.TW_OUT.r1.tw.out.i0123.*",
        {"ingress", "batch", "provision"},
    ),
    "read another tenant's deliveries": ("sub", "tw.sse.tenant.rival.j1", set()),
    "delete the ledger": ("pub", "$JS.API.STREAM.DELETE.TW_OUT", {"provision"}),
    "delete the render queue": ("pub", "$JS.API.STREAM.DELETE.TW_RENDER", {"provision"}),
    "create a stream": ("pub", "$JS.API.STREAM.CREATE.TW_EVIL", {"provision"}),
}


@pytest.fixture
def users(tmp_path: Path) -> NatsUsers:
    return NatsUsers.prepare(tmp_path / "auth", TENANTS)


@pytest_asyncio.fixture(loop_scope="session")
async def guarded(users: NatsUsers, tmp_path: Path) -> AsyncIterator[str]:
    """A nats-server that lets in the generated role users only."""
    async with nats_server(tmp_path / "js", config={"authorization": users.authorization}) as s:
        yield s.url


def _violations(errors: list[object]) -> list[str]:
    return [str(e) for e in errors if "permissions violation" in str(e).lower()]


@pytest.mark.parametrize("role", ROLES)
async def test_each_attack_fails_for_every_role_that_should_not_do_it(
    guarded: str, users: NatsUsers, role: str
) -> None:
    refused: dict[str, asyncio.Event] = {}

    async def noted(exc: Exception) -> None:  # the server's -ERR names the subject
        for subject, event in refused.items():
            if f'"{subject.lower()}"' in str(exc).lower() and _violations([exc]):
                event.set()

    env = users.env(role)
    nc = await nats.connect(guarded, nkeys_seed=env["nats_nkey_file"],
                            inbox_prefix=env["nats_inbox_prefix"], error_cb=noted)  # fmt: skip
    try:
        for attack, (kind, subject, allowed) in ATTACKS.items():
            if role in allowed:
                continue  # its own work, proven end to end below
            refused[subject] = asyncio.Event()
            if kind == "sub":
                await nc.subscribe(subject)
            else:
                await nc.publish(subject, b"x")
            try:
                async with asyncio.timeout(5):
                    await refused[subject].wait()
            except TimeoutError:
                pytest.fail(f"{role} could {attack} ({kind} {subject}): no violation")
    finally:
        await nc.close()


async def test_an_unauthenticated_connection_is_refused(guarded: str) -> None:
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(guarded, allow_reconnect=False, max_reconnect_attempts=0)


async def render_queue_taken(
    url: str, ops: Settings, model: str = "deepseek-v4", batch: bool = False
) -> int:
    """How many requests the render workers took from their queue (`batch`: the jobs'
    lanes), read as the ops role (`ops`: its settings) reads the bus."""
    nc = await bus.connect(url, "test-ops", ops)
    try:
        spec = bus.render_consumer(ops, model, batch)
        listed = await nc.jetstream().consumers_info(spec.stream)  # what ops may read
        (info,) = [c for c in listed if c.name == spec.durable]
        return info.delivered.consumer_seq or 0
    finally:
        await nc.close()


@pytest.mark.parametrize("placement", ["pool", "ingress"])
async def test_every_stage_runs_end_to_end_as_its_own_role(
    guarded: str,
    users: NatsUsers,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    placement: str,
) -> None:
    """With the render stage beside the ingress (`--render-placement ingress`, as `up`
    runs it) it still renders, admits and queues as the render role, over its own
    connection: the ingress's user never gained a right, and no request took the render
    queue's stored hop."""
    caplog.set_level(logging.WARNING)
    # A limited tenant: render admits by the tenants' bucket, the owners release in it.
    key = "sk-limited-0123456789abcdef"
    settings = make_settings(
        tmp_path, derender_placement="pool", api_key=key, tenant_concurrency=4,
        tenant_tokens_per_minute=10**6, render_placement=placement,
    )  # fmt: skip
    names = ["ingress", "render", "schedule", "derender", "dlq", "sim"]
    stack = await start_stack(guarded, settings, names, users)
    ops = {f"TOKENWAY_{k.upper()}": v for k, v in users.env("ops").items()}
    try:
        client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0)
        chat = [{"role": "user", "content": "hi"}]
        text = ""
        async for chunk in await client.chat.completions.create(
            model="deepseek-v4", messages=chat, max_tokens=5, stream=True
        ):
            text += "".join(c.delta.content or "" for c in chunk.choices)
        assert text
        several = await client.completions.create(
            model="deepseek-v4", prompt=["one", "two"], max_tokens=3
        )  # the schedule role's multi-prompt path
        assert len(several.choices) == 2
        kept = await client.responses.create(model="deepseek-v4", input="hi", max_output_tokens=3)
        assert (await client.responses.retrieve(kept.id)).id == kept.id  # the ingress's bucket
        raw = await client.chat.completions.with_raw_response.create(
            model="deepseek-v4", messages=chat, max_tokens=4, stream=True
        )
        rid = raw.headers["x-tokenway-stream-id"]
        [_ async for _ in raw.parse()]
        auth = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=stack.url, headers=auth) as http:  # reads TW_OUT
            resumed = await http.get(f"/v1/streams/{rid}")
            tokenized = await http.post("/tokenize", json={"prompt": "hi"})  # render answers
        assert resumed.status_code == 200 and resumed.text.endswith("data: [DONE]\n\n")
        assert tokenized.status_code == 200 and tokenized.json()["count"] > 0
        proc = await spawn("status", "--json", "--nats", guarded, env=ops)
        out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        seen = msgspec.json.decode(out)
        assert seen["engines"] and not seen["missing"]
        queues = {c["name"] for s in seen["streams"] for c in s["consumers"]}
        assert queues >= {"render-deepseek-v4", "schedule-deepseek-v4"}
        taken = await render_queue_taken(guarded, users.settings(stack.settings, "ops"))
        assert taken == 0 if placement == "ingress" else taken >= 4, taken
    finally:
        await stack.close()
    proc = await spawn("dlq", "ls", "--nats", guarded, env=ops)
    out, err = await proc.communicate()
    assert proc.returncode == 0 and out.startswith(b"ID "), err.decode()
    assert not _violations([r.getMessage() for r in caplog.records]), caplog.text
    assert "stays until its deadline" not in caplog.text  # every lease was given back
    assert "cannot look at TW_OUT's room" not in caplog.text  # the ingress's admission reads


async def test_nats_auth_writes_a_configuration_nats_server_accepts(tmp_path: Path) -> None:
    proc = await spawn("nats-auth", str(tmp_path / "auth"), "--tenant", "acme")
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    for role in ROLES:
        assert (tmp_path / "auth" / f"{role}.nk").stat().st_mode & 0o077 == 0
        env = (tmp_path / "auth" / f"{role}.env").read_text()
        assert f"TOKENWAY_NATS_INBOX_PREFIX=_INBOX.{role}" in env
    seeds = {r: (tmp_path / "auth" / f"{r}.nk").read_bytes() for r in ROLES}
    again = await spawn("nats-auth", str(tmp_path / "auth"), "--tenant", "acme")
    await again.communicate()
    assert seeds == {r: (tmp_path / "auth" / f"{r}.nk").read_bytes() for r in ROLES}  # kept
    routes = tmp_path / "auth" / "routes.conf"  # a cluster's route credentials, as secret
    assert routes.stat().st_mode & 0o077 == 0
    assert "nats-route://tokenway-route:" in routes.read_text()
    conf = tmp_path / "server.conf"
    conf.write_text("port: -1\ninclude ./auth/auth.conf\n")
    check = await asyncio.create_subprocess_exec(
        server_binary(), "-c", str(conf), "-t",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await check.communicate()
    assert check.returncode == 0, out.decode()


async def test_a_stage_that_does_not_provision_waits_for_the_streams(
    guarded: str, users: NatsUsers, tmp_path: Path
) -> None:
    settings = make_settings(tmp_path)
    render = users.settings(msgspec.structs.replace(settings, nats=guarded), "render")
    waiting = Logged("run `tokenway provision`")
    logging.getLogger("tokenway.bus").addHandler(waiting)
    serving = asyncio.create_task(serve(render, [], asyncio.Event()))
    try:
        await asyncio.wait_for(waiting.event.wait(), 30)
        assert not serving.done()
        provision = {f"TOKENWAY_{k.upper()}": v for k, v in users.env("provision").items()}
        proc = await spawn("provision", "--nats", guarded, "--data-dir", str(tmp_path),
                           env=provision)  # fmt: skip
        _, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        await asyncio.wait_for(serving, 30)  # finds them, runs nothing
    finally:
        serving.cancel()
        logging.getLogger("tokenway.bus").removeHandler(waiting)
