"""One owned request's bookkeeping: which attempt is live, what is pending, what is committed.

Pure: the shell feeds it engine deltas and derender results and asks what to do next.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from tokenway.errors import EngineFailed
from tokenway.wire import (
    DerenderEntry,
    ErrorInfo,
    FinishReason,
    GenerateRequest,
    LogprobEntry,
    TokenDelta,
)


@dataclass(eq=False)
class Owned:
    rid: str
    reply: str
    request: GenerateRequest
    deadline: float
    msg: Any  # the TW_SCHED message held un-acked while we own the request
    engine: str | None = None
    attempt: int = 0
    next_delta: int = 0  # the per-attempt seq expected next from the engine
    out_seq: int = 0  # last per-request output sequence published to TW_OUT
    state: bytes | None = None  # last committed stream_state (opaque: derender's)
    pending: list[int] = field(default_factory=list)  # engine tokens not yet derendered
    pending_logprobs: list[LogprobEntry] | None = None  # theirs, when logprobs were asked
    finish: FinishReason | None = None
    stop_reason: int | str | None = None
    engine_done: bool = False  # the engine reported the end of this attempt
    busy: bool = False  # a derender + commit is in flight
    error: ErrorInfo | None = None
    cancelled: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def stream(self) -> bool:
        return self.request.context.stream

    def fail(self, info: ErrorInfo) -> None:
        if not self.ended.is_set():
            self.error = info
            self.ended.set()

    def cancel(self) -> None:
        self.cancelled = True
        self.ended.set()

    def accept(self, delta: TokenDelta) -> bool:
        """Apply an engine delta; True when there is something new to derender."""
        if self.ended.is_set() or delta.attempt != self.attempt or self.engine_done:
            return False  # stale: an old attempt, or after the end
        if delta.seq != self.next_delta:
            self.engine_done = delta.finish_reason is not None
            self.fail(
                EngineFailed(
                    f"lost output from engine {self.engine}: "
                    f"expected chunk {self.next_delta}, got {delta.seq}"
                ).info()
            )
            return False
        self.next_delta += 1
        if delta.error is not None:
            self.engine_done = True
            self.fail(EngineFailed(delta.error).info())
            return False
        self.pending.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.pending_logprobs = (self.pending_logprobs or []) + delta.logprobs
        if delta.finish_reason is not None:
            self.engine_done = True
            self.finish = delta.finish_reason
            self.stop_reason = delta.stop_reason
        return True

    def ready(self) -> bool:
        """Derender now? Streams go chunk by chunk; a non-stream request waits for the end."""
        if self.busy or self.ended.is_set():
            return False
        if self.stream:
            return bool(self.pending) or self.finish is not None
        return self.finish is not None

    def take(self) -> DerenderEntry:
        tokens, self.pending = self.pending, []
        lps, self.pending_logprobs = self.pending_logprobs, None
        self.busy = True
        ctx = self.request.context
        needs_prompt = self.state is None and (ctx.echo or ctx.return_token_ids)
        return DerenderEntry(
            context=ctx,
            state=self.state,
            token_ids=tokens,
            finish_reason=self.finish,
            stop_reason=self.stop_reason,
            prompt_token_ids=self.request.token_ids if needs_prompt else None,
            logprobs=lps,
        )

    def hold_back(self, entry: DerenderEntry) -> None:
        """Nothing became visible (a partial character): keep the tokens for the next chunk."""
        self.pending = entry.token_ids + self.pending
        if entry.logprobs is not None:
            self.pending_logprobs = entry.logprobs + (self.pending_logprobs or [])
