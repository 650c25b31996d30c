"""The shipped NATS configs are valid for the nats-server we ship, with the authorization
`tokenway nats-auth` writes beside them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tokenway import bus
from tokenway.nats_users import NatsUsers
from tokenway.natsd import server_binary
from tokenway.roles import roles

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


INFRA = Path(__file__).resolve().parents[2] / "infra"


def _check_role(command: list[str], env: dict[str, str]) -> str:
    role = command[0]  # `tokenway <stage>`, `engine sim`, `dlq move`: the role's name first
    assert env["TOKENWAY_NATS_NKEY_FILE"] == f"/auth/{role}.nk", command
    assert env["TOKENWAY_NATS_INBOX_PREFIX"] == bus.inbox_prefix(role), command
    return role


def test_every_container_connects_as_the_role_of_what_it_runs() -> None:
    compose = yaml.safe_load((INFRA / "compose.yaml").read_text())["services"]
    stages = {k: v for k, v in compose.items() if k not in ("nats", "nats-auth")}
    ran = {_check_role(s["command"], s["environment"]) for s in stages.values()}
    assert "4222:4222" not in str(compose["nats"]) and "8222" not in str(compose["nats"])
    for doc in yaml.safe_load_all((INFRA / "k8s" / "tokenway.yaml").read_text()):
        if doc["kind"] in ("Deployment", "Job"):
            (container,) = doc["spec"]["template"]["spec"]["containers"]
            env = {e["name"]: e["value"] for e in container["env"]}
            ran.add(_check_role(container["args"], env))
    assert ran == {r.name for r in roles()} - {"ops"}  # ops: a person's `tokenway dlq`
