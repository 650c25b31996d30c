"""Small asyncio pieces the shells share."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

_T = TypeVar("_T")

# Native code that recurses as deep as its input (llguidance compiling a grammar whose rules
# chain thousands deep) overflows a thread's default 8 MiB stack, and a segfault ends the
# whole process: such work runs on threads with room for it, _BIG_STACK_THREADS of them
# started at first use (more calls wait in the queue, off the event loop). A stack is address
# space: only the pages a call touches become memory.
BIG_STACK = 256 << 20
_BIG_STACK_THREADS = 4
_big_stack_jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
_big_stack_threads: list[threading.Thread] = []
_started = threading.Lock()  # and `threading.stack_size` is the process's: set, start, reset


def _big_stack_worker() -> None:
    while True:
        _big_stack_jobs.get()()


def _big_stack_started() -> None:
    with _started:
        while len(_big_stack_threads) < _BIG_STACK_THREADS:
            default = threading.stack_size(BIG_STACK)
            try:
                worker = threading.Thread(target=_big_stack_worker, name="big-stack", daemon=True)
                worker.start()
            finally:
                threading.stack_size(default)
            _big_stack_threads.append(worker)


async def on_big_stack(work: Callable[..., _T], *args: object) -> _T:
    """`work(*args)` on a thread with a `BIG_STACK`, awaited (the event loop runs on)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[_T] = loop.create_future()

    def settle(result: _T | None, exc: BaseException | None) -> None:
        if done.done():  # its awaiter was cancelled
            return
        if exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def job() -> None:
        result: _T | None = None
        error: BaseException | None = None
        try:
            result = work(*args)
        except BaseException as exc:  # handed to the awaiter, raised there
            error = exc
        with contextlib.suppress(RuntimeError):  # its loop closed: nobody awaits it
            loop.call_soon_threadsafe(settle, result, error)

    if len(_big_stack_threads) < _BIG_STACK_THREADS:
        _big_stack_started()
    _big_stack_jobs.put(job)
    return await done


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
        await cancel_and_wait(*waits)


# How long a cancelled task may go on before it is cancelled again.
_RECANCEL_AFTER = 0.1


async def cancel_and_wait(*tasks: asyncio.Future[Any]) -> None:
    """Cancel `tasks` and wait until each has ended, so none outlives its owner (their
    outcomes are the caller's to read). A task can lose a cancel (nats-py's connect does in
    asyncio.wait_for's race, and retries a dead server for ever): one still running a
    moment later is cancelled again."""
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=_RECANCEL_AFTER)


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
