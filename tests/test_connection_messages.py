"""A stage run alone with its role's seed, as an operator runs each stage from the users
`tokenway nats-auth` writes: its other settings follow from its role, and what happens to
its connection is one line that names the server and the reason."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import nkeys
import pytest
import pytest_asyncio

from tests.conftest import make_settings, nats_server
from tests.natsauth import new_key
from tests.test_cli import free_port, logged, spawn, stop
from tokenway import bus
from tokenway.nats_users import NatsUsers
from tokenway.natsd import EmbeddedNats


class Guarded:
    """A nats-server with the authorization `tokenway nats-auth` writes, its streams made
    by the provision role, and its monitoring port (to see the clients' names)."""

    def __init__(self, server: EmbeddedNats, users: NatsUsers, monitor: int) -> None:
        self.server, self.users, self.monitor = server, users, monitor

    @property
    def url(self) -> str:
        return self.server.url

    def seed(self, role: str) -> str:
        return str(self.users.directory / f"{role}.nk")

    def key(self, role: str) -> str:
        """The role's public key: the user the server says a client connected as."""
        return nkeys.from_seed(Path(self.seed(role)).read_bytes().strip()).public_key.decode()

    async def names(self, role: str) -> set[str]:
        """The names of the clients that connected as `role`, connected or closed since."""
        key = self.key(role)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.monitor}") as http:
            pages = [(await http.get("/connz", params={"state": s, "auth": "true"})).json()
                     for s in ("open", "closed")]  # fmt: skip
        clients = [c for page in pages for c in page.get("connections") or []]
        return {c.get("name", "") for c in clients if c.get("authorized_user") == key}


@pytest_asyncio.fixture(loop_scope="session")
async def guarded(tmp_path: Path) -> AsyncIterator[Guarded]:
    users = NatsUsers.prepare(tmp_path / "auth")
    monitor = free_port()
    config = {"authorization": users.authorization, "http_port": monitor}
    async with nats_server(tmp_path / "js", port=free_port(), config=config) as server:
        provision = users.settings(make_settings(tmp_path / "provision"), "provision")
        nc = await bus.connect(server.url, "tokenway-provision", provision)
        await bus.provision_streams(nc.jetstream(), provision)
        await nc.close()
        yield Guarded(server, users, monitor)


def _stage(guarded: Guarded, tmp_path: Path, stage: str, seed: str, *extra: str) -> list[str]:
    """A stage's command line: the server and a seed, nothing of the role's `.env`."""
    return [stage, "--nats", guarded.url, "--nats-nkey-file", seed,
            "--data-dir", str(tmp_path / "data"), *extra]  # fmt: skip


async def test_a_stage_with_only_its_roles_seed_starts_and_names_itself(
    guarded: Guarded, tmp_path: Path
) -> None:
    proc = await spawn(*_stage(guarded, tmp_path, "render", guarded.seed("render")))
    try:
        await logged(proc, b"render serving")  # subscribed to its queue, through its inbox
        names = await guarded.names("render")
    finally:
        assert await stop(proc) == 0
    assert names and all(n.startswith("tokenway-render") for n in names), names


@pytest.mark.parametrize("seed", ["another role's", "unknown"])
async def test_a_stage_with_a_wrong_seed_exits_with_one_line_naming_server_and_reason(
    guarded: Guarded, tmp_path: Path, seed: str
) -> None:
    if seed == "unknown":
        path = tmp_path / "stranger.nk"
        path.write_bytes(new_key(nkeys.PREFIX_BYTE_USER).seed)
        given, reason = str(path), "authorization violation"
    else:  # the derender user exists, but may not read render's inboxes or queue
        given, reason = guarded.seed("derender"), "permissions violation"
    # A connect timeout far beyond any start-up: the server's refusal ends the start.
    proc = await spawn(*_stage(guarded, tmp_path, "render", given, "--connect-timeout", "600"))
    _, err = await asyncio.wait_for(proc.communicate(), 120)
    said = err.decode()
    assert proc.returncode == 1, said
    assert "Traceback" not in said, said
    last = said.strip().splitlines()[-1]
    assert last.startswith(f"tokenway: cannot connect to {guarded.url}: "), said
    assert reason in last.lower(), said


async def test_a_stage_says_which_server_it_lost_and_which_it_reconnected_to(
    guarded: Guarded, tmp_path: Path
) -> None:
    proc = await spawn(*_stage(guarded, tmp_path, "schedule", guarded.seed("schedule")))
    try:
        await logged(proc, b"owning")
        await asyncio.to_thread(guarded.server.stop)
        await logged(proc, f"disconnected from {guarded.url}".encode())
        await guarded.server.start()  # the same port and store
        await logged(proc, f"reconnected to {guarded.url}".encode())
    finally:
        code = await stop(proc, signal.SIGTERM)
    assert code == 0


@pytest.mark.parametrize(
    "path", ["infra/nats/auth/render.nk", "infra/nats/auth/auth.conf", "infra/k8s/ops.creds"]
)
def test_the_seeds_the_readme_writes_into_infra_are_never_committed(path: str) -> None:
    root = Path(__file__).parent.parent
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    check = subprocess.run(["git", "check-ignore", "-q", path], cwd=root, check=False)
    assert check.returncode == 0, f"{path} is not ignored"


async def test_a_command_with_only_its_roles_seed_reads_the_bus_and_a_wrong_one_says_why(
    guarded: Guarded,
) -> None:
    ops = await spawn("status", "--nats", guarded.url, "--nats-nkey-file", guarded.seed("ops"))
    out, err = await asyncio.wait_for(ops.communicate(), 60)
    assert ops.returncode == 0, err.decode()
    assert b"engines" in out
    wrong = await spawn("status", "--nats", guarded.url, "--nats-nkey-file", guarded.seed("render"))
    _, err = await asyncio.wait_for(wrong.communicate(), 60)
    said = err.decode()
    assert wrong.returncode == 1 and "Traceback" not in said, said
    assert said.strip().startswith(f"tokenway: cannot connect to NATS at {guarded.url}: "), said
    assert "permissions violation" in said, said


async def test_a_role_told_to_provision_what_it_may_not_exits_with_one_line(
    guarded: Guarded, tmp_path: Path
) -> None:
    """The server says at once that render may not change a stream (to limits of its
    own): no retrying the requests it denies until the connect timeout, no traceback."""
    args = _stage(guarded, tmp_path, "render", guarded.seed("render"), "--provision",
                  "--connect-timeout", "600")  # fmt: skip
    proc = await spawn(*args, env={"TOKENWAY_QUEUE_MAX_MSGS": "7"})
    _, err = await asyncio.wait_for(proc.communicate(), 120)
    said = err.decode()
    assert proc.returncode == 1 and "Traceback" not in said, said
    last = said.strip().splitlines()[-1]
    assert last.startswith(f"tokenway: cannot connect to {guarded.url}: "), said
    assert "permissions violation for publish to" in last and "stream" in last, said


async def test_an_outage_is_said_once_then_now_and_then_not_at_every_attempt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A connection tries to get back every 0.5 s: each failed attempt was a line, 20 lines a
    second from the ten stages of `up` while a server restarted. The first is said, then one
    every OUTAGE_SAID_EVERY, and the reconnection says how many attempts failed."""
    caplog.set_level(logging.WARNING, logger="tokenway.bus")
    failed, enough, back = 0, asyncio.Event(), asyncio.Event()

    async def noted(exc: Exception) -> None:
        nonlocal failed
        failed += 1
        if failed == 6:
            enough.set()

    async def reconnected() -> None:
        back.set()

    async with nats_server(tmp_path / "js", port=free_port()) as server:
        nc = await bus.connect(server.url, "tokenway-outage", noted=noted,
                               reconnected=reconnected)  # fmt: skip
        try:
            await asyncio.to_thread(server.stop)
            await enough.wait()
            await server.start()
            await back.wait()
        finally:
            await nc.close()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tokenway-outage")]
    tried = [line for line in said if "cannot reach NATS" in line]
    assert len(tried) == 1 and "attempt 1;" in tried[0], said
    # Six errors heard: the server's goodbye (one line of its own), then failed attempts.
    (attempts,) = [
        m[1] for line in said if (m := re.search(r"reconnected to .* \(after (\d+) f", line))
    ]
    assert int(attempts) >= 5, said
