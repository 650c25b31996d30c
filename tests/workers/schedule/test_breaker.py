"""Circuit breakers: every transition, the back-off sequence, and the single probe."""

from __future__ import annotations

import pytest

from workers.schedule.breaker import Breakers


def tripped(b: Breakers, engine: str = "e", now: float = 0.0) -> Breakers:
    for _ in range(b.threshold):
        b.on_failure(engine, now)
    return b


def test_an_unknown_engine_is_closed_and_allowed() -> None:
    b = Breakers()
    assert b.state("e", 0) == "closed"
    assert b.admits("e", 0) and b.allow("e", 0)
    assert b.allow("e", 0)  # closed: no limit on how many go through


def test_failures_below_the_threshold_keep_it_closed() -> None:
    b = Breakers(threshold=3)
    b.on_failure("e", 0)
    b.on_failure("e", 1)
    assert b.state("e", 2) == "closed" and b.allow("e", 2)


def test_a_success_resets_the_consecutive_failure_count() -> None:
    b = Breakers(threshold=3)
    b.on_failure("e", 0)
    b.on_failure("e", 1)
    b.on_success("e", 2)
    b.on_failure("e", 3)
    b.on_failure("e", 4)
    assert b.state("e", 5) == "closed"
    b.on_failure("e", 5)
    assert b.state("e", 5) == "open"


def test_threshold_consecutive_failures_open_it_for_the_base_back_off() -> None:
    b = tripped(Breakers(threshold=3, base=2.0), now=10)
    assert b.state("e", 10) == "open"
    assert not b.admits("e", 11.9) and not b.allow("e", 11.9)
    assert b.state("e", 12) == "half_open"


def test_breakers_are_per_engine() -> None:
    b = tripped(Breakers(threshold=2), "a")
    assert b.state("a", 0) == "open"
    assert b.state("b", 0) == "closed" and b.allow("b", 0)


def test_half_open_lets_exactly_one_probe_through() -> None:
    b = tripped(Breakers(base=1.0))
    assert b.admits("e", 1) and b.admits("e", 1)  # looking claims nothing
    assert b.allow("e", 1)  # the probe
    assert not b.allow("e", 1) and not b.admits("e", 1.5)
    assert b.state("e", 1.5) == "half_open"


def test_a_probe_success_closes_it_and_resets_the_back_off() -> None:
    b = tripped(Breakers(base=1.0, factor=2.0))
    assert b.allow("e", 1)
    b.on_failure("e", 1)  # probe failed: open for 2
    assert b.allow("e", 3)
    b.on_success("e", 3)
    assert b.state("e", 3) == "closed" and b.allow("e", 3) and b.allow("e", 3)
    tripped(b, now=4)  # a fresh trip starts from the base again
    assert b.state("e", 4.9) == "open" and b.state("e", 5) == "half_open"


def test_probe_failures_double_the_back_off_up_to_the_cap() -> None:
    b = tripped(Breakers(base=1.0, factor=2.0, cap=10.0))
    now, waits = 0.0, []
    for _ in range(6):
        opened = now
        while b.state("e", now) == "open":
            now += 0.5
        waits.append(now - opened)
        assert b.allow("e", now)
        b.on_failure("e", now)
    assert waits == [1, 2, 4, 8, 10, 10]
    assert [b.backoff(t) for t in range(1, 7)] == [1, 2, 4, 8, 10, 10]


def test_late_results_of_requests_sent_before_it_opened_change_nothing() -> None:
    b = tripped(Breakers(base=4.0))
    b.on_failure("e", 1)  # no probe out: does not extend the back-off
    assert b.state("e", 3.9) == "open" and b.state("e", 4) == "half_open"
    b.on_success("e", 2)  # nor does a late success close it
    assert b.state("e", 2) == "open"


def test_an_abandoned_probe_lets_the_next_request_probe() -> None:
    b = tripped(Breakers(base=1.0))
    assert b.allow("e", 1)
    b.abandon("e", 1.2)  # the probe's request was cancelled before the engine answered
    assert b.state("e", 1.2) == "half_open"
    assert b.allow("e", 1.2) and not b.allow("e", 1.2)


def test_a_probe_that_never_reports_is_replaced_after_the_probe_timeout() -> None:
    b = tripped(Breakers(base=1.0, probe_timeout=5.0))
    assert b.allow("e", 1)
    assert not b.allow("e", 5.9)
    assert b.allow("e", 6)  # the second probe
    assert not b.allow("e", 6)


def test_forget_starts_a_returning_engine_closed() -> None:
    b = tripped(Breakers())
    b.forget("e")
    b.forget("never-seen")
    assert b.state("e", 0) == "closed" and b.allow("e", 0)


def test_settings_are_validated() -> None:
    for bad in (
        {"threshold": 0},
        {"base": 0},
        {"factor": 0.5},
        {"base": 10, "cap": 5},
        {"probe_timeout": 0},
    ):
        with pytest.raises(ValueError, match="invalid breaker settings"):
            Breakers(**bad)
