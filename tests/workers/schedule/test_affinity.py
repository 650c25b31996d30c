"""KV-cache affinity: Dynamo's block hashes, the per-engine prefix index, and the choice."""

from __future__ import annotations

import random
import struct

import pytest
import xxhash

from tokenway.block_hashes import block_hashes, chain, local_hashes, salt_seed
from tokenway.wire import EngineInfo, Role
from workers.schedule.affinity import PrefixIndex, choose, cost


def engine(
    id: str, max_seqs: int = 10, running: int = 0, waiting: int = 0, role: Role = "union"
) -> EngineInfo:
    return EngineInfo(
        id=id, model="m", role=role, max_seqs=max_seqs, running=running, waiting=waiting
    )


# -- block hashes -----------------------------------------------------------------------------


def test_block_hashes_reproduce_dynamos_golden_values() -> None:
    # ai-dynamo/dynamo tokens.rs tests: tokens 1..12, block size 4.
    assert local_hashes(list(range(1, 13)), 4) == [
        14643705804678351452,
        16777012769546811212,
        483935686894639516,
    ]
    assert block_hashes(list(range(1, 13)), 4) == [
        14643705804678351452,
        4945711292740353085,
        12583592247330656132,
    ]


def test_block_hashes_follow_the_spec_computed_by_hand() -> None:
    tokens = [7, 0, 2**31 - 1, 42, 1, 2, 3, 4]
    first = xxhash.xxh3_64_intdigest(struct.pack("<4I", 7, 0, 2**31 - 1, 42), 1337)
    second_local = xxhash.xxh3_64_intdigest(struct.pack("<4I", 1, 2, 3, 4), 1337)
    second = xxhash.xxh3_64_intdigest(struct.pack("<QQ", first, second_local), 1337)
    assert block_hashes(tokens, 4) == [first, second]
    assert chain(local_hashes(tokens, 4)) == [first, second]


def test_a_salt_seeds_the_local_hashes_as_dynamo_seeds_a_lora() -> None:
    # Dynamo's golden vector for lora_name "lora_7": seed 1337 + XXH3-64("lora_7").
    seed = salt_seed("lora_7")
    assert local_hashes(list(range(1, 9)), 4, seed) == [6090315765804930700, 3193399369686574168]
    salted = block_hashes(list(range(1, 9)), 4, salt="lora_7")
    assert salted == chain([6090315765804930700, 3193399369686574168])
    assert salted != block_hashes(list(range(1, 9)), 4)
    assert salt_seed(None) == salt_seed("") == 1337


def test_block_hashes_are_deterministic() -> None:
    tokens = list(range(1000, 1100))
    assert block_hashes(tokens) == block_hashes(list(tokens)) == block_hashes(tuple(tokens))


def test_only_full_blocks_are_hashed() -> None:
    assert block_hashes([], 16) == []
    assert block_hashes(list(range(15)), 16) == []
    assert len(block_hashes(list(range(16)), 16)) == 1
    assert len(block_hashes(list(range(47)), 16)) == 2
    # The partial tail changes nothing.
    assert block_hashes(list(range(40)), 16) == block_hashes([*list(range(32)), 9, 9], 16)


def test_changing_an_early_token_changes_every_later_hash() -> None:
    tokens = list(range(64))
    changed = [*tokens[:5], 999, *tokens[6:]]
    a, b = block_hashes(tokens, 16), block_hashes(changed, 16)
    assert all(x != y for x, y in zip(a, b, strict=True))
    # …while a change in the last block leaves the earlier ones alone.
    late = [*tokens[:60], 999, *tokens[61:]]
    assert block_hashes(late, 16)[:3] == a[:3]
    assert block_hashes(late, 16)[3] != a[3]


def test_equal_blocks_at_different_positions_hash_differently() -> None:
    hashes = block_hashes([5] * 64, 16)
    assert len(set(hashes)) == 4
    assert len(set(local_hashes([5] * 64, 16))) == 1


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2, 3], 0)


# -- prefix index -----------------------------------------------------------------------------


def test_overlap_counts_leading_blocks_and_stops_at_the_first_miss() -> None:
    index = PrefixIndex(ttl=60)
    tokens = list(range(64))  # 4 blocks
    index.record("a", block_hashes(tokens), now=0)
    assert index.overlap("a", block_hashes(tokens), now=1) == 4
    assert index.overlap("a", block_hashes(tokens + list(range(500, 532))), now=1) == 4
    assert index.overlap("a", block_hashes(tokens[:40]), now=1) == 2
    diverges = [*tokens[:35], 999, *tokens[36:]]  # block 2 differs, so do 3 and on
    assert index.overlap("a", block_hashes(diverges), now=1) == 2
    assert index.overlap("a", block_hashes([999, *tokens[1:]]), now=1) == 0
    assert index.overlap("a", [], now=1) == 0
    assert index.overlap("b", block_hashes(tokens), now=1) == 0


def test_entries_older_than_the_ttl_are_ignored_and_evicted() -> None:
    index = PrefixIndex(ttl=10)
    index.record("a", [1, 2, 3], now=0)
    index.record("a", [1, 2], now=5)  # refreshes the first two blocks only
    assert index.overlap("a", [1, 2, 3], now=10) == 3
    assert index.overlap("a", [1, 2, 3], now=10.5) == 2
    assert index.overlap("a", [1, 2, 3], now=15.5) == 0
    index.record("a", [7], now=12)
    assert index.size("a") == 3  # 3 expired and left; 1 and 2 are still within the TTL
    index.expire(now=30)
    assert index.size("a") == 0
    assert index.engines() == []


def test_the_index_keeps_at_most_max_blocks_per_engine_least_recent_first() -> None:
    index = PrefixIndex(ttl=60, max_blocks=4)
    index.record("a", [1, 2, 3], now=0)
    index.record("a", [7, 8], now=1)
    assert index.size("a") == 4
    # The oldest prefix lost its deepest block, not its root.
    assert index.overlap("a", [1, 2, 3], now=2) == 2
    assert index.overlap("a", [7, 8], now=2) == 2
    index.record("a", [1, 2], now=3)  # used again: now the most recent
    index.record("a", [5, 6], now=4)
    assert index.overlap("a", [1, 2], now=5) == 2
    assert index.overlap("a", [7, 8], now=5) == 0
    index.record("b", [1, 2, 3, 4, 5, 6], now=6)  # longer than the bound: the first blocks
    assert index.overlap("b", [1, 2, 3, 4, 5, 6], now=6) == 4
    assert index.size("a") == 4  # engines are bounded separately


def test_forget_drops_an_engine() -> None:
    index = PrefixIndex(ttl=60)
    index.record("a", [1, 2], now=0)
    index.record("b", [1, 2], now=0)
    index.forget("a")
    index.forget("gone")
    assert index.overlap("a", [1, 2], now=1) == 0
    assert index.overlap("b", [1, 2], now=1) == 2
    assert index.engines() == ["b"]


def test_index_settings_must_be_positive() -> None:
    with pytest.raises(ValueError):
        PrefixIndex(ttl=0)
    with pytest.raises(ValueError):
        PrefixIndex(ttl=1, max_blocks=0)


# -- choice -----------------------------------------------------------------------------------


def prompt(system: int, user: int, system_tokens: int = 2048, user_tokens: int = 200) -> list:
    """A shared system prompt plus a request-specific suffix."""
    return [system] * 8 + list(range(system_tokens)) + [user + 10**6] * user_tokens


def test_without_any_overlap_the_choice_is_the_least_loaded_by_fraction() -> None:
    # What `routing.pick` picks: the lowest load / max_seqs, ties to the lowest id.
    engines = [
        engine("a", max_seqs=100, running=40),  # 40 %
        engine("b", max_seqs=4, running=1),  # 25 %
        engine("c", max_seqs=10, running=3, waiting=1),  # 40 %
        engine("d", max_seqs=10, running=9, waiting=1),  # full
    ]
    index = PrefixIndex(ttl=60)
    for hashes in ([], block_hashes(prompt(1, 1))):
        for ours, expected in (({}, "b"), ({"b": 3}, "a"), ({"a": 99, "b": 3}, "c")):
            choice = choose(engines, ours, hashes, index, now=0)
            assert choice is not None and choice.engine.id == expected, ours
            assert choice.overlap_blocks == 0


def test_requests_sharing_a_system_prompt_stick_to_one_engine_while_load_allows() -> None:
    engines = {i: engine(i, max_seqs=64) for i in ("a", "b", "c", "d")}
    index = PrefixIndex(ttl=600)
    running: dict[str, int] = dict.fromkeys(engines, 0)
    landed = []
    for user in range(20):
        hashes = block_hashes(prompt(1, user))
        now = float(user)
        choice = choose(list(engines.values()), running, hashes, index, now)
        assert choice is not None
        index.record(choice.engine.id, hashes, now)
        running[choice.engine.id] += 1
        landed.append((choice.engine.id, choice.overlap_blocks))
    assert {e for e, _ in landed} == {"a"}
    assert landed[0][1] == 0
    assert all(overlap == 128 for _, overlap in landed[1:])  # 2056 shared tokens: 128 blocks


def test_a_second_system_prompt_goes_to_another_engine_and_sticks_there() -> None:
    engines = [engine(i, max_seqs=64) for i in ("a", "b", "c")]
    index = PrefixIndex(ttl=600)
    running: dict[str, int] = {}
    seen: dict[int, set[str]] = {1: set(), 2: set()}
    for user in range(30):
        system = 1 + user % 2
        hashes = block_hashes(prompt(system, user))
        choice = choose(engines, running, hashes, index, now=user)
        assert choice is not None
        index.record(choice.engine.id, hashes, now=user)
        running[choice.engine.id] = running.get(choice.engine.id, 0) + 1
        seen[system].add(choice.engine.id)
    assert seen == {1: {"a"}, 2: {"b"}}


def test_shared_prefix_requests_spread_once_their_engine_is_loaded() -> None:
    engines = {i: engine(i, max_seqs=32) for i in ("a", "b", "c", "d")}
    index = PrefixIndex(ttl=600)
    running: dict[str, int] = dict.fromkeys(engines, 0)
    order = []
    for user in range(80):
        hashes = block_hashes(prompt(1, user))
        choice = choose(list(engines.values()), running, hashes, index, now=user)
        assert choice is not None
        index.record(choice.engine.id, hashes, now=user)
        running[choice.engine.id] += 1
        order.append(choice.engine.id)
    # The first engine takes requests until about half full (shared share 0.94, ρ/(1-ρ)
    # crossing it), then a second engine gets the prefix, and so on.
    assert order[:15] == ["a"] * 15
    assert set(order) == set(engines)
    assert max(running.values()) - min(running.values()) <= 2
    assert max(running.values()) < 32  # nobody filled up while another had room


def test_a_loaded_affinity_engine_loses_to_an_idle_one_the_closer_it_is_to_full() -> None:
    # 90 % of the prompt cached on "a": worth it up to ρ/(1-ρ) < 0.9.
    hashes = list(range(100))
    index = PrefixIndex(ttl=60)
    index.record("a", hashes[:90], now=0)
    idle = engine("b", max_seqs=100)
    stick = choose([engine("a", max_seqs=100, running=45), idle], {}, hashes, index, now=1)
    spread = choose([engine("a", max_seqs=100, running=50), idle], {}, hashes, index, now=1)
    assert stick is not None and stick.engine.id == "a" and stick.overlap_blocks == 90
    assert spread is not None and spread.engine.id == "b" and spread.overlap_blocks == 0


def test_an_almost_full_engine_costs_more_than_any_prefill_saving() -> None:
    hashes = list(range(1000))
    index = PrefixIndex(ttl=60)
    index.record("a", hashes, now=0)
    almost_full = engine("a", max_seqs=8, running=7)
    for other in (engine("b", max_seqs=8), engine("b", max_seqs=8, running=5)):
        choice = choose([almost_full, other], {}, hashes, index, now=1, prefill_scale=4.0)
        assert choice is not None and choice.engine.id == "b"
    # Whole prompt cached, one slot left, vs nothing cached on an idle engine.
    assert cost(1000, 1000, 7, 8, 4.0) > cost(1000, 0, 0, 8, 4.0)


def test_a_higher_prefill_scale_sticks_longer() -> None:
    hashes = list(range(100))
    index = PrefixIndex(ttl=60)
    index.record("a", hashes[:90], now=0)
    engines = [engine("a", max_seqs=100, running=60), engine("b", max_seqs=100)]
    assert choose(engines, {}, hashes, index, now=1).engine.id == "b"
    assert choose(engines, {}, hashes, index, now=1, prefill_scale=2.0).engine.id == "a"


def test_full_and_non_union_engines_are_skipped_even_with_the_prefix() -> None:
    hashes = list(range(50))
    index = PrefixIndex(ttl=60)
    for e in ("full", "over", "p", "d", "zero"):
        index.record(e, hashes, now=0)
    engines = [
        engine("full", max_seqs=4, running=4),
        engine("over", max_seqs=4, running=2, waiting=2),
        engine("p", role="prefill"),
        engine("d", role="decode"),
        engine("zero", max_seqs=0),
    ]
    assert choose(engines, {}, hashes, index, now=1) is None
    assert choose([*engines, engine("u", running=9)], {}, hashes, index, now=1).engine.id == "u"
    # Our own in-flight count fills an engine the heartbeat still shows with room.
    assert choose([engine("a", max_seqs=4)], {"a": 4}, hashes, index, now=1) is None


def test_room_counts_sequences_and_tokens_as_the_dispatcher_does() -> None:
    hashes = list(range(50))
    index = PrefixIndex(ttl=60)
    index.record("a", hashes, now=0)
    a = EngineInfo(id="a", model="m", max_seqs=4, running=2, max_tokens=1000)
    b = EngineInfo(id="b", model="m", max_seqs=4, max_tokens=1000)
    assert choose([a, b], {}, hashes, index, now=1).engine.id == "a"
    assert choose([a, b], {}, hashes, index, now=1, n=3).engine.id == "b"  # n > 1 choices
    held = {"a": 900}
    assert choose([a, b], {}, hashes, index, 1, tokens=held, need=100).engine.id == "a"
    assert choose([a, b], {}, hashes, index, 1, tokens=held, need=101).engine.id == "b"


def test_the_role_selects_the_engines_considered() -> None:
    hashes = list(range(50))
    index = PrefixIndex(ttl=60)
    index.record("p2", hashes, now=0)
    engines = [engine("u"), engine("p1", role="prefill"), engine("p2", role="prefill")]
    choice = choose(engines, {}, hashes, index, now=1, role="prefill")
    assert choice is not None and choice.engine.id == "p2" and choice.overlap_blocks == 50


def test_an_expired_or_forgotten_prefix_no_longer_attracts() -> None:
    hashes = list(range(50))
    index = PrefixIndex(ttl=10)
    index.record("b", hashes, now=0)
    engines = [engine("a"), engine("b")]
    assert choose(engines, {}, hashes, index, now=5).engine.id == "b"
    assert choose(engines, {}, hashes, index, now=11).engine.id == "a"
    index.record("b", hashes, now=20)
    index.forget("b")
    assert choose(engines, {}, hashes, index, now=21).engine.id == "a"


def test_ties_go_to_the_longer_overlap_then_lower_load_then_lowest_id() -> None:
    index = PrefixIndex(ttl=60)
    assert choose([engine("b"), engine("a"), engine("c")], {}, [1, 2], index, 0).engine.id == "a"
    # Same cost (prompt 2, scale 1): "b" saves one block, "a" is idle. The overlap wins.
    index.record("b", [1], now=0)
    tie = [engine("a", max_seqs=3), engine("b", max_seqs=3, running=1)]
    assert cost(2, 0, 0, 3, 1.0) == cost(2, 1, 1, 3, 1.0)
    assert choose(tie, {}, [1, 2], index, 0).engine.id == "b"


def test_the_choice_says_why_for_the_log() -> None:
    index = PrefixIndex(ttl=60)
    index.record("a", [1, 2, 3], now=0)
    choice = choose([engine("a", running=2)], {}, [1, 2, 3, 4], index, now=1)
    assert choice is not None
    assert (choice.overlap_blocks, choice.prompt_blocks, choice.used) == (3, 4, 2)
    assert choice.cost == pytest.approx(1 + 4 * 2 / 8)
    assert "engine a" in choice.describe() and "overlap 3/4" in choice.describe()


def test_overlap_matches_a_walk_to_the_first_miss_under_any_history() -> None:
    # The binary search relies on the fresh blocks of a chain being a prefix of it.
    rng = random.Random(7)
    trunks = [block_hashes([t] * 16 + list(range(rng.randrange(16, 400))), 16) for t in range(6)]
    index = PrefixIndex(ttl=25, max_blocks=40)
    now = 0.0
    for _ in range(400):
        now += rng.random() * 3
        trunk = rng.choice(trunks)
        step = rng.random()
        if step < 0.6:
            index.record("a", trunk[: rng.randrange(len(trunk) + 1)], now)
        elif step < 0.62:
            index.forget("a")
        elif step < 0.65:
            index.expire(now)
        probe = trunk[: rng.randrange(len(trunk) + 1)]
        blocks = index._engines.get("a", {})
        walk = 0
        for h in probe:
            if h not in blocks or blocks[h] < now - index.ttl:
                break
            walk += 1
        assert index.overlap("a", probe, now) == walk
