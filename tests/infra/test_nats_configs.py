"""The shipped NATS configs are valid for the nats-server we ship, with the authorization
`tokenway nats-auth` writes beside them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tokenway.nats_users import NatsUsers
from tokenway.natsd import server_binary

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "infra" / "nats").glob("*.conf"))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_nats_config_is_valid(config: Path, tmp_path: Path) -> None:
    shutil.copy(config, tmp_path / config.name)
    NatsUsers.prepare(tmp_path / "auth")
    result = subprocess.run(
        [server_binary(), "-t", "-c", str(tmp_path / config.name)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "is valid" in result.stdout + result.stderr


def test_configs_exist() -> None:
    assert {p.name for p in CONFIGS} >= {"single.conf", "cluster-a.conf"}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_no_config_opens_the_bus_or_its_monitoring_to_the_world(config: Path) -> None:
    text = config.read_text()
    assert "include ./auth/auth.conf" in text
    assert "http: 127.0.0.1:" in text


# Which role each container of infra/compose.yaml and infra/k8s/ connects as, and what it
# mounts: tests/infra/test_manifests.py.
