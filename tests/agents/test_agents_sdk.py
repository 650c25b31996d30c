"""The OpenAI Agents SDK's tool loop on tokenway, on Responses and on Chat Completions,
streamed and not (`sdk_agent.py`, run by the tier's python, which has `openai-agents`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.agents.conftest import KEY, PYTHON_ENV, client, run
from tests.test_up import MODEL, Up

pytestmark = [pytest.mark.agents(PYTHON_ENV), pytest.mark.asyncio(loop_scope="session")]

AGENT = Path(__file__).with_name("sdk_agent.py")


@pytest.mark.parametrize("mode", ["run", "streamed"])
@pytest.mark.parametrize("api", ["responses", "chat"])
async def test_a_forced_tool_call_runs_the_tool_and_a_text_answer_follows(
    up: Up, tmp_path: Path, api: str, mode: str
) -> None:
    env = {**os.environ, "TOKENWAY_AGENT_KEY": KEY}
    command = [str(client(PYTHON_ENV)), str(AGENT), f"{up.url}/v1", MODEL, api, mode]
    status, out, err = await run(command, env, tmp_path, up)
    assert status == 0, f"the agent exited {status}: {err[-3000:]}"
    ran = json.loads(out.splitlines()[-1])
    assert len(ran["calls"]) == 1 and ran["calls"][0]["city"], ran  # the tool ran, once
    assert ran["items"] == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    assert isinstance(ran["final_output"], str) and ran["final_output"].strip(), ran
    assert (ran["stream_events"] > 0) == (mode == "streamed"), ran
