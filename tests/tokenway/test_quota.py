"""A tenant's share of the stores (`tokenway.quota`): what fits, what is refused and why,
and usage that comes back when things are deleted or expire."""

from __future__ import annotations

import pytest

from tokenway.quota import (
    CODE,
    FILES,
    RESPONSES,
    Charge,
    Kept,
    Quota,
    QuotaExceeded,
    Tally,
    admits,
    charge,
    release,
    slot_width,
)

SHARE = Quota(files_bytes=1000, files_count=3, responses_bytes=500, responses_count=2)
NOW = 1_000_000.0


def file(size: int, count: int = 1) -> Charge:
    return Charge(FILES, count, size)


def test_files_are_counted_until_the_quota_and_refused_past_it_naming_it() -> None:
    kept = charge(Kept(), SHARE, file(400), NOW)
    kept = charge(kept, SHARE, file(400), NOW)
    assert kept.used(FILES, NOW) == Tally(2, 800)
    with pytest.raises(QuotaExceeded) as over:
        charge(kept, SHARE, file(300), NOW)
    refusal = over.value.info()
    assert refusal.status == 400 and refusal.code == CODE and refusal.param == "file"
    assert "1000 bytes of files (files_bytes)" in refusal.message
    assert "you keep 2 files of 800 bytes" in refusal.message and "300 bytes" in refusal.message
    kept = charge(kept, SHARE, file(200), NOW)  # exactly the quota fits
    with pytest.raises(QuotaExceeded, match=r"3 files \(files_count\)"):
        charge(kept, SHARE, file(0), NOW)


def test_what_is_made_already_is_counted_past_the_quota_and_shrinking_is_never_refused() -> None:
    full = charge(Kept(), SHARE, file(1000), NOW)
    over = charge(full, SHARE, file(600), NOW, force=True)  # a batch's output, say
    assert over.used(FILES, NOW) == Tally(2, 1600)
    smaller = charge(over, SHARE, Charge(FILES, 0, -100), NOW)  # a part written again, smaller
    assert smaller.used(FILES, NOW) == Tally(2, 1500)
    with pytest.raises(QuotaExceeded, match="any more"):
        admits(smaller, SHARE, FILES, NOW)


def test_a_delete_gives_back_what_was_counted_and_never_below_nothing() -> None:
    kept = charge(Kept(), SHARE, file(700), NOW)
    kept = release(kept, file(700), NOW)
    assert kept.used(FILES, NOW) == Tally(0, 0)
    assert release(kept, file(700), NOW).used(FILES, NOW) == Tally(0, 0)


def test_no_quota_refuses_nothing() -> None:
    kept = charge(Kept(), Quota(), file(10**12, 10**6), NOW)
    admits(kept, Quota(), FILES, NOW)


def test_stored_responses_give_their_usage_back_when_they_expire() -> None:
    """A usage that only grew would lock a tenant out once its responses age out: each
    response counts until the end of the slot it expires in, and no longer."""
    ttl = 640.0
    width = slot_width(ttl)
    assert width == 10.0
    first = Charge(RESPONSES, 1, 200, NOW + ttl, width)
    kept = charge(Kept(), SHARE, first, NOW)
    later = Charge(RESPONSES, 1, 200, NOW + 30 + ttl, width)
    kept = charge(kept, SHARE, later, NOW + 30)
    assert kept.used(RESPONSES, NOW + 30) == Tally(2, 400)
    with pytest.raises(QuotaExceeded, match=r"2 stored responses \(responses_count\)") as over:
        admits(kept, SHARE, RESPONSES, NOW + 30)
    assert over.value.param == "store" and "leave by themselves" in over.value.message
    expired = NOW + ttl + width  # the first's slot has ended: it counts no more
    assert kept.used(RESPONSES, expired) == Tally(1, 200)
    admits(kept, SHARE, RESPONSES, expired)
    # the next change drops the ended slot: the record stays small
    kept = charge(kept, SHARE, Charge(RESPONSES, 1, 10, expired + ttl, width), expired)
    assert len(kept.responses) == 2 and kept.used(RESPONSES, expired) == Tally(2, 210)
    assert kept.used(RESPONSES, expired + 2 * ttl) == Tally(0, 0)


def test_a_deleted_response_is_given_back_from_its_slot() -> None:
    width = slot_width(100.0)
    c = Charge(RESPONSES, 1, 300, NOW + 100, width)
    kept = release(charge(Kept(), SHARE, c, NOW), c, NOW + 5)
    assert kept.used(RESPONSES, NOW + 5) == Tally(0, 0) and kept.responses == {}


def test_a_response_stored_past_its_quota_is_still_counted() -> None:
    """Its client has it already: it counts, and the next request asking to store is the
    one refused."""
    width = slot_width(100.0)
    big = Charge(RESPONSES, 1, 900, NOW + 100, width)
    kept = charge(Kept(), SHARE, big, NOW, force=True)
    assert kept.used(RESPONSES, NOW) == Tally(1, 900)
    with pytest.raises(QuotaExceeded, match=r"500 bytes of stored responses \(responses_bytes\)"):
        admits(kept, SHARE, RESPONSES, NOW)
