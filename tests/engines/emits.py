"""A list-collecting `Emit` for engine tests: what an engine reported, call by call."""

from __future__ import annotations

import asyncio

from tokenway.wire import FinishReason, LogprobEntry


class Emits:
    """Each call as (token IDs, finish, stop reason, choice index); `first` is set on the
    first call."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], FinishReason | None, int | str | None, int]] = []
        self.logprobs: list[list[LogprobEntry] | None] = []
        self.kv: list[dict[str, object] | None] = []
        self.cached: list[int | None] = []
        self.first = asyncio.Event()

    def __call__(
        self,
        token_ids: list[int],
        finish: FinishReason | None,
        stop_reason: int | str | None,
        logprobs: list[LogprobEntry] | None = None,
        index: int = 0,
        kv_transfer_params: dict[str, object] | None = None,
        cached_tokens: int | None = None,
    ) -> None:
        self.calls.append((list(token_ids), finish, stop_reason, index))
        self.logprobs.append(logprobs)
        self.kv.append(kv_transfer_params)
        self.cached.append(cached_tokens)
        self.first.set()

    def tokens(self, index: int = 0) -> list[int]:
        return [t for ids, _, _, i in self.calls if i == index for t in ids]

    @property
    def finish(self) -> tuple[FinishReason | None, int | str | None]:
        """The last call's finish and stop reason."""
        _, finish, reason, _ = self.calls[-1]
        return finish, reason
