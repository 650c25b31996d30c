"""The shipped NATS configs are valid for the nats-server we ship."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tokenway.natsd import server_binary

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "infra" / "nats").glob("*.conf"))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_nats_config_is_valid(config: Path) -> None:
    result = subprocess.run(
        [server_binary(), "-t", "-c", str(config)], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    assert "is valid" in result.stdout + result.stderr


def test_configs_exist() -> None:
    assert {p.name for p in CONFIGS} >= {"single.conf", "cluster-a.conf"}
