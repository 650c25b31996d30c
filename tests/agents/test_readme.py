"""docs/agents.md configures the clients as the tier does (these run in the main suite: they
need no client)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.agents.test_claude_code import MODEL_VARS, QUIET
from tests.agents.test_codex import provider_config

AGENTS = Path(__file__).resolve().parents[2] / "docs" / "agents.md"
URL = "http://127.0.0.1:8000"  # the address the documentation's examples use


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", AGENTS.read_text(), re.S)


def test_the_codex_provider_block_is_the_tiers() -> None:
    assert blocks("toml") == [provider_config(URL)]


def test_the_claude_code_variables_are_the_tiers() -> None:
    script = blocks("sh")[0]
    assert f"ANTHROPIC_BASE_URL={URL} " in script
    for var in MODEL_VARS:
        assert re.search(rf"\b{var}\b", script), var
    for var in QUIET:
        assert f"{var}=1" in script, var
