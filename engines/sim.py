"""A simulated engine: real token IDs of the model's vocabulary, engine-like timing, no GPU.

Output is deterministic: a toy language model over a multilingual corpus continues the
context (so detokenization meets CJK, emoji and combining marks, and a relayed sequence
continues as the unbroken one would). Every
running sequence advances on one shared step clock, like a batch in a real engine.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources

from tokenizers import Tokenizer

from engines.bridge import Emit, Refused
from engines.guided import Guide, matcher
from tokenway.block_hashes import block_hashes
from tokenway.obfuscation import Permutation
from tokenway.parsers import THINK_END, THINK_START, last_marker
from tokenway.wire import (
    EngineInfo,
    EngineWork,
    FinishReason,
    LogprobEntry,
    Role,
    SamplingParams,
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
    # a user's turn whose constraint names tools is answered with a call (`Turns`)
    tool_calls: bool = False
    kv_block_size: int = 16  # the prefix cache's block, as the owners' `kv_block_size`
    prefix_cache_blocks: int = 1 << 14  # how many blocks the prefix cache remembers
    # fault knobs, for tests that cause faults for real
    fail_first: int = 0  # this many requests fail at once with an engine error
    stall_after: int | None = None  # every sequence goes silent after this many tokens
    fail_after: int | None = None  # the first request fails (engine error) after these tokens


def corpus_sentences(tokenizer: Tokenizer) -> list[list[int]]:
    """The corpus, one token list per sentence, each led by a space so sentences join."""
    text = resources.files("engines").joinpath("corpus.txt").read_text(encoding="utf-8")
    return [
        tokenizer.encode(" " + line, add_special_tokens=False).ids
        for line in text.splitlines()
        if line
    ]


def seed_of(params: SamplingParams, index: int) -> int:
    """Choice `index`'s seed; without one the output is greedy-like: a function of the prompt."""
    return (params.seed or 0) + index


@dataclass(frozen=True)
class Turns:
    """What the model knows of its own chat template (tokenway/chat_template.jinja, the
    DeepSeek format), as a real model knows the format it was trained on: a user's turn
    opens with <｜User｜>, a tool's output with <｜tool▁output▁begin｜>. With tool calls on
    (`SimConfig.tool_calls`), it calls a tool where the prompt's last turn is a user's and
    answers in text where it is a tool's output, so a client's tool loop ends."""

    user: int
    tool_output: int

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> Turns | None:
        user = tokenizer.token_to_id("<｜User｜>")
        tool_output = tokenizer.token_to_id("<｜tool▁output▁begin｜>")
        return None if user is None or tool_output is None else cls(user, tool_output)

    def asked(self, prompt: list[int]) -> list[int] | None:
        """The prompt's last turn where it is a user's (to the generation prompt), else None."""
        if last_marker(prompt, self.user, self.tool_output) != self.user:
            return None
        return prompt[len(prompt) - prompt[::-1].index(self.user) :]


END = -1  # a sentence's end, in the successor table
ORDER = 3  # context tokens the model looks at


class CorpusModel:
    """A deterministic toy language model trained on the corpus.

    The next token is a function of the seed, the context's length and its last tokens
    (the longest suffix of up to three the corpus knows); at a sentence's end the model may
    stop, or start a sentence the seed and context pick. Being a function of the context, a
    sequence resumed from a prefix of its own output (a relay) continues exactly as the
    unbroken one would have, as a greedy or seeded real model does.

    `markers`: the reasoning's (start, end) tokens, where the model reasons. A context whose
    last marker is the start leaves it reasoning: it does not stop then, and it ends its
    reasoning itself with the end marker at a sentence's end, once it has reasoned a length
    the seed and the reasoning's start pick (a quarter to a half of `output_len`), so its
    answer follows.
    """

    def __init__(self, sentences: list[list[int]], markers: tuple[int, int] | None = None) -> None:
        self.sentences = sentences
        self.markers = markers
        self.table: dict[tuple[int, ...], list[int]] = {}
        for sentence in sentences:
            seq = [*sentence, END]
            for i in range(1, len(seq)):
                for k in range(1, min(ORDER, i) + 1):
                    self.table.setdefault(tuple(seq[i - k : i]), []).append(seq[i])
        self.mean_sentence = sum(map(len, sentences)) / len(sentences)

    def tokens(
        self, prompt: list[int], seed: int, output_len: int, budget: int | None = None
    ) -> Iterator[tuple[int, bool]]:
        """(next token, whether the model would rather stop there), forever; it stops at one
        sentence end in so many that outputs run about `output_len` tokens. `budget`
        (vLLM's `thinking_token_budget`): the reasoning ends after that many tokens at most."""
        stop_odds = max(1, round(output_len / self.mean_sentence))
        tail = tuple(prompt[-ORDER:])
        position = len(prompt)  # in the key too, or a repeated phrase would loop for ever
        thinking = self._reasoning(prompt, seed, output_len)  # where it may end, None: not
        last = None if budget is None else position + budget  # where it must have ended
        while True:
            candidates = next(
                (c for k in range(len(tail)) if (c := self.table.get(tail[k:]))), None
            )
            key = hash((seed, position, *tail))  # ints hash alike in every process
            tid = END if candidates is None else candidates[key % len(candidates)]
            wants_stop = False
            if thinking is not None and (position == last or (tid == END and position >= thinking)):
                assert self.markers is not None
                tid, thinking = self.markers[1], None
            elif tid == END:  # a sentence ended (or the context is unknown): begin another
                wants_stop = thinking is None and candidates is not None
                wants_stop = wants_stop and (key >> 8) % stop_odds == 0
                tid = self.sentences[(key >> 16) % len(self.sentences)][0]
            yield tid, wants_stop
            tail = (*tail, tid)[-ORDER:]
            position += 1

    def _reasoning(self, prompt: list[int], seed: int, output_len: int) -> int | None:
        """Where the reasoning the prompt leaves open may end (a position in the context),
        a function of the seed and the context up to where the reasoning began, so a relay
        of it ends it where the unbroken sequence does; None where it leaves none open."""
        if self.markers is None or last_marker(prompt, *self.markers) != self.markers[0]:
            return None
        began = len(prompt) - prompt[::-1].index(self.markers[0])
        quarter = max(1, output_len // 4)
        key = hash((seed, began, *prompt[max(0, began - ORDER) : began]))
        return began + quarter + key % (quarter + 1)


class Sequence:
    """One choice's output, step by step, with an engine's finish rules: EOS is masked until
    `min_tokens`, a stop token ID ends with itself as the reason, `max_tokens` ends with
    "length".

    `trained_on`: the engine runs the model trained on that permutation of the vocabulary
    (token obfuscation), so it reads and writes physical IDs: `eos`, `prompt` and `params`
    are physical, and it says what the model says, mapped.
    """

    def __init__(
        self,
        model: CorpusModel,
        eos: int,
        prompt: list[int],
        params: SamplingParams,
        index: int,
        output_len: int,
        trained_on: Permutation | None = None,
        guide: Guide | None = None,
        think_end: int | None = None,
        turns: Turns | None = None,
    ) -> None:
        if trained_on is not None:
            prompt = trained_on.to_semantic(prompt, "the prompt")
        seed = seed_of(params, index)
        self.tokens = model.tokens(prompt, seed, output_len, params.thinking_token_budget)
        if guide is not None:  # under a constraint: what the grammar allows of it
            asked = None if turns is None else turns.asked(prompt)
            self.tokens = guide.tokens(self.tokens, prompt, seed, think_end, asked)
        self.trained_on = trained_on
        self.eos = eos
        self.limit = params.max_tokens if params.max_tokens is not None else 1 << 30
        self.min_tokens = params.min_tokens
        self.ignore_eos = params.ignore_eos
        self.stop_ids = set(params.stop_token_ids)
        self.made = 0

    def step(self, chunk: int) -> tuple[list[int], FinishReason | None, int | None]:
        out: list[int] = []
        for _ in range(chunk):
            tid, wants_stop = next(self.tokens)
            if self.trained_on is not None:
                [tid] = self.trained_on.to_physical([tid])
            if wants_stop and not self.ignore_eos and self.made >= self.min_tokens:
                tid = self.eos
            out.append(tid)
            self.made += 1
            if self.made > self.min_tokens and tid == self.eos:
                return out, "stop", None
            if self.made > self.min_tokens and tid in self.stop_ids:
                return out, "stop", tid
            if self.made >= self.limit:
                return out, "length", None
        return out, None, None


class PrefixCache:
    """Which prompt blocks the engine holds, as vLLM's prefix cache knows them: whole KV
    blocks, each by a hash of its tokens and every token before it (and the cache salt), the
    least recently used forgotten past `blocks`."""

    def __init__(self, block_size: int, blocks: int) -> None:
        self.block_size = block_size
        self.blocks = blocks
        self.held: OrderedDict[int, None] = OrderedDict()

    def prefill(self, prompt: list[int], salt: str | None) -> int:
        """The prompt's tokens found cached (its leading whole blocks), then its blocks
        cached. The block holding the last prompt token is computed anyway, as vLLM does:
        the first output token is sampled from it."""
        hashes = block_hashes(prompt, self.block_size, salt)
        usable = (len(prompt) - 1) // self.block_size
        hits = 0
        while hits < usable and hashes[hits] in self.held:
            hits += 1
        for h in hashes:
            self.held[h] = None
            self.held.move_to_end(h)
        while len(self.held) > self.blocks:
            self.held.popitem(last=False)
        return hits * self.block_size


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
    serves one: it speaks physical IDs only. The real engine never holds the key; the
    simulation needs it to know what such a model says."""

    def __init__(
        self, config: SimConfig, tokenizer: Tokenizer, trained_on: Permutation | None = None
    ) -> None:
        self.config = config
        self.trained_on = trained_on
        self.eos_token_id = config.eos_token_id
        if trained_on is not None:  # the EOS of the model trained on the permuted vocabulary
            [self.eos_token_id] = trained_on.to_physical([config.eos_token_id])
        self.tokenizer = tokenizer
        self.think_end = tokenizer.token_to_id(THINK_END)  # None: the model does not reason
        think_start = tokenizer.token_to_id(THINK_START)
        markers = (
            None if think_start is None or self.think_end is None else (think_start, self.think_end)
        )
        self.model = CorpusModel(corpus_sentences(tokenizer), markers)
        self.turns = Turns.of(tokenizer) if config.tool_calls else None
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.clock = StepClock(config.itl * config.chunk_size)
        self.cache = PrefixCache(config.kv_block_size, config.prefix_cache_blocks)
        self.running = 0
        self.started = 0  # requests taken, for fault knobs and tests
        # Every attempt's work, as the engine saw it, where a test asks (a list): a server
        # keeps none, or it would hold every prompt it was ever sent.
        self.received: list[EngineWork] | None = None

    def info(self) -> EngineInfo:
        c = self.config
        return EngineInfo(
            id=c.id, model=c.model, role=c.role, max_seqs=c.max_seqs, running=self.running
        )

    async def healthy(self) -> str | None:
        return None  # in process: up as long as the bridge is

    async def aclose(self) -> None:
        """Nothing to release: no connections."""

    async def generate(self, work: EngineWork, emit: Emit) -> None:
        """All `n` choices of a request, side by side, each a sequence of its own."""
        self.started += 1
        if self.received is not None:
            self.received.append(work)
        if self.started <= self.config.fail_first:
            raise RuntimeError(f"simulated failure {self.started} of {self.config.fail_first}")
        n = max(work.sampling_params.n, 1)
        cached = self.cache.prefill(work.token_ids, work.cache_salt)
        self.running += n
        try:
            async with asyncio.TaskGroup() as group:
                doomed = self.started == 1 and self.config.fail_after is not None
                for index in range(n):
                    group.create_task(self._sequence(work, emit, index, doomed, cached))
        except* Refused as refused:  # a constraint it cannot decode: the request's fault
            raise refused.exceptions[0] from None
        except* RuntimeError as failed:  # a simulated fault: the engine reports it as itself
            raise failed.exceptions[0] from None
        finally:
            self.running -= n

    async def _sequence(
        self, work: EngineWork, emit: Emit, index: int, doomed: bool, cached: int
    ) -> None:
        """One choice; its first step says the prompt tokens `cached`, as vLLM's first output
        of a request does."""
        params = work.sampling_params
        c = self.config
        so = params.structured_outputs
        guide = None if so is None else await matcher(self.tokenizer, c.eos_token_id, so)
        # the reasoning's end marker, where the request's reasoning is still open
        think_end = self.think_end if work.reasoning_ended is False else None
        seq = Sequence(
            self.model,
            self.eos_token_id,
            work.token_ids,
            params,
            index,
            c.output_len,
            self.trained_on,
            guide,
            think_end,
            self.turns,
        )
        if self.config.ttft:
            await asyncio.sleep(self.config.ttft)  # simulated prefill time
        first = True
        while True:
            await self.clock.tick()
            out, finish, reason = seq.step(self.config.chunk_size)
            kv = self._handoff(work) if finish else None
            emit(
                out,
                finish,
                reason,
                self._logprobs(out, params.logprobs),
                index,
                kv,
                cached if first else None,
            )
            first = False
            if finish:
                return
            if doomed and seq.made >= (self.config.fail_after or 0):
                raise RuntimeError(f"simulated failure after {seq.made} tokens")
            if self.config.stall_after is not None and seq.made >= self.config.stall_after:
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
