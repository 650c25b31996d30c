"""The agents tier: the agent clients people run, each against a `tokenway up` of its own
kind (the simulated engine, `up`'s default), with an API key file as a team runs it.

`.ci/agents-tier` installs the clients and runs `python -m pytest -m agents tests/agents`
with:

- `TOKENWAY_TEST_CLAUDE`: the `claude` binary (`@anthropic-ai/claude-code`);
- `TOKENWAY_TEST_CODEX`: the `codex` binary (`@openai/codex`);
- `TOKENWAY_TEST_AGENTS_PYTHON`: a python that imports `agents` (`openai-agents`).

A test marked `agents(VAR)` is skipped where VAR is unset, and then nothing is started.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.test_cli import stop
from tests.test_up import Up, start_up

CLAUDE_ENV = "TOKENWAY_TEST_CLAUDE"
CODEX_ENV = "TOKENWAY_TEST_CODEX"
PYTHON_ENV = "TOKENWAY_TEST_AGENTS_PYTHON"
TENANT, KEY = "agents", "sk-agents-0123456789abcdef"
RUN_SECONDS = 90  # one client's run, start to exit


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        marker = item.get_closest_marker("agents")
        if marker is None:
            continue
        unset = [name for name in marker.args if not os.environ.get(name)]
        if unset:
            reason = f"no agent client: {', '.join(unset)} unset (.ci/agents-tier sets them)"
            item.add_marker(pytest.mark.skip(reason=reason))


def client(name: str) -> Path:
    return Path(os.environ[name])


@pytest_asyncio.fixture(scope="package", loop_scope="session")
async def up(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Up]:
    """`tokenway up` serving `MODEL`, with one tenant's key. Its simulated model calls a tool
    where the last turn is a user's and answers a tool's output in text (`--sim-tool-calls`;
    `--tool-strict-level function` gives the engine the tools under tool_choice auto), so
    each client's tool loop runs."""
    data = tmp_path_factory.mktemp("agents-up")
    (data / "keys").write_text(f"{TENANT} {KEY}\n")
    running = await start_up(data, "--api-key-file", str(data / "keys"),
                             "--tool-strict-level", "function", "--sim-tool-calls")  # fmt: skip
    running.key, running.tenant = KEY, TENANT
    try:
        yield running
    finally:
        await stop(running.proc, signal.SIGKILL)


def clean_env(home: Path, **more: str) -> dict[str, str]:
    """A client's environment: this machine's PATH and locale, a home of its own (no one's
    login, settings or history), and `more`; nothing else of this process's."""
    home.mkdir(parents=True, exist_ok=True)
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TMPDIR")}
    return {**keep, "HOME": str(home), **more}


async def run(command: list[str], env: dict[str, str], cwd: Path, up: Up) -> tuple[int, str, str]:
    """`command` to its exit (its stdin empty); its status, stdout and stderr. A run that
    outlives RUN_SECONDS is killed and fails the test with the tail of `up`'s log."""
    proc = await asyncio.create_subprocess_exec(
        *command, env=env, cwd=cwd, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), RUN_SECONDS)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        pytest.fail(f"{command[0]} ran past {RUN_SECONDS}s; up's log:\n{up.log[-3000:]}")
    return proc.returncode or 0, out.decode(), err.decode()
