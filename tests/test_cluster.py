"""Chaos on a real 3-node JetStream cluster (R3 streams): under concurrent streaming load a
node is SIGKILLed (the one the stages were told about, the meta leader, the leader of
`TW_OUT`), or every node is restarted in turn. Every stream must end with the text of the
fault-free run, consecutive event ids and one [DONE], nothing left behind, and no stage may
crash. Run with `-s` to see, per fault, the cluster's own election time (from the server
logs) next to the longest client wait."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from tests.cluster import Cluster, Node, running_cluster
from tests.conftest import make_settings, start_stack
from tests.ledgers import data_lines, stored_once
from tests.stages import StageProcesses
from tests.test_cancel import consumer_names
from tests.test_chaos import check, nothing_left, report, run_load, started
from tokenway import bus

pytestmark = pytest.mark.asyncio(loop_scope="session")

ITL = 0.02  # a stream lasts 3 s: it spans a node's loss and the election that follows
ROLLING_ITL = 0.04  # 6 s: most of a rolling restart


@pytest_asyncio.fixture(loop_scope="session")
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with running_cluster(tmp_path / "cluster") as c:
        yield c


async def faulted(
    cluster: Cluster, tmp: Path, fault: str, seeds: str,
    act: Callable[[], Awaitable[float]], itl: float = ITL,
) -> None:  # fmt: skip
    """The load fault-free, then again while `act` (returning when it began) runs."""
    # A restarted node of a loaded 2-core machine was seen answering TW_OUT publishes with
    # no responders for over 10 s (the default --bus-retry) while it recovered its store.
    settings = make_settings(tmp, replicas=3, served_model_name=f"cluster-{fault}",
                             request_timeout=60.0, sim_itl=itl, bus_retry=30.0)  # fmt: skip
    stack = await start_stack(seeds, settings, ["ingress", "render", "schedule", "sim"])
    try:
        c = StageProcesses(stack, tmp, url=stack.url)
        expected = await run_load(c, c.url)
        consumers = await consumer_names(cluster.seeds)  # every stage's, once it has served
        began: list[float] = []

        async def fault_now() -> None:
            began.append(await act())

        got = await run_load(c, c.url, started(5), fault_now)
        elected = cluster.elected_after(began[0])
        failed = check(got, expected, errors_allowed=False)
        report(f"cluster {fault}", got, expected, failed,
               f", election {elected:.2f} s" if elected is not None else "")  # fmt: skip
        await cluster.all_healthy()
        for g in got:  # the ledger holds what the client got, each event stored once
            shown = [x for e in g.events() for x in e.split("\n") if x.startswith("data: {")]
            stored = await stored_once(stack.observer, g.rid, stack.ingress.ingress_id)
            assert data_lines(stored) == shown
        assert not stack.task.done(), "a stage stopped"
        await cluster.listing(consumers, lambda: consumer_names(cluster.seeds))
        await nothing_left(c, consumers)
    finally:
        await stack.close()


def killing(
    cluster: Cluster, pick: Callable[[], Awaitable[Node]]
) -> Callable[[], Awaitable[float]]:
    async def act() -> float:
        node = await pick()
        at = cluster.kill(node)
        await cluster.all_healthy()  # the other two have elected what it led
        cluster.start(node)
        return at

    return act


async def test_losing_the_node_the_stages_were_given(cluster: Cluster, tmp_path: Path) -> None:
    """Told only of n0, the stages go on through the servers the cluster advertised."""
    first = cluster.nodes[0]

    async def pick() -> Node:
        return first

    await faulted(cluster, tmp_path, "own-node", first.url, killing(cluster, pick))


async def test_losing_the_meta_leader(cluster: Cluster, tmp_path: Path) -> None:
    async def pick() -> Node:
        return cluster.node(await cluster.meta_leader())

    await faulted(cluster, tmp_path, "meta-leader", cluster.seeds, killing(cluster, pick))


async def test_losing_the_ledgers_leader(cluster: Cluster, tmp_path: Path) -> None:
    async def pick() -> Node:
        return cluster.node(await cluster.stream_leader(bus.OUT_STREAM))

    await faulted(cluster, tmp_path, "tw-out-leader", cluster.seeds, killing(cluster, pick))


async def test_a_rolling_restart(cluster: Cluster, tmp_path: Path) -> None:
    """Every node stopped and started in turn, the next once the cluster is healthy again."""

    async def roll() -> float:
        at = time.time()
        for node in cluster.nodes:
            cluster.kill(node)
            cluster.start(node)
            await cluster.all_healthy()
        return at

    await faulted(cluster, tmp_path, "rolling-restart", cluster.seeds, roll, ROLLING_ITL)
