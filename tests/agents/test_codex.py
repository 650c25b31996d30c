"""Codex (`codex exec`) with its default tools on tokenway's Responses API, configured by a
provider block as docs/agents.md says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.agents.conftest import CODEX_ENV, KEY, clean_env, client, run
from tests.test_up import MODEL, Up

pytestmark = [pytest.mark.agents(CODEX_ENV), pytest.mark.asyncio(loop_scope="session")]


def provider_config(url: str) -> str:
    """`$CODEX_HOME/config.toml`: the model and a provider that speaks Responses to `up` at
    `url`, its key read from TOKENWAY_API_KEY."""
    return (
        f'model = "{MODEL}"\n'
        'model_provider = "tokenway"\n'
        "\n"
        "[model_providers.tokenway]\n"
        'name = "tokenway"\n'
        f'base_url = "{url}/v1"\n'
        'env_key = "TOKENWAY_API_KEY"\n'
        'wire_api = "responses"\n'
    )


def events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


async def test_exec_with_default_tools_runs_a_command_and_ends_in_text(
    up: Up, tmp_path: Path
) -> None:
    codex_home = tmp_path / "codex"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(provider_config(up.url))
    env = clean_env(tmp_path / "home", CODEX_HOME=str(codex_home), TOKENWAY_API_KEY=KEY)
    # `up`'s model calls Codex's first tool with made-up arguments (a city's name for a
    # command): it runs in a read-only sandbox, in this test's directory, never asking.
    command = [str(client(CODEX_ENV)), "exec", "--json", "--skip-git-repo-check",
               "--sandbox", "read-only", "-c", 'approval_policy="never"',
               "List the files."]  # fmt: skip
    status, out, err = await run(command, env, tmp_path, up)
    assert status == 0, f"codex exited {status}: {err[-2000:]}\n{out[-2000:]}"
    seen = events(out)
    assert [e["type"] for e in seen if e["type"].startswith("turn.")] == [
        "turn.started", "turn.completed"]  # fmt: skip
    # the round trip: a command Codex ran (its output goes back to the model), then text
    done_items = [e["item"] for e in seen if e["type"] == "item.completed"
                  and e["item"]["type"] in ("command_execution", "agent_message")]  # fmt: skip
    assert [item["type"] for item in done_items] == ["command_execution", "agent_message"], seen
    ran, said = done_items
    assert ran["command"] and ran["exit_code"] is not None, ran
    assert said["text"].strip(), said
    [done] = [e for e in seen if e["type"] == "turn.completed"]
    assert done["usage"]["input_tokens"] > 0 and done["usage"]["output_tokens"] > 0
