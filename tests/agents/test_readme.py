"""The README's Agent clients section configures the clients as the tier does (these run in
the main suite: they need no client)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.agents.test_claude_code import MODEL_VARS, QUIET
from tests.agents.test_codex import provider_config

README = Path(__file__).resolve().parents[2] / "README.md"
URL = "http://127.0.0.1:8000"  # the address the README's examples use


def section() -> str:
    text = README.read_text()
    start = text.index("### Agent clients\n")
    return text[start : text.index("\n### ", start + 1)]


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section(), re.S)


def test_the_codex_provider_block_is_the_tiers() -> None:
    assert blocks("toml") == [provider_config(URL)]


def test_the_claude_code_variables_are_the_tiers() -> None:
    script = blocks("sh")[0]
    assert f"ANTHROPIC_BASE_URL={URL} " in script
    for var in MODEL_VARS:
        assert re.search(rf"\b{var}\b", script), var
    for var in QUIET:
        assert f"{var}=1" in script, var
