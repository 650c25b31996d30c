"""The shipped NATS configs are valid for the nats-server we ship, with the authorization
`tokenway nats-auth` writes beside them; the three cluster configs, with the route
credentials and certificates an operator makes, form a cluster that refuses other routes."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.cluster import Cluster, Node, stopped
from tests.test_cli import free_port
from tokenway.nats_users import LOCAL_ROUTES, NatsUsers, write_routes
from tokenway.natsd import server_binary

NATS = Path(__file__).resolve().parents[2] / "infra" / "nats"
CONFIGS = sorted(NATS.glob("*.conf"))
NODES = ("a", "b", "c")


def make_certificates(tls: Path, nodes: dict[str, str]) -> None:
    """The operator's openssl steps: a CA for the cluster's routes, and for each node (name:
    its subjectAltName) a key and a certificate the CA signed, good as server and client."""
    tls.mkdir(parents=True, exist_ok=True)
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=tls, check=True, capture_output=True)

    if not (tls / "ca.pem").exists():  # a node added later is signed by the same CA
        openssl("req", "-x509", *key, "-days", "3650", "-subj", "/CN=tokenway-routes-ca",
                "-keyout", "ca.key", "-out", "ca.pem")  # fmt: skip
    for name, names in nodes.items():
        openssl("req", *key, "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                "-out", f"{name}.csr")  # fmt: skip
        (tls / f"{name}.ext").write_text(
            f"subjectAltName={names}\nextendedKeyUsage=serverAuth,clientAuth\n"
        )
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "825", "-extfile", f"{name}.ext",
                "-out", f"{name}.pem")  # fmt: skip


def operator_files(folder: Path, routes: tuple[str, ...] = LOCAL_ROUTES) -> None:
    """What an operator makes beside the configs, in `folder`/auth: `tokenway nats-auth`'s
    users and route credentials, and the routes' certificates."""
    auth = folder / "auth"
    NatsUsers.prepare(auth)
    write_routes(auth, routes)
    make_certificates(auth / "tls", {f"tokenway-{n}": "IP:127.0.0.1" for n in NODES})


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_nats_config_is_valid(config: Path, tmp_path: Path) -> None:
    shutil.copy(config, tmp_path / config.name)
    operator_files(tmp_path)
    result = subprocess.run(  # from the config's directory, as its comments say
        [server_binary(), "-t", "-c", config.name],
        capture_output=True, text=True, timeout=30, cwd=tmp_path,
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


@pytest.mark.parametrize("node", NODES)
def test_every_cluster_config_authenticates_its_routes_in_tls(node: str) -> None:
    text = (NATS / f"cluster-{node}.conf").read_text()
    cluster = text[text.index("cluster {") :]
    assert "include ./auth/routes.conf" in cluster
    assert f'cert_file: "./auth/tls/tokenway-{node}.pem"' in cluster
    assert 'ca_file: "./auth/tls/ca.pem"' in cluster and "verify: true" in cluster
    assert "routes:" not in text  # the routes carry the credentials: routes.conf's
    assert "--replicas 3" not in text


@contextlib.asynccontextmanager
async def shipped_cluster(tmp: Path) -> AsyncIterator[Cluster]:
    """The three shipped cluster configs on free ports, with what the operator makes, each
    nats-server started from the configs' directory."""
    ports = {n: (free_port(), free_port(), free_port()) for n in NODES}  # client, http, route
    operator_files(tmp, tuple(f"127.0.0.1:{ports[n][2]}" for n in NODES))
    nodes = []
    for i, name in enumerate(NODES):
        text = (NATS / f"cluster-{name}.conf").read_text()
        for shipped, port in zip((4222 + i, 8222 + i, 6222 + i), ports[name], strict=True):
            text = text.replace(f"127.0.0.1:{shipped}", f"127.0.0.1:{port}")
        text = text.replace(f"/tmp/tokenway-nats-{name}", str(tmp / f"store-{name}"))
        conf = tmp / f"cluster-{name}.conf"
        conf.write_text(text)
        nodes.append(Node(f"tokenway-{name}", *ports[name], tmp / f"store-{name}", conf,
                          tmp / f"{name}.log"))  # fmt: skip
    cluster = Cluster(nodes)
    try:
        for node in nodes:
            start(node, tmp)
        yield cluster
    finally:
        await cluster.close()


def start(node: Node, cwd: Path) -> None:
    with open(node.log, "ab") as log:
        node.proc = subprocess.Popen([server_binary(), "-c", str(node.conf)], cwd=cwd,
                                     stdout=log, stderr=subprocess.STDOUT)  # fmt: skip


async def until_logged(node: Node, pattern: str, timeout: float = 10) -> str:
    """Until the node's log has a line matching `pattern`: that line."""
    async with asyncio.timeout(timeout):
        while True:  # a separate process: nothing to wait on but its log
            if found := re.search(f".*{pattern}.*", node.log.read_text(errors="replace")):
                return found.group(0)
            await asyncio.sleep(0.05)


@pytest.mark.asyncio(loop_scope="session")
async def test_the_cluster_configs_form_a_cluster_over_authenticated_tls_routes(
    tmp_path: Path,
) -> None:
    async with shipped_cluster(tmp_path) as cluster:
        for node in cluster.nodes:  # a meta leader elected, over the routes
            await cluster.healthy(node, timeout=10)
        a = cluster.nodes[0]

        async def meta(node: Node) -> dict:
            jsz = await cluster.http.get(f"http://127.0.0.1:{node.monitor}/jsz")
            return jsz.json()["meta_cluster"]

        async with asyncio.timeout(10):  # until the meta leader counts the three nodes current
            while True:
                if leader := (await meta(a)).get("leader"):
                    led = await meta(cluster.node(leader))
                    peers = [p for p in led.get("replicas", []) if p.get("current")]
                    if led["cluster_size"] == 3 and len(peers) == 2:
                        break
                await asyncio.sleep(0.05)  # a separate process: nothing to wait on but polls
        routez = (await cluster.http.get(f"http://127.0.0.1:{a.monitor}/routez")).json()
        assert {r["remote_name"] for r in routez["routes"]} == {"tokenway-b", "tokenway-c"}


def intruder(
    tmp: Path, name: str, route: int, password: str | None, tls: str | None, ca: str = ""
) -> Node:
    """A nats-server routing to port `route`: with the route password or not, with a
    certificate from `tls` (a folder of make_certificates' files; trusting `ca`, else that
    folder's CA) or in plain text."""
    creds = f"tokenway-route:{password}@" if password else ""
    certs = ""
    if tls:
        certs = (f'tls {{\n  cert_file: "{tls}/{name}.pem"\n  key_file: "{tls}/{name}.key"\n'
                 f'  ca_file: "{ca or tls + "/ca.pem"}"\n  verify: true\n }}')  # fmt: skip
    conf = tmp / f"{name}.conf"
    conf.write_text(
        f"server_name: {name}\nlisten: 127.0.0.1:{free_port()}\n"
        f"cluster {{\n name: tokenway\n listen: 127.0.0.1:{free_port()}\n {certs}\n"
        f" routes: [ nats-route://{creds}127.0.0.1:{route} ]\n}}\n"
    )  # fmt: skip
    node = Node(name, 0, 0, 0, tmp, conf, tmp / f"{name}.log")
    start(node, tmp)
    return node


@pytest.mark.asyncio(loop_scope="session")
async def test_a_route_without_the_password_or_the_clusters_certificate_is_refused(
    tmp_path: Path,
) -> None:
    async with shipped_cluster(tmp_path) as cluster:
        a = cluster.nodes[0]
        password = (tmp_path / "auth" / "route.password").read_text().strip()
        make_certificates(tmp_path / "auth" / "tls", {"intruder": "IP:127.0.0.1"})
        make_certificates(tmp_path / "other-ca", {"stranger": "IP:127.0.0.1"})
        for node in cluster.nodes:
            await cluster.healthy(node, timeout=10)
        intruders = [
            intruder(tmp_path, "intruder", a.route, None, tls=str(tmp_path / "auth" / "tls")),
            intruder(tmp_path, "plain", a.route, password, tls=None),
            intruder(
                tmp_path,
                "stranger",
                a.route,
                password,
                tls=str(tmp_path / "other-ca"),
                ca=str(tmp_path / "auth" / "tls" / "ca.pem"),
            ),
        ]
        try:  # the cluster's own certificate without the password
            await until_logged(intruders[0], "Route Error 'Authorization Violation'")
            # the password without TLS, or with a certificate another CA signed
            await until_logged(a, "TLS route handshake error: tls: first record does not look")
            await until_logged(a, "TLS route handshake error: .*unknown authority.*stranger")
        finally:
            for node in intruders:
                stopped(node)
        routez = (await cluster.http.get(f"http://127.0.0.1:{a.monitor}/routez")).json()
        assert {r["remote_name"] for r in routez["routes"]} == {"tokenway-b", "tokenway-c"}
