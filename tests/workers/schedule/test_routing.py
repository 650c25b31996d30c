"""Engine choice: the least-loaded engine of a role that fits, by fraction of capacity."""

from __future__ import annotations

from tokenway.wire import EngineInfo, Role
from workers.schedule.routing import free_slots, load, never_fits, pick


def engine(
    id: str,
    max_seqs: int = 10,
    running: int = 0,
    waiting: int = 0,
    role: Role = "union",
    max_tokens: int = 1 << 20,
) -> EngineInfo:
    return EngineInfo(id=id, model="m", role=role, max_seqs=max_seqs, running=running,
                      waiting=waiting, max_tokens=max_tokens)  # fmt: skip


def test_pick_prefers_the_least_loaded_engine_by_fraction_not_by_count() -> None:
    big = engine("big", max_seqs=100, running=40)  # 40 % full
    small = engine("small", max_seqs=4, running=1)  # 25 % full, fewer free slots
    assert pick([big, small], {}, {}, 1, 1, "union") is small
    assert pick([small, big], {}, {}, 1, 1, "union") is small


def test_pick_counts_waiting_sequences_as_load() -> None:
    queued = engine("a", running=1, waiting=5)
    idle = engine("b", running=3)
    assert pick([queued, idle], {}, {}, 1, 1, "union") is idle


def test_pick_skips_full_engines() -> None:
    full = engine("full", max_seqs=4, running=4)
    overfull = engine("over", max_seqs=4, running=2, waiting=3)
    busy = engine("busy", max_seqs=4, running=3)
    assert pick([full, overfull, busy], {}, {}, 1, 1, "union") is busy
    assert pick([full, overfull], {}, {}, 1, 1, "union") is None
    assert pick([], {}, {}, 1, 1, "union") is None


def test_pick_takes_only_engines_of_the_role_asked() -> None:
    prefill = engine("p", role="prefill")
    decode = engine("d", role="decode")
    union = engine("u", running=9)
    assert pick([prefill, decode, union], {}, {}, 1, 1, "union") is union
    assert pick([prefill, decode], {}, {}, 1, 1, "union") is None
    assert pick([prefill, decode, union], {}, {}, 1, 1, "decode") is decode
    assert pick([prefill, decode, union], {}, {}, 1, 1, "prefill") is prefill


def test_pick_counts_tokens_and_all_n_sequences() -> None:
    e = EngineInfo(id="e", model="m", max_seqs=4, max_tokens=1000)
    assert pick([e], {}, {}, 1000, 1, "union") is e
    assert pick([e], {}, {"e": 1}, 1000, 1, "union") is None  # one token over its budget
    assert pick([e], {}, {}, 10, 4, "union") is e
    assert pick([e], {"e": 1}, {}, 10, 4, "union") is None  # n=4 needs four free sequences


def test_pick_skips_engines_without_capacity() -> None:
    assert pick([engine("zero", max_seqs=0)], {}, {}, 1, 1, "union") is None


def test_pick_counts_our_own_in_flight_when_above_the_heartbeat() -> None:
    a = engine("a", running=1)
    b = engine("b", running=3)
    assert pick([a, b], {}, {}, 1, 1, "union") is a
    assert (
        pick([a, b], {"a": 5}, {}, 1, 1, "union") is b
    )  # the beat is older than the 5 we just sent
    assert pick([a, b], {"a": 1, "b": 2}, {}, 1, 1, "union") is a  # the beat already counts ours
    assert pick([a], {"a": 10}, {}, 1, 1, "union") is None


def test_ties_go_to_the_lowest_engine_id() -> None:
    assert pick([engine("b"), engine("a"), engine("c")], {}, {}, 1, 1, "union").id == "a"


def test_load_is_the_larger_running_count_plus_waiting() -> None:
    e = engine("a", running=3, waiting=2)
    assert load(e, 0) == 5
    assert load(e, 7) == 9


def test_free_slots_sums_free_capacity_of_union_engines() -> None:
    engines = [
        engine("a", max_seqs=10, running=4),  # 6 free
        engine("b", max_seqs=8, running=2, waiting=1),  # 5 free
        engine("c", max_seqs=4, running=6),  # over capacity: 0, not -2
        engine("p", max_seqs=50, role="prefill"),  # not ours to fill
    ]
    assert free_slots(engines, {}, {}) == 11
    assert free_slots(engines, {"a": 9}, {}) == 6  # 1 + 5
    assert free_slots([], {}, {}) == 0
    assert free_slots(engines, {}, {"a": 1 << 20}) == 5  # a's token budget is spent


def test_a_request_no_engine_could_ever_hold_is_told_why() -> None:
    small, big = engine("a", max_seqs=4, max_tokens=1000), engine("b", max_seqs=2, max_tokens=5000)
    assert never_fits([small, big], cost=4000, n=2) is None  # b, once idle
    assert never_fits([small, big], cost=900, n=4) is None  # a
    why = never_fits([small, big], cost=6000, n=1)
    assert why is not None and "6000 tokens" in why and "5000 tokens and 4 sequences" in why
    assert never_fits([small, big], cost=10, n=5) is not None  # too many sequences anywhere
    assert never_fits([engine("p", role="prefill", max_tokens=10**9)], cost=10, n=1) is None
    assert never_fits([], cost=10**9, n=1) is None  # nothing to judge by yet
