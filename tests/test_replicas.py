"""Stream replicas are a setting an operator sees and cannot lose: the default is the
cluster's size (up to 3), provision never lowers a stream's replicas and says what it did,
and `tokenway status` shows each stream's and flags one below the cluster's. Proved on a
real 3-node cluster and on the session's lone server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
import pytest_asyncio
from nats.js import JetStreamContext

from tests.cluster import Cluster, running_cluster
from tests.conftest import Bus, make_settings
from tests.test_cli import spawn
from tokenway import bus
from tokenway.errors import CannotStart

pytestmark = pytest.mark.asyncio(loop_scope="session")

EVERY_STREAM = (bus.ADVISORY_STREAM, bus.RENDER_STREAM, bus.SCHED_STREAM, bus.OUT_STREAM,
                bus.DLQ_STREAM, bus.ENGINES_STREAM, bus.TENANTS_STREAM, bus.FILES_STREAM,
                bus.BATCHES_STREAM, bus.RESPONSES_STREAM, bus.STORED_STREAM)  # fmt: skip


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    async with running_cluster(tmp_path_factory.mktemp("replicas")) as c:
        yield c


async def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await spawn(*args, env=env)
    out, err = await proc.communicate()
    return proc.returncode or 0, out.decode(), err.decode()


async def replicas(url: str) -> dict[str, int]:
    nc = await nats.connect(servers=bus.seeds(url))
    try:
        js = nc.jetstream()
        return {name: (await js.stream_info(name)).config.num_replicas for name in EVERY_STREAM}
    finally:
        await nc.close()


async def provisioned(
    cluster: Cluster, tmp: Path, *flags: str, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    return await run("provision", "--nats", cluster.seeds, "--data-dir", str(tmp), *flags,
                     env=env)  # fmt: skip


async def test_provision_on_a_cluster_gives_every_stream_three_replicas(
    cluster: Cluster, tmp_path: Path
) -> None:
    code, out, err = await provisioned(cluster, tmp_path)
    assert code == 0, err
    assert await replicas(cluster.seeds) == dict.fromkeys(EVERY_STREAM, 3)
    lines = out.splitlines()
    for name in EVERY_STREAM:  # each said, as created or found as it was
        assert any(line.split()[:1] == [name] and "R3" in line for line in lines), out
    assert lines[-1].startswith("provisioned 11 streams"), out
    assert "R3" in lines[-1], out


@pytest.mark.parametrize("asked", [["--replicas", "1"], ["env"]])
async def test_provision_refuses_to_lower_a_streams_replicas(
    cluster: Cluster, tmp_path: Path, asked: list[str]
) -> None:
    """Re-running provision with fewer replicas (a flag, or TOKENWAY_REPLICAS) used to make
    every stream R1 with a log line about limits: a node's loss then loses the ledger."""
    code, _, err = await provisioned(cluster, tmp_path, env={"TOKENWAY_REPLICAS": "3"})
    assert code == 0, err
    flags, env = (asked, None) if asked != ["env"] else ([], {"TOKENWAY_REPLICAS": "1"})
    code, out, err = await provisioned(cluster, tmp_path, *flags, env=env)
    assert code == 1, (out, err)
    (line,) = err.strip().splitlines()
    assert "TW_ADVISORIES" in line and "3 replicas" in line and "--replicas 3" in line, line
    assert "1" in line and "Traceback" not in err
    assert await replicas(cluster.seeds) == dict.fromkeys(EVERY_STREAM, 3)


async def test_status_shows_replicas_and_flags_a_stream_below_the_cluster(
    cluster: Cluster, tmp_path: Path
) -> None:
    code, _, err = await provisioned(cluster, tmp_path)
    assert code == 0, err
    nc = await nats.connect(servers=bus.seeds(cluster.seeds))
    try:
        await lower_by_hand(nc.jetstream(), bus.DLQ_STREAM)
        code, out, err = await run("status", "--json", "--nats", cluster.seeds)
        assert code == 0, err
        doc = json.loads(out)
        shown = {s["name"]: s for s in doc["streams"]}
        assert {name: s["replicas"] for name, s in shown.items()} == {
            **dict.fromkeys(EVERY_STREAM, 3), bus.DLQ_STREAM: 1}  # fmt: skip
        assert [n for n, s in shown.items() if s["replicas_low"]] == [bus.DLQ_STREAM]
        assert doc["replicas_default"] == 3
        code, text, err = await run("status", "--nats", cluster.seeds)
        assert code == 0, err
        rows = {line.split()[0]: line for line in text.split("\nstreams\n")[1].splitlines()}
        assert "R3" in rows[bus.OUT_STREAM] and "below" not in rows[bus.OUT_STREAM]
        assert "R1" in rows[bus.DLQ_STREAM] and "below the cluster's 3" in rows[bus.DLQ_STREAM]
        assert "--replicas 3" in rows[bus.DLQ_STREAM]
        # Provision raises it again (JetStream scales a stream up), and says what it changed.
        code, out, err = await provisioned(cluster, tmp_path, "--queue-max-msgs", "20000")
        assert code == 0, err
        said = {line.split()[0]: line.split()[1:] for line in out.splitlines()}
        assert said[bus.DLQ_STREAM] == ["updated", "R3", "num_replicas", "(R1", "→", "R3)"]
        assert said[bus.RENDER_STREAM] == ["updated", "R3", "max_msgs"]
        assert said[bus.OUT_STREAM] == ["unchanged", "R3"]
        assert out.splitlines()[-1].startswith("provisioned 11 streams: 0 created, 3 updated")
        assert (await nc.jetstream().stream_info(bus.DLQ_STREAM)).config.num_replicas == 3
    finally:
        await nc.close()


async def lower_by_hand(js: JetStreamContext, name: str) -> None:
    """What an operator's `nats stream edit --replicas 1` does."""
    config = (await js.stream_info(name)).config
    config.num_replicas = 1
    await js.update_stream(config)


async def test_provision_on_a_lone_server_keeps_one_replica_and_says_so(
    session_bus: Bus, tmp_path: Path
) -> None:
    code, out, err = await run("provision", "--data-dir", str(tmp_path),
                               env=session_bus.env("provision"))  # fmt: skip
    assert code == 0, err
    lines = out.splitlines()
    for name in EVERY_STREAM:  # the session's streams, made before: as they were
        assert any(line.split()[:2] == [name, "unchanged"] for line in lines), out
    assert lines[-1].startswith("provisioned 11 streams") and "R1" in lines[-1], out
    assert await replicas(session_bus.watch) == dict.fromkeys(EVERY_STREAM, 1)


async def test_replicas_a_lone_server_cannot_keep_are_refused_in_one_line(
    nats_url: str, tmp_path: Path
) -> None:
    nc = await nats.connect(nats_url)
    try:
        with pytest.raises(CannotStart, match=r"--replicas 3 needs a JetStream cluster"):
            await bus.provision_streams(nc.jetstream(), make_settings(tmp_path, replicas=3))
    finally:
        await nc.close()
