"""Claude Code (`claude -p`) on tokenway's Messages API, configured as docs/agents.md says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.agents.conftest import CLAUDE_ENV, KEY, clean_env, client, run
from tests.test_up import MODEL, Up

pytestmark = [pytest.mark.agents(CLAUDE_ENV), pytest.mark.asyncio(loop_scope="session")]

# Every model Claude Code picks for a task (its main loop, the small fast model for titles
# and summaries, each named tier, subagents): the one model `up` serves.
MODEL_VARS = (
    "ANTHROPIC_MODEL",
    "ANTHROPIC_SMALL_FAST_MODEL",
    "ANTHROPIC_DEFAULT_HAIKU_MODEL",
    "ANTHROPIC_DEFAULT_SONNET_MODEL",
    "ANTHROPIC_DEFAULT_OPUS_MODEL",
    "CLAUDE_CODE_SUBAGENT_MODEL",
)
# Nothing but the model's requests leaves the process: no telemetry, error reports,
# update checks or other calls to Anthropic.
QUIET = (
    "DISABLE_TELEMETRY",
    "DISABLE_ERROR_REPORTING",
    "DISABLE_AUTOUPDATER",
    "DISABLE_BUG_COMMAND",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC",
)


def claude_env(up: Up, home: Path, key_var: str) -> dict[str, str]:
    models = dict.fromkeys(MODEL_VARS, MODEL)
    return clean_env(home, ANTHROPIC_BASE_URL=up.url, **{key_var: KEY}, **models,
                     **dict.fromkeys(QUIET, "1"))  # fmt: skip


def events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


# ANTHROPIC_API_KEY goes as x-api-key, ANTHROPIC_AUTH_TOKEN as a bearer token: `up` takes both.
@pytest.mark.parametrize("key_var", ["ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN"])
async def test_a_print_mode_turn_runs_a_tool_and_ends_in_visible_text(
    up: Up, tmp_path: Path, key_var: str
) -> None:
    # The one tool is Read (read-only; `up`'s model calls the tool the prompt names, its
    # arguments made up): Claude Code runs it in this test's directory and sends its result.
    command = [str(client(CLAUDE_ENV)), "-p", "Use Read on notes.txt.", "--tools", "Read",
               "--output-format", "stream-json", "--verbose"]  # fmt: skip
    status, out, err = await run(command, claude_env(up, tmp_path / "home", key_var), tmp_path, up)
    assert status == 0, f"claude exited {status}: {err[-2000:]}\n{out[-2000:]}"
    seen = events(out)
    [result] = [e for e in seen if e["type"] == "result"]
    assert result["subtype"] == "success" and not result["is_error"], result
    assert result["result"].strip(), result  # visible text, not a thinking block alone
    assert set(result["modelUsage"]) == {MODEL}, result["modelUsage"]
    [init] = [e for e in seen if e["type"] == "system" and e.get("subtype") == "init"]
    assert init["model"] == MODEL
    blocks = [(e["type"], b) for e in seen if e["type"] in ("assistant", "user")
              for b in e["message"]["content"] if isinstance(b, dict)]  # fmt: skip
    # the round trip: the model's call, the result Claude Code sent back, then text
    kinds = [b["type"] for _, b in blocks if b["type"] in ("tool_use", "tool_result", "text")]
    assert kinds == ["tool_use", "tool_result", "text"], blocks
    [use] = [b for _, b in blocks if b["type"] == "tool_use"]
    [sent] = [b for _, b in blocks if b["type"] == "tool_result"]
    assert use["name"] == "Read" and sent["tool_use_id"] == use["id"], (use, sent)
    [said] = [b["text"] for kind, b in blocks if b["type"] == "text"]
    assert said.strip() == result["result"].strip()
