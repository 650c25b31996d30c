"""The README's examples are files; they run against a live stack."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.conftest import Stack

pytestmark = pytest.mark.asyncio(loop_scope="session")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


async def run(stack: Stack, *cmd: str) -> str:
    env = {**os.environ, "TOKENWAY_URL": f"{stack.url}/v1"}
    proc = await asyncio.create_subprocess_exec(
        *cmd, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def test_sdk_example_streams_text(stack: Stack) -> None:
    out = await run(stack, sys.executable, str(EXAMPLES / "chat_stream.py"))
    assert out.strip()


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_curl_example_streams_sse(stack: Stack) -> None:
    out = await run(stack, "sh", str(EXAMPLES / "curl.sh"))
    assert out.startswith("data: {") and "\nid:" not in out
    assert out.endswith("data: [DONE]\n\n")
