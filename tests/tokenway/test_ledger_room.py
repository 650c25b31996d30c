"""`TW_OUT`'s room for more requests (`tokenway.ledger_room.room`): what is free, plus the
ended requests' records stored before the oldest running request began."""

from __future__ import annotations

from tokenway.ledger_room import (
    FASTEST,
    SLOWEST,
    WHILE_FULL,
    Config,
    Info,
    Room,
    State,
    next_look,
    room,
)

MB = 1 << 20


def ledger(messages: int, size: int, first: int = 1, max_bytes: int = 100 * MB) -> Info:
    """`messages` of `size` bytes each, from sequence `first` on."""
    return Info(State(messages=messages, bytes=messages * size, first_seq=first,
                      last_seq=first + messages - 1), Config(max_bytes))  # fmt: skip


def test_a_full_ledger_of_ended_requests_has_all_its_room() -> None:
    """Full in steady state, discarding hour-old output: nothing running is at risk."""
    full = ledger(100, MB)
    assert room(full, boundary=101, reserve_share=0.25) == Room(100 * MB, 100 * MB, 25 * MB)
    assert not room(full, 101, 0.25).full


def test_what_running_requests_stored_is_no_room() -> None:
    """The oldest running request began at message 41 of 100: what came since stays."""
    at_risk = room(ledger(100, MB), boundary=41, reserve_share=0.25)
    assert at_risk.room == 40 * MB and not at_risk.full
    assert room(ledger(100, MB), boundary=21, reserve_share=0.25).full  # 20 MB left: refuse
    assert room(ledger(100, MB, first=50), boundary=41, reserve_share=0.25).room == 0


def test_free_room_counts_and_an_unbounded_ledger_is_never_full() -> None:
    half = room(ledger(50, MB), boundary=1, reserve_share=0.25)
    assert half.room == 50 * MB and not half.full
    assert not room(ledger(50, MB, max_bytes=-1), 1, 0.25).full


def test_it_looks_sooner_the_faster_the_room_shrinks() -> None:
    roomy, less = Room(80 * MB, 100 * MB, 25 * MB), Room(70 * MB, 100 * MB, 25 * MB)
    assert next_look(None, roomy, 1.0) == FASTEST
    assert next_look(roomy, roomy, 1.0) == SLOWEST  # not shrinking
    assert next_look(roomy, less, 1.0) == SLOWEST  # 10 MB/s: 4.5 s left to the reserve
    assert next_look(roomy, Room(30 * MB, 100 * MB, 25 * MB), 1.0) == FASTEST  # 50 MB/s
    assert next_look(less, Room(10 * MB, 100 * MB, 25 * MB), 1.0) == WHILE_FULL
