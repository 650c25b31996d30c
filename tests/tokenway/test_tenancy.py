"""A tenant's limits against its usage (`tokenway.tenancy`), as every worker computes them."""

from __future__ import annotations

import pytest

from tokenway.tenancy import Limits, Refused, Usage, admit, release

NOW = 1_000_000.0


def _admitted(usage: Usage | Refused) -> Usage:
    assert isinstance(usage, Usage), usage
    return usage


def test_concurrent_requests_past_the_limit_wait_for_a_slot() -> None:
    limits = Limits(concurrent=2)
    u = _admitted(admit(Usage(), limits, "a", 10, NOW, NOW + 600))
    u = _admitted(admit(u, limits, "b", 10, NOW, NOW + 600))
    refused = admit(u, limits, "c", 10, NOW, NOW + 600)
    assert isinstance(refused, Refused) and refused.retry_after == 1
    assert "2 concurrent" in refused.why
    freed = release(u, "a", NOW)
    assert freed is not None and set(freed.leases) == {"b"}
    assert set(_admitted(admit(freed, limits, "c", 10, NOW, NOW + 600)).leases) == {"b", "c"}
    assert release(freed, "a", NOW) is None  # nothing held: nothing to write


def test_a_request_admitted_again_keeps_its_lease_and_is_not_charged_twice() -> None:
    limits = Limits(concurrent=1, tokens_per_minute=100)
    u = _admitted(admit(Usage(), limits, "a", 60, NOW, NOW + 600))
    again = _admitted(admit(u, limits, "a", 60, NOW, NOW + 600))  # its render redelivered
    assert again.tat == u.tat and again.leases == u.leases


def test_a_lease_lapses_at_its_deadline() -> None:
    """A request whose owner vanished frees its slot by itself, once it could not run on."""
    limits = Limits(concurrent=1)
    u = _admitted(admit(Usage(), limits, "a", 1, NOW, NOW + 5))
    assert isinstance(admit(u, limits, "b", 1, NOW + 4, NOW + 600), Refused)
    assert set(_admitted(admit(u, limits, "b", 1, NOW + 6, NOW + 600)).leases) == {"b"}


def test_tokens_per_minute_spend_at_once_then_refill_evenly() -> None:
    limits = Limits(tokens_per_minute=600)  # 10 tokens a second
    u = _admitted(admit(Usage(), limits, "a", 300, NOW, NOW + 600))
    u = _admitted(admit(u, limits, "b", 300, NOW, NOW + 600))  # a whole minute's at once
    refused = admit(u, limits, "c", 100, NOW, NOW + 600)
    assert isinstance(refused, Refused) and refused.retry_after == 10  # 100 tokens refill
    assert isinstance(admit(u, limits, "c", 100, NOW + 9.5, NOW + 600), Refused)
    _admitted(admit(u, limits, "c", 100, NOW + 10, NOW + 600))
    # An idle tenant's budget is full again, never more.
    idle = _admitted(admit(u, limits, "d", 600, NOW + 3600, NOW + 4200))
    assert isinstance(admit(idle, limits, "e", 1, NOW + 3600, NOW + 4200), Refused)


def test_a_request_over_a_minutes_budget_can_never_run() -> None:
    refused = admit(Usage(), Limits(tokens_per_minute=600), "a", 601, NOW, NOW + 600)
    assert isinstance(refused, Refused) and refused.retry_after == 0
    assert "601 tokens" in refused.why and "600 tokens per minute" in refused.why


@pytest.mark.parametrize("limits", [Limits(), Limits(concurrent=3, tokens_per_minute=12)])
def test_limits_ride_a_header_and_back(limits: Limits) -> None:
    assert Limits.parse(limits.header()) == limits


@pytest.mark.parametrize("text", ["c=x,t=1", "c=-1,t=0"])
def test_a_malformed_limits_header_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        Limits.parse(text)
