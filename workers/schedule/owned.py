"""One owned request's bookkeeping: which attempt is live, what is pending, what is committed.

Pure: the shell feeds it engine deltas and derender results and asks what to do next. A
request has one `Choice` per `n`; each streams and commits on its own, and the request
ends when every choice has committed its last chunk. When an engine fails an attempt, the
request rolls back to what is committed and a relay attempt continues from there.
"""

from __future__ import annotations

import asyncio
from array import array
from dataclasses import dataclass, field
from typing import Any

import msgspec
from msgspec import Struct

from tokenway.errors import EngineFailed, refused
from tokenway.spans import OFF, Span
from tokenway.wire import (
    Delivered,
    DerenderEntry,
    ErrorInfo,
    FinishReason,
    GenerateRequest,
    LogprobEntry,
    OutputContext,
    SamplingParams,
    TokenDelta,
)


class RelayRefused(EngineFailed):
    """An attempt failed after output that a new attempt could not continue faithfully."""


# An attempt's number carries the request's TW_SCHED delivery in its high bits: the owner that
# takes a request over counts from a base no earlier owner reaches, so two owners never name
# an attempt alike at an engine (which knows work by request key and attempt).
_ATTEMPTS_PER_OWNER = 1 << 16


def first_attempt(delivery: int) -> int:
    """Where the attempts of the owner of a request's `delivery`-th delivery start."""
    return delivery * _ATTEMPTS_PER_OWNER


def refusal(delta: TokenDelta) -> bool:
    """The delta ends its attempt with the engine's refusal of the request itself (a 4xx):
    the request's fault, which no other engine would answer otherwise."""
    return delta.error is not None and delta.refused is not None and 400 <= delta.refused < 500


@dataclass(eq=False)
class Choice:
    index: int
    state: bytes | None = None  # last committed stream_state (opaque: derender's)
    pending: list[int] = field(default_factory=list)  # engine tokens not yet derendered
    pending_logprobs: list[LogprobEntry] | None = None  # theirs, when logprobs were asked
    finish: FinishReason | None = None
    stop_reason: int | str | None = None
    engine_done: bool = False  # the engine reported this choice's end
    done: bool = False  # its last chunk is committed
    busy: bool = False  # a derender + commit is in flight
    made: int = 0  # output tokens the live attempt produced for it
    # Committed output token IDs, 4 bytes each: what a relay appends to the prompt.
    committed: array = field(default_factory=lambda: array("i"))

    def take(self, ctx: OutputContext, prompt: list[int]) -> DerenderEntry:
        tokens, self.pending = self.pending, []
        lps, self.pending_logprobs = self.pending_logprobs, None
        self.busy = True
        needs_prompt = self.state is None and (ctx.echo or ctx.return_token_ids)
        closing = ctx.api == "responses" and ctx.stream and self.finish is not None
        return DerenderEntry(
            output_ids=list(self.committed) if closing else None,
            context=ctx,
            state=self.state,
            token_ids=tokens,
            finish_reason=self.finish,
            stop_reason=self.stop_reason,
            prompt_token_ids=prompt if needs_prompt else None,
            index=self.index,
            logprobs=lps,
        )

    def hold_back(self, entry: DerenderEntry) -> None:
        """Nothing became visible (a partial character): keep the tokens for the next chunk."""
        self.pending = entry.token_ids + self.pending
        if entry.logprobs is not None:
            self.pending_logprobs = entry.logprobs + (self.pending_logprobs or [])

    def roll_back(self) -> None:
        """Forget what the failed attempt sent beyond the committed output."""
        self.pending, self.pending_logprobs = [], None
        self.finish = self.stop_reason = None
        self.engine_done = False
        self.made = 0


class Done(Struct, frozen=True, tag=True):
    """Its output ended (here, or under its last owner)."""


class Failed(Struct, frozen=True, tag=True):
    """It ends with an error event to its client."""

    error: ErrorInfo


class Cancelled(Struct, frozen=True, tag=True):
    """Its client left: nothing more is said."""


class HandedOver(Struct, frozen=True, tag=True):
    """This worker stopped first: a peer continues it from the ledger."""


class Superseded(Struct, frozen=True, tag=True):
    """Another worker owns it now (this one stalled past the ack wait)."""


Outcome = Done | Failed | Cancelled | HandedOver | Superseded
DONE, CANCELLED, HANDED_OVER, SUPERSEDED = Done(), Cancelled(), HandedOver(), Superseded()


@dataclass(eq=False)
class Held:
    """A request a schedule worker owns, run on an engine (`Owned`) or fanned out over its
    prompts (`fanout.Parent`): its TW_SCHED message, held un-acked until it ends, and how it
    ended, one value for the one exit (`ScheduleService._finish`)."""

    rid: str
    reply: str
    request: GenerateRequest
    deadline: float
    msg: Any  # the TW_SCHED message held un-acked while we own the request
    tenant: str = ""  # whose API key it came with: its ledger messages say so
    # its reply and rid as one name (`ledger.request_key`): what the owner's table and the
    # engines' work know it by, since another reply's request may have the same rid
    key: str = ""
    leased: bool = False  # it holds one of its tenant's slots (`tokenway.tenancy`) until it ends
    batch: bool = False  # a batch job's (`Tw-Batch`): it starts after interactive requests
    trace: str = ""  # its W3C `traceparent`, for the engine (its span's, when recorded)
    out_seq: int = 0  # last per-request output sequence published to TW_OUT
    end: Outcome | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # set with `end`

    def end_as(self, end: Outcome) -> None:
        """The first end stands, save that another owner taking the request over ends it
        here whatever this worker thought."""
        if self.end is None or isinstance(end, Superseded):
            self.end = end
            self.ended.set()

    @property
    def error(self) -> ErrorInfo | None:
        return self.end.error if isinstance(self.end, Failed) else None

    @property
    def goes_on(self) -> bool:
        """It goes on under another owner, whose end it is to tell."""
        return isinstance(self.end, HandedOver | Superseded)

    def fail(self, info: ErrorInfo) -> None:
        self.end_as(Failed(info))

    def cancel(self) -> None:
        self.end_as(CANCELLED)

    def hand_over(self) -> None:
        """This worker stops before the request ends: a peer takes it (its message NAKed)."""
        self.end_as(HANDED_OVER)

    def supersede(self) -> None:
        """Another worker owns the request now (this one stalled past the ack wait)."""
        self.end_as(SUPERSEDED)


@dataclass(eq=False)
class Owned(Held):
    """A request run on an engine: its attempts, choices and what of them is committed."""

    engine: str | None = None
    attempt: int = 0  # the live attempt's number (`first_attempt`), counted up from there
    next_delta: int = 0  # the per-attempt seq expected next from the engine
    choices: list[Choice] = field(default_factory=list)
    # What the live attempt runs: the request's own, or a relay's (prompt + committed output)
    prompt: list[int] = field(default_factory=list)
    params: SamplingParams = field(default_factory=SamplingParams)
    relays: int = 0  # attempts started after an engine failed one
    broken: ErrorInfo | None = None  # why the live attempt failed at the engine
    trouble: asyncio.Event = field(default_factory=asyncio.Event)  # set with `broken`
    avoid: set[str] = field(default_factory=set)  # engines that failed this request
    # engines whose half-open breaker this request's attempt probes, until their verdict
    probes: set[str] = field(default_factory=set)
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # no derender in flight
    usage_busy: bool = False  # the closing usage chunk (n > 1) is being made
    # P/D handoff: the prefill leg runs as its own attempt; its tokens are never shown.
    held: int = 0  # engine tokens the live attempt holds in its owner's accounting
    prefill_engine: str | None = None
    prefill_attempt: int | None = None
    prefill_held: bool = False  # its capacity is still counted
    prefill_kv: dict[str, object] | None = None  # what the prefill handed to the decode leg
    prefill_done: asyncio.Event = field(default_factory=asyncio.Event)
    # The ledger: the stream sequence of the last record of this request's index, which
    # the next one expects (a fence against an owner that lost the request while it
    # stalled), and what it committed since in this owner's round records (`rounds`).
    index_seq: int = 0
    unindexed: list[Delivered] = field(default_factory=list)
    unindexed_tokens: int = 0
    unindexed_bytes: int = 0
    arrived: float = 0.0  # when it was queued for the schedulers (epoch seconds)
    dispatched: float = 0.0  # when its first attempt went to an engine
    aborted: bool = False  # vLLM's abort_requests asked it to end (`abort`)
    span: Span = OFF  # the owner's part of it (`tokenway.spans`)
    first_token: float | None = None  # when its engine's first output reached this owner
    last_token: float = 0.0  # when the latest did
    # prompt tokens the live attempt's engine found in its prefix cache (None: not said)
    cached_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.choices:
            self.choices = [Choice(i) for i in range(max(self.request.sampling_params.n, 1))]
        self.prompt = self.request.token_ids
        self.params = self.request.sampling_params
        self.settled.set()

    def unindex(self, events: list[Delivered]) -> None:
        """These events are stored in a round record, not yet in its index."""
        self.unindexed += events
        self.unindexed_tokens += sum(e.tokens for e in events)
        self.unindexed_bytes += sum(len(e.payload) for e in events)

    def indexed(self) -> None:
        """Its index holds every event it committed."""
        self.unindexed = []
        self.unindexed_tokens = self.unindexed_bytes = 0

    @property
    def client_kv(self) -> dict[str, object] | None:
        """KV the client handed over (external P/D): it fits the first attempt only."""
        return self.request.kv_transfer_params if self.relays == 0 else None

    @property
    def ctx(self) -> OutputContext:
        """The request's output context, with the prompt tokens found cached once known (at
        most the prompt's: a relay's prompt holds output too)."""
        ctx = self.request.context
        if self.cached_tokens is None:
            return ctx
        return msgspec.structs.replace(
            ctx, cached_tokens=min(self.cached_tokens, ctx.prompt_tokens)
        )

    @property
    def stream(self) -> bool:
        return self.ctx.stream

    @property
    def engine_done(self) -> bool:
        """The engine has nothing more to send for this attempt."""
        return all(c.engine_done or c.done for c in self.choices)

    def abort(self) -> None:
        """vLLM's abort_requests: the output ends where it is, each open choice finished
        "abort" with the tokens its engine made so far; the end is derendered without an
        engine (the caller stops the one running)."""
        self.aborted = True
        for c in self.choices:
            if not (c.engine_done or c.done):
                c.finish, c.stop_reason, c.engine_done = "abort", None, True

    def attempt_failed(self, info: ErrorInfo) -> None:
        """The engine failed the live attempt: the owner relays or gives up."""
        if not self.ended.is_set() and self.broken is None:
            self.broken = info
            self.trouble.set()

    def relay(self) -> bool:
        """Roll back to the committed output and set up the attempt that continues it.

        The replay prompt is the prompt plus the committed output IDs (never re-rendered
        text), the budgets shrink by what was committed, and derender resumes from each
        choice's committed state. False when nothing is left to generate (the budget is
        spent: the end is derendered without an engine). Raises `RelayRefused` for what
        a new attempt cannot continue faithfully once output was sent (`refuse_continuing`).
        """
        assert self.broken is not None
        if any(c.committed for c in self.choices) and not self.aborted:
            self.refuse_continuing(self.broken.message, "relayed")
        self.broken = None
        self.trouble.clear()
        self.relays += 1
        self.attempt += 1  # from here the failed attempt's late deltas are stale
        self.prefill_kv = None
        self.cached_tokens = None  # the relay's engine says its own
        for c in self.choices:
            c.roll_back()
        if self.aborted:  # nothing more is wanted: it ends with what is committed
            self.abort()
            return False
        done = len(self.choices[0].committed)
        original = self.request.sampling_params
        self.prompt = self.request.token_ids + self.choices[0].committed.tolist()
        remaining = None if original.max_tokens is None else original.max_tokens - done
        self.params = msgspec.structs.replace(
            original, max_tokens=remaining, min_tokens=max(original.min_tokens - done, 0)
        )
        if remaining is not None and remaining <= 0:
            self.choices[0].finish, self.choices[0].engine_done = "length", True
            return False
        return True

    def refuse_continuing(self, what_failed: str, how: str) -> None:
        """Raises `RelayRefused` where a new attempt cannot continue sent output faithfully:
        with n > 1 (choices that diverged would need one engine sequence each), or under a
        structured-outputs constraint (a new engine would start its grammar over in the
        middle of the document)."""
        if len(self.choices) > 1:
            why = f"a request with n={len(self.choices)} cannot be {how} after output was sent"
        elif self.request.sampling_params.structured_outputs is not None:
            why = (
                f"a request with structured outputs cannot be {how} after output was sent: "
                "the engine would start its grammar over mid-document"
            )
        else:
            return
        raise RelayRefused(f"{what_failed}; {why}")

    def refuse(self, delta: TokenDelta) -> None:
        """The engine refused the request itself: it ends with that error (the engine has
        nothing more to send for the attempt)."""
        assert delta.error is not None and delta.refused is not None
        for c in self.choices:
            c.engine_done = True
        self.fail(refused(delta.error, delta.refused))

    def accept_prefill(self, delta: TokenDelta) -> None:
        """The prefill leg's end brings the KV hand-over parameters; its tokens are dropped."""
        if delta.error is not None:
            self.prefill_done.set()  # prefill_kv stays None: the leg failed
            if refusal(delta):  # a prompt the engine refuses: the decode leg would too
                self.refuse(delta)
        elif delta.finish_reason is not None:
            self.prefill_kv = delta.kv_transfer_params or {}
            self.prefill_done.set()

    def accept(self, delta: TokenDelta) -> bool:
        """Apply an engine delta; True when there is something new to derender."""
        if self.ended.is_set() or delta.attempt != self.attempt or self.broken is not None:
            return False  # stale: an old or failed attempt, or after the end
        if not 0 <= delta.index < len(self.choices):
            self.fail(
                EngineFailed(
                    f"engine sent choice {delta.index} of a request with n={len(self.choices)}"
                ).info()
            )
            return False
        choice = self.choices[delta.index]
        if choice.engine_done or choice.done:
            return False
        if delta.seq != self.next_delta:
            self.attempt_failed(
                EngineFailed(
                    f"lost output from engine {self.engine}: "
                    f"expected chunk {self.next_delta}, got {delta.seq}"
                ).info()
            )
            return False
        self.next_delta += 1
        if delta.error is not None:
            if refusal(delta):  # the request's own fault: it ends with it, never relayed
                self.refuse(delta)
            else:
                self.attempt_failed(EngineFailed(delta.error).info())
            return False
        if delta.cached_tokens is not None:
            self.cached_tokens = delta.cached_tokens
        choice.pending.extend(delta.token_ids)
        choice.made += len(delta.token_ids)
        if delta.logprobs is not None:
            choice.pending_logprobs = (choice.pending_logprobs or []) + delta.logprobs
        if delta.finish_reason is not None:
            choice.engine_done = True
            choice.finish = delta.finish_reason
            choice.stop_reason = delta.stop_reason
        return True

    def take_ready(self, interval: int = 1) -> list[tuple[Choice, DerenderEntry]]:
        """Entries to derender now: streams chunk by chunk, non-stream all at the very end.
        A stream's chunk waits for `interval` tokens (or the request's own, if more), as
        vLLM's `--stream-interval`: its first chunk and its end go at once."""
        if self.ended.is_set() or self.broken is not None:
            return []
        # One derender + commit at a time per request: its publications are fenced one on
        # the next, so what arrives meanwhile waits for (and joins) the next one.
        if any(c.busy for c in self.choices) or self.usage_busy:
            return []
        prompt = self.request.token_ids
        if not self.stream:
            if not all(c.finish for c in self.choices):
                return []
            return [(c, c.take(self.ctx, prompt)) for c in self.choices if not c.done]
        least = max(interval, self.ctx.stream_interval)
        return [
            (c, c.take(self.ctx, prompt))
            for c in self.choices
            if not c.done
            and (c.finish is not None or len(c.pending) >= (least if c.state is not None else 1))
        ]

    def needs_usage_chunk(self) -> bool:
        """With n > 1 the usage chunk closes the stream once every choice is done."""
        return (
            self.stream
            and self.ctx.include_usage
            and len(self.choices) > 1
            and all(c.done for c in self.choices)
            and not self.usage_busy
            and not self.ended.is_set()
        )

    def usage_entry(self) -> DerenderEntry:
        self.usage_busy = True
        return DerenderEntry(context=self.ctx, usage_total=self.output_tokens)

    @property
    def output_tokens(self) -> int:
        """Committed output tokens of every choice."""
        return sum(len(c.committed) for c in self.choices)

    def summary(self, now: float) -> str:
        """The request's one line once it ends: where it ran, how much, how fast, how."""
        match self.end:
            case Failed(error):
                outcome = f"error {error.status}: {error.message}"
            case Cancelled():
                outcome = "cancelled"
            case _:
                outcome = ",".join(str(c.finish) for c in self.choices)
        ttft = "-" if self.first_token is None else f"{self.first_token - self.arrived:.3f}s"
        return (
            f"request {self.rid} ended: model {self.ctx.model}, engine {self.engine or '-'}, "
            f"{len(self.request.token_ids)} prompt + {self.output_tokens} output tokens, "
            f"ttft {ttft}, {now - self.arrived:.3f}s, {outcome}"
            + (f", {self.relays} relays" if self.relays else "")
        )

    def is_last(self, choice: Choice) -> bool:
        """Would committing this choice's end close the request's output?"""
        others_done = all(c.done for c in self.choices if c is not choice)
        return others_done and not (
            self.stream and self.ctx.include_usage and len(self.choices) > 1
        )
