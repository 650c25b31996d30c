"""A simulated engine: real token IDs of the model's vocabulary, engine-like timing, no GPU.

Output is deterministic: the sampling seed (or, without one, the prompt) picks sentences
from a multilingual corpus, so detokenization meets CJK, emoji and combining marks. Every
running sequence advances on one shared step clock, like a batch in a real engine.
"""

from __future__ import annotations

import asyncio
import random
import zlib
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources

from tokenizers import Tokenizer

from engines.bridge import Emit
from tokenway.obfuscation import Permutation
from tokenway.wire import (
    EngineInfo,
    EngineWork,
    FinishReason,
    LogprobEntry,
    Role,
    TokenLogprob,
)


@dataclass(frozen=True)
class SimConfig:
    id: str
    model: str
    eos_token_id: int
    role: Role = "union"
    max_seqs: int = 256
    chunk_size: int = 1  # tokens per sequence per step
    ttft: float = 0.02  # seconds before the first step of a sequence
    itl: float = 0.01  # seconds per token
    output_len: int = 200  # mean natural length before EOS
    # fault knobs, for tests that cause faults for real
    fail_first: int = 0  # this many requests fail at once with an engine error
    stall_after: int | None = None  # every sequence goes silent after this many tokens


def corpus_sentences(tokenizer: Tokenizer) -> list[list[int]]:
    """The corpus, one token list per sentence, each led by a space so sentences join."""
    text = resources.files("engines").joinpath("corpus.txt").read_text(encoding="utf-8")
    return [
        tokenizer.encode(" " + line, add_special_tokens=False).ids
        for line in text.splitlines()
        if line
    ]


def seed_of(work: EngineWork) -> int:
    if work.sampling_params.seed is not None:
        return work.sampling_params.seed
    return zlib.crc32(array("I", work.token_ids).tobytes())


def token_stream(sentences: list[list[int]], seed: int) -> Iterator[int]:
    rng = random.Random(seed)
    while True:
        yield from sentences[rng.randrange(len(sentences))]


def natural_length(seed: int, mean: int) -> int:
    return random.Random(seed ^ 0x5EED).randint(max(1, mean // 2), max(1, mean * 3 // 2))


class StepClock:
    """One step for all running sequences: waiters of a step wake together."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._step: asyncio.Event | None = None

    async def tick(self) -> None:
        if self._step is None:
            self._step = asyncio.Event()
            asyncio.get_running_loop().call_later(self.interval, self._fire)
        await self._step.wait()

    def _fire(self) -> None:
        step, self._step = self._step, None
        assert step is not None
        step.set()


class SimEngine:
    """`trained_on`: a model trained on a permuted vocabulary, as an obfuscated engine
    serves one: it speaks physical IDs only (its corpus and EOS mapped forward). The real
    engine never holds the key; the simulation needs it to know what such a model says."""

    def __init__(
        self, config: SimConfig, tokenizer: Tokenizer, trained_on: Permutation | None = None
    ) -> None:
        self.config = config
        self.sentences = corpus_sentences(tokenizer)
        self.eos_token_id = config.eos_token_id
        if trained_on is not None:
            self.sentences = [trained_on.to_physical(s) for s in self.sentences]
            [self.eos_token_id] = trained_on.to_physical([config.eos_token_id])
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.clock = StepClock(config.itl * config.chunk_size)
        self.running = 0
        self.started = 0  # requests taken, for fault knobs and tests
        self.received: list[EngineWork] = []  # every attempt's work, as the engine saw it

    def info(self) -> EngineInfo:
        c = self.config
        return EngineInfo(
            id=c.id, model=c.model, role=c.role, max_seqs=c.max_seqs, running=self.running
        )

    async def aclose(self) -> None:
        """Nothing to release: no connections."""

    async def generate(self, work: EngineWork, emit: Emit) -> None:
        """All `n` choices of a request, side by side, each a sequence of its own."""
        self.started += 1
        self.received.append(work)
        if self.started <= self.config.fail_first:
            raise RuntimeError(f"simulated failure {self.started} of {self.config.fail_first}")
        n = max(work.sampling_params.n, 1)
        self.running += n
        try:
            async with asyncio.TaskGroup() as group:
                for index in range(n):
                    group.create_task(self._sequence(work, emit, index))
        finally:
            self.running -= n

    async def _sequence(self, work: EngineWork, emit: Emit, index: int) -> None:
        params = work.sampling_params
        seed = seed_of(work) + index
        tokens = token_stream(self.sentences, seed)
        limit = params.max_tokens if params.max_tokens is not None else 1 << 30
        # Like a real engine, EOS is masked until min_tokens.
        natural = (
            None
            if params.ignore_eos
            else max(natural_length(seed, self.config.output_len), params.min_tokens)
        )
        stop_ids = set(params.stop_token_ids)
        made = 0
        if self.config.ttft:
            await asyncio.sleep(self.config.ttft)  # simulated prefill time
        while True:
            await self.clock.tick()
            out: list[int] = []
            finish: FinishReason | None = None
            reason: int | str | None = None
            for _ in range(self.config.chunk_size):
                tid = self.eos_token_id if made == natural else next(tokens)
                out.append(tid)
                made += 1
                if made > params.min_tokens and tid == self.eos_token_id:
                    finish = "stop"
                elif made > params.min_tokens and tid in stop_ids:
                    finish, reason = "stop", tid
                elif made >= limit:
                    finish = "length"
                if finish:
                    break
            kv = self._handoff(work) if finish else None
            emit(out, finish, reason, self._logprobs(out, params.logprobs), index, kv)
            if finish:
                return
            if self.config.stall_after is not None and made >= self.config.stall_after:
                await asyncio.Event().wait()  # alive but silent, until aborted

    def _handoff(self, work: EngineWork) -> dict[str, object] | None:
        """A prefill engine asked for remote decode answers with where its KV blocks are,
        shaped like vLLM's KV connectors answer (`do_remote_prefill` for the decode side)."""
        asked = work.kv_transfer_params or {}
        if self.config.role != "prefill" or not asked.get("do_remote_decode"):
            return None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.config.id,
            "remote_request_id": f"{work.rid}-{work.attempt}",
            "remote_block_ids": list(range(len(work.token_ids) // 16 + 1)),
            "remote_host": "127.0.0.1",
            "remote_port": 0,
        }

    def _logprobs(self, ids: list[int], top: int | None) -> list[LogprobEntry] | None:
        """Made-up but well-formed: the sampled token first, then `top` candidates by rank."""
        if top is None:
            return None
        out = []
        for tid in ids:
            lp = -0.25 - (tid % 7) / 8
            alts = [
                TokenLogprob(
                    token_id=(tid + k * 7919) % self.vocab_size, logprob=lp - k, rank=k + 1
                )
                for k in range(1, top + 1)
            ]
            head = TokenLogprob(token_id=tid, logprob=lp, rank=1)
            out.append(LogprobEntry(token_id=tid, logprob=lp, rank=1, top=[head, *alts]))
        return out
