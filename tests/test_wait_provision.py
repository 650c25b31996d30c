"""A stage that does not provision (`TOKENWAY_PROVISION=false`, as compose and Kubernetes run
every role) waits for `tokenway provision` instead of exiting: one line says what for, and
it starts once the streams exist; SIGTERM ends the wait cleanly."""

from __future__ import annotations

import asyncio
import re
import signal
from pathlib import Path

import pytest

from tests.conftest import guarded_bus, make_settings
from tests.test_cli import logged, spawn, stop
from tokenway import bus

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def waiting(proc: asyncio.subprocess.Process) -> None:
    """Until the stage says it waits for a stream, and who makes it."""
    assert proc.stderr is not None
    async with asyncio.timeout(60):
        while b"waiting for stream" not in (line := await proc.stderr.readline()):
            assert line, "the process exited instead of waiting for the streams"
    assert re.search(rb"waiting for stream TW_[A-Z]+: run `tokenway provision`", line), line


async def test_a_stage_started_before_provision_waits_then_serves(tmp_path: Path) -> None:
    async with guarded_bus(tmp_path / "nats") as server:
        env = server.env("render")
        assert env["TOKENWAY_PROVISION"] == "false"
        render = await spawn("render", "--data-dir", str(tmp_path / "data"), env=env)
        try:
            await waiting(render)
            provision = server.role(make_settings(tmp_path / "provision"), "provision")
            nc = await bus.connect(server.url, "tokenway-provision", provision)
            await bus.provision_streams(nc.jetstream(), provision)
            await nc.close()
            await logged(render, b"render serving")
        finally:
            code = await stop(render, signal.SIGTERM)
        assert code == 0


async def test_sigterm_ends_the_wait_for_provision_cleanly(tmp_path: Path) -> None:
    async with guarded_bus(tmp_path / "nats") as server:
        render = await spawn("render", "--data-dir", str(tmp_path / "data"),
                             env=server.env("render"))  # fmt: skip
        await waiting(render)
        assert await stop(render, signal.SIGTERM) == 0
        assert render.stderr is not None
        assert b"Traceback" not in await render.stderr.read()
