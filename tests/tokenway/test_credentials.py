"""NATS credentials on every stage and command, against real nats-servers that ask for them:
user and password, token, nkey, a `.creds` JWT (operator mode) and mutual TLS."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import nkeys
import openai
import pytest
import pytest_asyncio
import trustme

from tests.conftest import make_settings, nats_server, start_stack
from tests.natsauth import new_key, operator_mode, public
from tests.test_cli import spawn
from tokenway import bus
from tokenway.config import Settings
from tokenway.credentials import connect_options
from tokenway.errors import CannotStart

PASSWORD = "pw-0123456789abcdef"
TOKEN = "tok-0123456789abcdef"


def _secret_file(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


async def _round_trip(url: str, settings: Settings) -> None:
    """Connect with the settings' credentials and see a message come back."""
    nc = await bus.connect(url, "test-credentials", settings)
    try:
        sub = await nc.subscribe("tw.test.echo")
        await nc.publish("tw.test.echo", b"hi")
        assert (await sub.next_msg(timeout=5)).data == b"hi"
    finally:
        await nc.close()


def _kinds(tmp: Path) -> dict[str, tuple[dict[str, object], dict[str, str], dict[str, str]]]:
    """Each way to authenticate: the server's configuration, good and wrong credentials."""
    user = new_key(nkeys.PREFIX_BYTE_USER)
    stranger = new_key(nkeys.PREFIX_BYTE_USER)
    operator, creds = operator_mode()
    _, other_creds = operator_mode()  # a user of an operator this server does not trust
    return {
        "password": (
            {"authorization": {"users": [{"user": "tw", "password": PASSWORD}]}},
            {"nats_user": "tw", "nats_password_file": _secret_file(tmp / "pw", PASSWORD + "\n")},
            {"nats_user": "tw", "nats_password": "wrong"},
        ),
        "token": (
            {"authorization": {"token": TOKEN}},
            {"nats_token_file": _secret_file(tmp / "token", TOKEN)},
            {"nats_token": "wrong"},
        ),
        "nkey": (
            {"authorization": {"users": [{"nkey": public(user)}]}},
            {"nats_nkey_file": _secret_file(tmp / "user.nk", user.seed.decode())},
            {"nats_nkey_file": _secret_file(tmp / "stranger.nk", stranger.seed.decode())},
        ),
        "creds": (
            operator,
            {"nats_creds": _secret_file(tmp / "tw.creds", creds)},
            {"nats_creds": _secret_file(tmp / "other.creds", other_creds)},
        ),
    }


@pytest.mark.parametrize("kind", ["password", "token", "nkey", "creds"])
async def test_each_way_to_authenticate_connects_and_a_wrong_one_cannot(
    tmp_path: Path, kind: str
) -> None:
    config, good, wrong = _kinds(tmp_path)[kind]
    async with nats_server(tmp_path / "js", config=config) as server:
        await _round_trip(server.url, Settings(**good))
        with pytest.raises(CannotStart, match="Authorization Violation"):
            await _round_trip(server.url, Settings(connect_timeout=1.0, **wrong))
        with pytest.raises(CannotStart, match="Authorization Violation"):
            await _round_trip(server.url, Settings(connect_timeout=1.0))  # none at all


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def _tls_files(ca: trustme.CA, tmp: Path, name: str) -> dict[str, str]:
    cert = ca.issue_cert(name)
    cert.cert_chain_pems[0].write_to_path(tmp / f"{name}.pem")
    cert.private_key_pem.write_to_path(tmp / f"{name}.key")
    return {"cert": str(tmp / f"{name}.pem"), "key": str(tmp / f"{name}.key")}


async def test_mutual_tls_with_a_ca_a_client_certificate_and_its_key(
    tmp_path: Path, ca: trustme.CA
) -> None:
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    server_files = _tls_files(ca, tmp_path, "127.0.0.1")
    client = _tls_files(ca, tmp_path, "tokenway-client")
    tls = {"cert_file": server_files["cert"], "key_file": server_files["key"],
           "ca_file": str(tmp_path / "ca.pem"), "verify": True}  # fmt: skip
    async with nats_server(tmp_path / "js", config={"tls": tls}) as server:
        trusted = {"nats_tls_ca": str(tmp_path / "ca.pem")}
        await _round_trip(server.url, Settings(
            **trusted, nats_tls_cert=client["cert"], nats_tls_key=client["key"]
        ))  # fmt: skip
        with pytest.raises(CannotStart):  # no client certificate: the server refuses
            await _round_trip(server.url, Settings(connect_timeout=1.0, **trusted))
        with pytest.raises(CannotStart):  # a server whose CA we do not trust
            await _round_trip(server.url, Settings(
                connect_timeout=1.0, nats_tls_cert=client["cert"], nats_tls_key=client["key"]
            ))  # fmt: skip


@pytest.mark.parametrize(
    "given, why",
    [
        ({"nats_user": "tw"}, "go together"),
        ({"nats_password": PASSWORD}, "go together"),
        ({"nats_token": TOKEN, "nats_user": "tw", "nats_password": PASSWORD}, "one way"),
        ({"nats_token": TOKEN, "nats_token_file": "/etc/hostname"}, "not both"),
        ({"nats_token": "  "}, "set but empty"),
        ({"nats_token_file": "/nonexistent/token"}, "cannot read --nats-token-file"),
        ({"nats_creds": "/nonexistent/tw.creds"}, "cannot read --nats-creds"),
        ({"nats_tls_cert": "/etc/hostname"}, "go together"),
    ],
)
def test_credentials_that_cannot_work_refuse_to_start(given: dict[str, str], why: str) -> None:
    with pytest.raises(CannotStart, match=why) as raised:
        connect_options(Settings(**given))
    assert PASSWORD not in str(raised.value) and TOKEN not in str(raised.value)


def test_a_password_in_a_url_is_not_logged() -> None:
    url = "nats://tw:sekrit@10.0.0.1:4222, nats://tok3n@10.0.0.2:4222,nats://10.0.0.3:4222"
    shown = bus.redacted(url)
    assert "sekrit" not in shown and "tok3n" not in shown
    assert shown.count("***@") == 2 and "10.0.0.3:4222" in shown


@pytest_asyncio.fixture(loop_scope="session")
async def guarded(tmp_path: Path) -> AsyncIterator[str]:
    """A nats-server that serves a token holder only."""
    async with nats_server(tmp_path / "js", config={"authorization": {"token": TOKEN}}) as s:
        yield s.url


async def test_every_stage_and_the_dlq_command_run_with_credentials(
    guarded: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    token_file = _secret_file(tmp_path / "token", TOKEN)
    settings = make_settings(tmp_path, nats_token_file=token_file)
    stack = await start_stack(guarded, settings, ["ingress", "render", "schedule", "dlq", "sim"])
    try:
        client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="-", max_retries=0)
        resp = await client.completions.create(model="deepseek-v4", prompt="hi", max_tokens=3)
        assert resp.usage.completion_tokens > 0
    finally:
        await stack.close()
    proc = await spawn("dlq", "ls", "--nats", guarded, "--nats-token-file", token_file)
    out, err = await proc.communicate()
    assert proc.returncode == 0 and out.startswith(b"ID "), err.decode()
    refused = await spawn("dlq", "ls", "--nats", guarded)
    _, err = await refused.communicate()
    assert refused.returncode == 1 and b"Authorization Violation" in err
    assert TOKEN not in caplog.text
