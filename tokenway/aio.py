"""Small asyncio pieces the shells share."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

_T = TypeVar("_T")


class Signal:
    """A broadcast 'something changed': every waiter wakes on the next `fire`, none clears it."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    def waiter(self) -> asyncio.Event:
        """Take before checking the condition, so a fire in between is not missed."""
        return self._event


class Stop(asyncio.Event):
    """A stage's stop that carries when its process's grace period ends (loop time): the
    stages of one process stop one after another, and share one grace to drain in."""

    def __init__(self) -> None:
        super().__init__()
        self.until: float | None = None


def grace(stop: asyncio.Event, default: float) -> float:
    """Seconds a stopping stage may drain for: what is left of its process's grace where
    `stop` carries one (`Stop`), else `default`, the stage's own."""
    if isinstance(stop, Stop) and stop.until is not None:
        return max(0.0, stop.until - asyncio.get_running_loop().time())
    return default


async def wait_any(*events: asyncio.Event, timeout: float | None = None) -> None:
    """Until one of `events` is set or `timeout` passes."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


async def uninterrupted(work: Awaitable[None]) -> None:
    """Await `work` to its end even when the caller is cancelled meanwhile (again): for
    bounded clean-up that must not be cut short, such as freeing an engine."""
    task = asyncio.ensure_future(work)
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():
                raise
    task.result()


class Lazy(Generic[_T]):
    """What `bind` makes, made on first use (and once): a bucket a deployment that never
    uses it never creates."""

    def __init__(self, bind: Callable[[], Awaitable[_T]]) -> None:
        self._bind = bind
        self._made: _T | None = None
        self._binding = asyncio.Lock()

    async def __call__(self) -> _T:
        async with self._binding:
            if self._made is None:
                self._made = await self._bind()
            return self._made
