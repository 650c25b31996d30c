"""Deliberate stops: an ingress exits at once on SIGTERM when it has no open stream, a
draining schedule worker hands its streams to a peer without waiting for anything to expire
and says so, and an engine that stops on purpose is told apart from one that went silent."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx
import pytest

from tests.conftest import Stack
from tests.test_cli import free_port, logged, spawn

pytestmark = pytest.mark.asyncio(loop_scope="session")

# nats-py waits 30 s (its drain_timeout) for a subscription that cannot drain before it
# gives up with a DrainTimeoutError: an exit that waits for less than that either drained
# everything or was never held up. A prompt exit takes well under a second.
BELOW_THE_DRAIN_HANG = 15.0


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
