"""Who turns an owner's token deltas into documents: the one seam both stages code against.

A derender backend (the local core, or a vLLM derender server) is one, whether it runs in
the owner's process or behind the derender workers' subject; so is the pool of those
workers seen from an owner. It lives on the ground floor so that the schedule and derender
stages share it without importing each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tokenway.wire import DerenderEntry, DerenderResult

# A call with more output tokens than this runs in a thread: its CPU would hold the event
# loop (heartbeats, in-progress acks, every other stream). The local backend, the derender
# workers and an owner's round all judge a call by it.
THREAD_ABOVE = 4096


def is_large(entries: Sequence[DerenderEntry]) -> bool:
    return sum(len(e.token_ids) for e in entries) > THREAD_ABOVE


class Derenderer(Protocol):
    awaits_io: bool  # calls wait on another server or the bus: a shell runs them concurrently

    async def derender(self, entries: Sequence[DerenderEntry]) -> list[DerenderResult]:
        """One result per entry; StageUnavailable/StageTimeout when nothing could answer."""
        ...

    async def aclose(self) -> None: ...
