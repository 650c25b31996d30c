"""The simulated engine: deterministic real token IDs, engine-like finishes, one step clock."""

from __future__ import annotations

import asyncio
import itertools
import json
from importlib import resources
from pathlib import Path

import msgspec
import pytest
from tokenizers import Tokenizer

from engines.bridge import Refused
from engines.sim import SimConfig, SimEngine, StepClock, corpus_sentences
from tests.engines.emits import Emits
from tokenway.model import default_model_dir
from tokenway.wire import EngineWork, FinishReason, SamplingParams, StructuredOutputs

pytestmark = pytest.mark.asyncio(loop_scope="session")

EOS = 1
OUTPUT_LEN = 20


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    model_dir: Path = default_model_dir(tmp_path_factory.mktemp("sim-model"))
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def make_engine(
    tokenizer: Tokenizer, chunk_size: int = 1, output_len: int = OUTPUT_LEN
) -> SimEngine:
    config = SimConfig(
        id="sim-0",
        model="deepseek-v4",
        eos_token_id=EOS,
        chunk_size=chunk_size,
        ttft=0.0,
        itl=0.0,
        output_len=output_len,
    )
    return SimEngine(config, tokenizer)


@pytest.fixture(scope="module")
def engine(tokenizer: Tokenizer) -> SimEngine:
    return make_engine(tokenizer)


def work(rid: str = "r1", prompt: list[int] | None = None, **params: object) -> EngineWork:
    return EngineWork(
        rid=rid,
        attempt=0,
        owner="o1",
        token_ids=prompt or [0, 6366],
        sampling_params=SamplingParams(**params),  # type: ignore[arg-type]
    )


async def run(engine: SimEngine, w: EngineWork) -> Emits:
    emits = Emits()
    await engine.generate(w, emits)
    assert all(f is None for _, f, _, _ in emits.calls[:-1])  # only the last emit finishes
    return emits


async def test_the_same_seed_and_prompt_give_the_same_tokens(engine: SimEngine) -> None:
    a = await run(engine, work(seed=7, max_tokens=30, ignore_eos=True))
    b = await run(engine, work("r2", seed=7, max_tokens=30, ignore_eos=True))
    c = await run(engine, work(seed=8, max_tokens=30, ignore_eos=True))
    assert a.tokens() == b.tokens()
    assert a.tokens() != c.tokens()


async def test_without_a_seed_the_prompt_picks_the_output(engine: SimEngine) -> None:
    a = await run(engine, work(prompt=[0, 6366], max_tokens=30, ignore_eos=True))
    b = await run(engine, work("r2", prompt=[0, 6366], max_tokens=30, ignore_eos=True))
    c = await run(engine, work(prompt=[0, 6367], max_tokens=30, ignore_eos=True))
    assert a.tokens() == b.tokens() != c.tokens()


async def test_output_follows_the_corpus_in_vocabulary(
    engine: SimEngine, tokenizer: Tokenizer
) -> None:
    emits = await run(engine, work(seed=1, max_tokens=200, ignore_eos=True))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    assert all(0 <= t < vocab for t in emits.tokens())
    sentences = corpus_sentences(tokenizer)
    pairs = {(s[i], s[i + 1]) for s in sentences for i in range(len(s) - 1)}
    starts = {s[0] for s in sentences}
    # Each token continues the corpus or begins one of its sentences.
    tokens = emits.tokens()
    assert tokens[0] in starts
    assert all((a, b) in pairs or b in starts for a, b in itertools.pairwise(tokens))
    corpus = resources.files("engines").joinpath("corpus.txt").read_text(encoding="utf-8")
    text = tokenizer.decode(tokens)
    assert any(text.startswith(" " + line[:8]) for line in corpus.splitlines() if line)


@pytest.mark.parametrize("seed", [0, 4])
async def test_a_relayed_sequence_continues_as_the_unbroken_one(
    engine: SimEngine, seed: int
) -> None:
    """Prompt + a prefix of the output, with the budgets reduced by it, gives the rest."""
    prompt = [0, 6366]
    whole = await run(engine, work(prompt=prompt, seed=seed, max_tokens=400, min_tokens=30))
    assert whole.finish == ("stop", None)
    for k in (1, 13, 29, len(whole.tokens()) - 1):
        rest = await run(
            engine,
            work(prompt=prompt + whole.tokens()[:k], seed=seed, max_tokens=400 - k,
                 min_tokens=max(30 - k, 0)),
        )  # fmt: skip
        assert rest.tokens() == whole.tokens()[k:]
        assert rest.finish == whole.finish


async def test_eos_comes_at_sentence_ends_about_output_len_apart(
    engine: SimEngine, tokenizer: Tokenizer
) -> None:
    ends = {s[-1] for s in corpus_sentences(tokenizer)}
    lengths = []
    for seed in range(60):
        emits = await run(engine, work(seed=seed, max_tokens=1000))
        assert emits.tokens()[-1] == EOS and EOS not in emits.tokens()[:-1]
        assert emits.finish == ("stop", None)
        assert len(emits.tokens()) == 1 or emits.tokens()[-2] in ends
        lengths.append(len(emits.tokens()))
    assert OUTPUT_LEN / 2 <= sum(lengths) / len(lengths) <= OUTPUT_LEN * 2


async def natural(engine: SimEngine, seed: int) -> int:
    """Tokens before EOS when nothing limits the sequence."""
    return len((await run(engine, work(seed=seed, max_tokens=1000))).tokens()) - 1


@pytest.mark.parametrize("max_tokens", [1, 7, 50])
async def test_max_tokens_finishes_with_length_after_exactly_max_tokens(
    engine: SimEngine, max_tokens: int
) -> None:
    emits = await run(engine, work(seed=3, max_tokens=max_tokens, ignore_eos=True))
    assert len(emits.tokens()) == max_tokens
    assert emits.finish == ("length", None)


async def test_ignore_eos_runs_past_every_sentence_end(engine: SimEngine) -> None:
    limit = 3 * OUTPUT_LEN
    emits = await run(engine, work(seed=0, max_tokens=limit, ignore_eos=True))
    assert len(emits.tokens()) == limit and EOS not in emits.tokens()
    assert emits.finish == ("length", None)


async def test_max_tokens_before_eos_wins(engine: SimEngine) -> None:
    emits = await run(engine, work(seed=0, max_tokens=3))
    assert len(emits.tokens()) == 3 and EOS not in emits.tokens()
    assert emits.finish == ("length", None)


def _repeated_token(tokens: list[int]) -> tuple[int, int, int]:
    """A token with two occurrences: (token, first index, second index)."""
    seen: dict[int, int] = {}
    for i, t in enumerate(tokens):
        if t in seen:
            return t, seen[t], i
        seen[t] = i
    raise AssertionError("no token repeats")


async def test_a_stop_token_id_finishes_with_it_as_the_stop_reason(engine: SimEngine) -> None:
    free = await run(engine, work(seed=5, max_tokens=200, ignore_eos=True))
    stop, first, second = _repeated_token(free.tokens())
    emits = await run(engine, work(seed=5, max_tokens=200, ignore_eos=True, stop_token_ids=[stop]))
    assert emits.tokens() == free.tokens()[: first + 1]
    assert emits.finish == ("stop", stop)
    # Within min_tokens the stop token does not count: the next occurrence ends the sequence.
    emits = await run(
        engine,
        work(seed=5, max_tokens=200, ignore_eos=True, stop_token_ids=[stop], min_tokens=first + 1),
    )
    assert emits.tokens() == free.tokens()[: second + 1]
    assert emits.finish == ("stop", stop)


async def test_eos_does_not_finish_before_min_tokens(engine: SimEngine) -> None:
    free = await natural(engine, 0)
    min_tokens = free + 5
    emits = await run(engine, work(seed=0, max_tokens=free + 10, min_tokens=min_tokens))
    assert len(emits.tokens()) > min_tokens
    assert emits.finish[1] is None and emits.finish[0] in ("stop", "length")


async def test_eos_is_never_emitted_before_min_tokens(engine: SimEngine) -> None:
    free = await natural(engine, 0)
    emits = await run(engine, work(seed=0, max_tokens=free + 500, min_tokens=free + 5))
    assert EOS not in emits.tokens()[: free + 5]
    assert emits.finish == ("stop", None)


@pytest.mark.parametrize(("chunk_size", "sizes"), [(4, [4, 4, 2]), (5, [5, 5]), (16, [10])])
async def test_each_emit_carries_chunk_size_tokens(
    tokenizer: Tokenizer, chunk_size: int, sizes: list[int]
) -> None:
    engine = make_engine(tokenizer, chunk_size=chunk_size)
    emits = await run(engine, work(seed=2, max_tokens=10, ignore_eos=True))
    assert [len(ids) for ids, _, _, _ in emits.calls] == sizes
    one_by_one = await run(make_engine(tokenizer), work(seed=2, max_tokens=10, ignore_eos=True))
    assert emits.tokens() == one_by_one.tokens()


async def test_a_chunk_stops_at_eos(tokenizer: Tokenizer) -> None:
    engine = make_engine(tokenizer, chunk_size=4)
    free = await natural(make_engine(tokenizer), 9)
    emits = await run(engine, work(seed=9, max_tokens=1000))
    assert len(emits.tokens()) == free + 1 and emits.tokens()[-1] == EOS
    assert all(len(ids) == 4 for ids, _, _, _ in emits.calls[:-1])


async def test_running_counts_the_sequences_in_flight(engine: SimEngine) -> None:
    seen: list[int] = []

    def emit(
        ids: list[int],
        finish: FinishReason | None,
        reason: int | str | None,
        logprobs: object = None,
        index: int = 0,
        kv_transfer_params: object = None,
        cached_tokens: object = None,
    ) -> None:
        seen.append(engine.info().running)

    await asyncio.gather(
        engine.generate(work("a", seed=1, max_tokens=5, ignore_eos=True), emit),
        engine.generate(work("b", seed=2, max_tokens=5, ignore_eos=True), emit),
    )
    assert seen[0] == 2
    assert engine.running == 0 and engine.info().running == 0
    info = engine.info()
    assert (info.id, info.model, info.role, info.max_seqs) == ("sim-0", "deepseek-v4", "union", 256)


async def test_the_step_clock_wakes_all_waiters_of_a_step_together() -> None:
    clock = StepClock(0.0)
    log: list[tuple[int, str]] = []

    async def sequence(name: str, steps: int) -> None:
        for step in range(steps):
            await clock.tick()
            log.append((step, name))

    await asyncio.gather(sequence("a", 5), sequence("b", 5), sequence("c", 5))
    # Lockstep, like a batch: every waiter finishes step k before anyone sees step k + 1.
    assert [step for step, _ in log] == [s for s in range(5) for _ in range(3)]
    assert all({name for step, name in log if step == s} == {"a", "b", "c"} for s in range(5))


async def test_concurrent_sequences_advance_in_lockstep(engine: SimEngine) -> None:
    order: list[str] = []

    def emitter(rid: str):
        def emit(
            ids: list[int],
            finish: FinishReason | None,
            reason: int | str | None,
            logprobs: object = None,
            index: int = 0,
            kv_transfer_params: object = None,
            cached_tokens: object = None,
        ) -> None:
            order.append(rid)

        return emit

    await asyncio.gather(
        *(
            engine.generate(work(rid, seed=i, max_tokens=6, ignore_eos=True), emitter(rid))
            for i, rid in enumerate("xyz")
        )
    )
    steps = [order[i : i + 3] for i in range(0, len(order), 3)]
    assert len(steps) == 6 and all(sorted(step) == ["x", "y", "z"] for step in steps)


async def test_logprobs_come_per_token_sampled_first_then_candidates(engine: SimEngine) -> None:
    emits = Emits()
    await engine.generate(work(seed=4, max_tokens=6, ignore_eos=True, logprobs=2), emits)
    entries = [e for batch in emits.logprobs for e in batch or []]
    assert [e.token_id for e in entries] == emits.tokens()
    for e in entries:
        assert e.top[0].token_id == e.token_id and len(e.top) == 3
        assert all(0 <= c.token_id < engine.vocab_size for c in e.top)
        assert [c.logprob for c in e.top] == sorted((c.logprob for c in e.top), reverse=True)
    plain = Emits()
    await engine.generate(work(seed=4, max_tokens=6, ignore_eos=True), plain)
    assert plain.logprobs == [None] * len(plain.calls)


async def test_n_choices_run_as_separate_sequences(engine: SimEngine) -> None:
    emits = Emits()
    await engine.generate(work(seed=5, max_tokens=8, ignore_eos=True, n=3), emits)
    by_choice: dict[int, list[int]] = {}
    for ids, _, _, index in emits.calls:
        by_choice.setdefault(index, []).extend(ids)
    assert sorted(by_choice) == [0, 1, 2]
    assert all(len(ids) == 8 for ids in by_choice.values())
    assert len({tuple(ids) for ids in by_choice.values()}) == 3  # each its own seed
    assert by_choice[0] == (await run(engine, work(seed=5, max_tokens=8, ignore_eos=True))).tokens()


def markers(tokenizer: Tokenizer) -> tuple[int, int]:
    start, end = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    assert start is not None and end is not None
    return start, end


@pytest.mark.parametrize("seed", range(8))
async def test_open_reasoning_ends_by_itself_and_the_answer_follows(
    engine: SimEngine, tokenizer: Tokenizer, seed: int
) -> None:
    """A prompt that leaves the model reasoning, with no budget: it reasons a while (never
    stopping there), ends its reasoning at a sentence end, then answers and stops."""
    start, end = markers(tokenizer)
    emits = await run(engine, work(prompt=[0, 6366, start], seed=seed, max_tokens=1000))
    tokens = emits.tokens()
    assert tokens.count(end) == 1 and EOS not in tokens[: tokens.index(end)]
    thought, answer = tokens[: tokens.index(end)], tokens[tokens.index(end) + 1 : -1]
    assert OUTPUT_LEN // 4 <= len(thought) and answer, tokens
    assert emits.finish == ("stop", None) and tokens[-1] == EOS
    ends = {s[-1] for s in corpus_sentences(tokenizer)}
    assert thought[-1] in ends  # a thought ends with its sentence
    again = await run(engine, work("r2", prompt=[0, 6366, start], seed=seed, max_tokens=1000))
    assert again.tokens() == tokens


@pytest.mark.parametrize("seed", [0, 4])
async def test_a_relayed_reasoning_ends_where_the_unbroken_one_does(
    engine: SimEngine, tokenizer: Tokenizer, seed: int
) -> None:
    start, end = markers(tokenizer)
    prompt = [0, 6366, start]
    whole = (await run(engine, work(prompt=prompt, seed=seed, max_tokens=1000))).tokens()
    at = whole.index(end)
    for k in (1, at - 1, at, at + 1, at + 2):
        rest = await run(engine, work(prompt=prompt + whole[:k], seed=seed, max_tokens=1000 - k))
        assert rest.tokens() == whole[k:], k


async def test_a_thinking_budget_ends_the_reasoning_after_that_many_tokens(
    engine: SimEngine, tokenizer: Tokenizer
) -> None:
    start, end = markers(tokenizer)
    prompt = [0, 6366, start]
    free = (await run(engine, work(prompt=prompt, seed=2, max_tokens=1000))).tokens()
    cut = (await run(engine, work(prompt=prompt, seed=2, max_tokens=1000,
                                  thinking_token_budget=3))).tokens()  # fmt: skip
    assert cut[:4] == [*free[:3], end] and cut.count(end) == 1 and cut[4:-1]
    late = free.index(end) + 5  # a budget beyond the model's own end changes nothing
    assert (await run(engine, work(prompt=prompt, seed=2, max_tokens=1000,
                                   thinking_token_budget=late))).tokens() == free  # fmt: skip
    closed = [0, 6366, start, 6366, end]  # the prompt's reasoning is over: nothing to end
    assert end not in (await run(engine, work(prompt=closed, seed=2, max_tokens=200,
                                              thinking_token_budget=0))).tokens()  # fmt: skip


async def test_a_simulated_engine_keeps_none_of_the_work_it_is_sent(tokenizer: Tokenizer) -> None:
    """As `tokenway up` builds it: it kept every attempt's work (prompt IDs and all) for
    tests to read, so `up`'s memory grew by the prompts of every request it served."""
    served = SimEngine(SimConfig(id="kept", model="m", eos_token_id=1, itl=0.0), tokenizer)
    await run(served, work("r1", prompt=list(range(100, 600)), max_tokens=2))
    assert served.received is None


@pytest.mark.parametrize(
    ("so", "says"),
    [(StructuredOutputs(structural_tag=json.dumps({"type": "structural_tag", "format": {
        "type": "qwen_xml_parameter", "json_schema": {"type": "object"}}})),
      "cannot decode this constraint"),
     (StructuredOutputs(regex="(("), "the constraint does not compile")],
    ids=["not-decoded-here", "does-not-compile"],
)  # fmt: skip
async def test_a_constraint_it_cannot_decode_is_refused_as_the_requests_fault(
    engine: SimEngine, so: StructuredOutputs, says: str
) -> None:
    """Not an engine failure (the bridge would relay it and the owner count it against the
    engine): the request's own 400, whichever of its `n` sequences meets it first."""
    with pytest.raises(Refused, match=says) as refused:
        await engine.generate(work(max_tokens=5, n=2, structured_outputs=so), Emits())
    assert refused.value.status == 400 and engine.running == 0


async def test_a_prompt_sent_again_finds_its_whole_blocks_in_the_prefix_cache(
    tokenizer: Tokenizer,
) -> None:
    """As vLLM's: the leading whole blocks a previous prompt left, never the block holding
    the last prompt token (computed to sample from), said once per choice, on its first
    step; a cache salt keeps prompts apart."""
    engine = make_engine(tokenizer)
    prompt = list(range(100, 150))  # 3 whole blocks of 16 and 2 tokens
    said = await run(engine, work(prompt=prompt, max_tokens=3, ignore_eos=True))
    assert said.cached == [0, None, None]
    again = Emits()  # two choices, two finishes
    await engine.generate(work("r2", prompt=prompt, max_tokens=3, ignore_eos=True, n=2), again)
    assert sorted(c for c in again.cached if c is not None) == [48, 48]
    longer = await run(engine, work("r3", prompt=[*prompt[:40], 7, 8], max_tokens=1))
    assert longer.cached == [32]  # the blocks it shares
    exact = await run(engine, work("r4", prompt=prompt[:48], max_tokens=1))
    assert exact.cached == [32]  # its last block holds its last token
    salted = msgspec.structs.replace(work("r5", prompt=prompt, max_tokens=1), cache_salt="t")
    assert (await run(engine, salted)).cached == [0]
