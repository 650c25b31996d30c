"""The keyed vocabulary permutation (pure): a bijection per key, mapped at the bridge."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tokenway.obfuscation import (
    MIN_KEY_BYTES,
    ObfuscationError,
    Permutation,
    fingerprint,
    load_key,
)
from tokenway.wire import EngineWork, LogprobEntry, SamplingParams, TokenLogprob

VOCAB = 129280  # the bundled model's
KEY = b"k" * 32


@pytest.fixture(scope="module")
def perm() -> Permutation:
    return Permutation(KEY, VOCAB)


def test_it_is_a_bijection_over_the_whole_vocabulary(perm: Permutation) -> None:
    everything = list(range(VOCAB))
    physical = perm.to_physical(everything)
    assert sorted(physical) == everything
    assert perm.to_semantic(physical) == everything
    moved = sum(p != s for s, p in enumerate(physical))
    assert moved > VOCAB * 0.99  # a shuffle, not the identity


def test_the_same_key_gives_the_same_permutation_and_another_key_another() -> None:
    a, b = Permutation(KEY, 1000), Permutation(KEY, 1000)
    other = Permutation(b"j" * 32, 1000)
    ids = list(range(1000))
    assert a.to_physical(ids) == b.to_physical(ids)
    assert a.to_physical(ids) != other.to_physical(ids)
    # Pinned: a scheduler and a bridge on other machines (or versions) must agree.
    assert Permutation(b"0123456789abcdef", 10).to_physical(list(range(10))) == [
        4, 2, 8, 5, 7, 6, 0, 3, 1, 9,
    ]  # fmt: skip


def test_the_fingerprint_identifies_key_and_vocabulary_without_revealing_the_key() -> None:
    assert fingerprint(KEY, VOCAB) == Permutation(KEY, VOCAB).fingerprint
    assert fingerprint(KEY, VOCAB) != fingerprint(KEY, VOCAB + 1)
    assert fingerprint(KEY, VOCAB) != fingerprint(b"j" * 32, VOCAB)
    assert KEY.hex() not in fingerprint(KEY, VOCAB) and "kkkk" not in repr(Permutation(KEY, 10))


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 5, -1])
def test_an_id_outside_the_vocabulary_is_an_error_never_passed_through(
    perm: Permutation, bad: int
) -> None:
    with pytest.raises(ObfuscationError, match=f"token ID {bad}, outside the vocabulary"):
        perm.to_physical([1, bad, 2])
    with pytest.raises(ObfuscationError, match="engine output"):
        perm.to_semantic([bad])


def test_work_maps_the_prompt_and_every_id_in_the_sampling_params(perm: Permutation) -> None:
    params = SamplingParams(seed=3, stop_token_ids=[5, 6], logit_bias={"7": -2.0, "9": 1.5})
    work = EngineWork(
        rid="r", attempt=0, owner="o", token_ids=[1, 2, 3], sampling_params=params, native_ok=True
    )
    out = perm.work_to_physical(work)
    assert out.token_ids == perm.to_physical([1, 2, 3]) != [1, 2, 3]
    assert out.sampling_params.stop_token_ids == perm.to_physical([5, 6])
    p7, p9 = perm.to_physical([7, 9])
    assert out.sampling_params.logit_bias == {str(p7): -2.0, str(p9): 1.5}
    assert out.sampling_params.seed == 3 and out.native_ok is False  # never a native fallback
    assert work.token_ids == [1, 2, 3]  # the owner's work is untouched
    bad = EngineWork(rid="r", attempt=0, owner="o", token_ids=[1],
                     sampling_params=SamplingParams(logit_bias={"x": 1.0}))  # fmt: skip
    with pytest.raises(ObfuscationError, match="logit_bias keys must be token IDs"):
        perm.work_to_physical(bad)


def test_output_maps_back_ids_stop_reasons_and_logprob_candidates(perm: Permutation) -> None:
    p = perm.to_physical([10, 11, 12])
    entry = LogprobEntry(
        token_id=p[0], logprob=-0.5, rank=1,
        top=[TokenLogprob(p[0], -0.5, 1), TokenLogprob(p[1], -1.0, 2)],
    )  # fmt: skip
    (back,) = perm.logprobs_to_semantic([entry])
    assert back == LogprobEntry(
        token_id=10, logprob=-0.5, rank=1,
        top=[TokenLogprob(10, -0.5, 1), TokenLogprob(11, -1.0, 2)],
    )  # fmt: skip
    assert perm.stop_reason_to_semantic(p[2]) == 12
    assert perm.stop_reason_to_semantic("</s>") == "</s>"  # a stop string is text
    assert perm.stop_reason_to_semantic(None) is None


def test_keys_come_from_the_flag_or_a_file_and_an_unusable_one_is_refused(
    tmp_path: Path,
) -> None:
    assert load_key(None, None) is None
    assert load_key("  " + "a" * 20 + "\n", None) == b"a" * 20
    good = tmp_path / "key"
    good.write_bytes(b"s3cret-" * 4 + b"\n")
    assert load_key(None, str(good)) == b"s3cret-" * 4
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for key, path, needle in [
        ("", None, "holds 0 bytes"),
        ("short", None, f"needs at least {MIN_KEY_BYTES}"),
        (None, str(empty), "holds 0 bytes"),
        (None, str(tmp_path / "missing"), "cannot read --obfuscation-key-file"),
        ("a" * 20, str(good), "not both"),
        (None, "", "names no file"),
    ]:
        with pytest.raises(ObfuscationError, match=needle):
            load_key(key, path)


def test_building_and_mapping_are_cheap_enough_for_the_hot_path() -> None:
    """Measured: ~60 ms to build for 129k tokens, ~35 ns per token mapped in batches."""
    start = time.perf_counter()
    perm = Permutation(KEY, VOCAB)
    built = time.perf_counter() - start
    ids = list(range(0, VOCAB, 7))
    start = time.perf_counter()
    for _ in range(10):
        perm.to_semantic(perm.to_physical(ids))
    per_token = (time.perf_counter() - start) / (20 * len(ids))
    assert built < 2.0 and per_token < 2e-6  # generous: a loaded 2-core machine
