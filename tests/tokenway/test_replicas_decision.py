"""Stream replicas without NATS: the default from what a server tells its clients, and
the decision for each stream (create, raise, keep, refuse); every command that provisions
takes `--replicas` (`tests/test_replicas.py` proves them on a real cluster)."""

from __future__ import annotations

import pytest

from program.cli import parser
from tokenway import bus
from tokenway.errors import CannotStart


@pytest.mark.parametrize("command", [
    ["up"], ["provision"], ["ingress"], ["render"], ["schedule"], ["derender"],
    ["engine", "sim"], ["engine", "vllm"],
])  # fmt: skip
def test_every_command_that_provisions_takes_replicas(command: list[str]) -> None:
    assert parser().parse_args([*command, "--replicas", "3"]).replicas == 3


def test_a_stream_that_does_not_exist_gets_the_replicas_asked() -> None:
    assert bus.replicas_for("TW_OUT", None, 3, explicit=False) == 3
    assert bus.replicas_for("TW_OUT", None, 1, explicit=True) == 1


def test_a_stream_is_raised_to_the_replicas_asked() -> None:
    assert bus.replicas_for("TW_OUT", 1, 3, explicit=False) == 3
    assert bus.replicas_for("TW_OUT", 1, 3, explicit=True) == 3


def test_an_asked_lowering_is_refused_naming_the_stream_and_the_flag() -> None:
    with pytest.raises(CannotStart) as refused:
        bus.replicas_for("TW_OUT", 3, 1, explicit=True)
    assert "TW_OUT" in str(refused.value) and "--replicas 3" in str(refused.value)


def test_a_default_below_a_streams_replicas_keeps_them() -> None:
    """A 5-node cluster's R5 stream, or a server away while a stage starts: the default
    (the servers the cluster advertises now, up to 3) is no reason to lower them."""
    assert bus.replicas_for("TW_OUT", 5, 3, explicit=False) == 5
    assert bus.replicas_for("TW_OUT", 3, 2, explicit=False) == 3


def test_the_default_is_the_clusters_size_up_to_three() -> None:
    urls = [f"10.0.0.{i}:4222" for i in range(5)]
    assert bus.default_replicas({"server_name": "lone"}) == 1
    assert bus.default_replicas({"cluster": "c", "connect_urls": urls[:3]}) == 3
    assert bus.default_replicas({"cluster": "c", "connect_urls": urls}) == 3
    assert bus.default_replicas({"cluster": "c", "connect_urls": urls[:2]}) == 2
    # A cluster that advertises no servers (`no_advertise`): R3, which fails to place
    # loudly on fewer than three, rather than R1, which would lose the ledger quietly.
    assert bus.default_replicas({"cluster": "c"}) == 3
