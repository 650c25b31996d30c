"""The probe of a half-open breaker belongs to the request that took it: the engine's
verdict on that request closes or reopens the breaker, and a request that ends without one
(its own fault refused by the engine, its client gone, its deadline) gives the probe back,
so the next request probes at once rather than after the probe timeout."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import make_settings
from tokenway.wire import EngineInfo, GenerateRequest
from workers.schedule.dispatch import Dispatcher, Plan
from workers.schedule.owned import Owned

PLAN = Plan(engine=EngineInfo(id="e1", model="m"))


def owned(rid: str) -> Owned:
    request = GenerateRequest(request_id=rid, token_ids=[5, 6, 7])
    return Owned(rid=rid, reply="i1", request=request, deadline=1e9, msg=None)


def half_open(tmp_path: Path) -> tuple[Dispatcher, float]:
    """A dispatcher whose engine e1 failed once (threshold 1) long enough ago to be probed."""
    d = Dispatcher(None, "o1", None, make_settings(tmp_path, breaker_threshold=1))  # type: ignore[arg-type]
    now = time.monotonic()
    d.breakers.on_failure("e1", now - 30)
    assert d.breakers.state("e1", now) == "half_open"
    return d, now


@pytest.mark.parametrize("ends", ["refused", "released"])
def test_a_probe_without_a_verdict_is_given_back(tmp_path: Path, ends: str) -> None:
    d, now = half_open(tmp_path)
    probe = owned("r1")
    assert d._claim(probe, PLAN, now)
    assert not d._claim(owned("r2"), PLAN, now)  # one probe at a time
    if ends == "refused":  # the engine refused the request itself: nothing said of the engine
        d.engine_refused(probe, "e1")
    else:  # the request ended first (cancelled, past its deadline)
        d.release(probe)
    assert d.breakers.state("e1", time.monotonic()) == "half_open"
    assert d._claim(owned("r3"), PLAN, time.monotonic())


def test_a_verdict_ends_the_probe_and_what_follows_leaves_the_breaker_alone(
    tmp_path: Path,
) -> None:
    d, now = half_open(tmp_path)
    probe = owned("r1")
    assert d._claim(probe, PLAN, now)
    d.engine_failed(probe, "e1")  # reopened, with the back-off doubled
    d.release(probe)  # the relay gives its attempt back: no probe is left to give
    assert d.breakers.state("e1", time.monotonic()) == "open"


def test_a_refusal_outside_a_probe_moves_nothing(tmp_path: Path) -> None:
    d = Dispatcher(None, "o1", None, make_settings(tmp_path, breaker_threshold=1))  # type: ignore[arg-type]
    r = owned("r1")
    assert d._claim(r, PLAN, time.monotonic()) and not r.probes
    for _ in range(5):
        d.engine_refused(r, "e1")
    assert d.breakers.state("e1", time.monotonic()) == "closed"
