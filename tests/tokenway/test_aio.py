"""tokenway.aio: what a helper starts has ended when it returns."""

import asyncio

from tokenway.aio import cancel_and_wait, wait_any


async def test_wait_any_leaves_no_task_behind() -> None:
    """Its own waits only: the session's loop runs other tests' connections meanwhile."""
    events = [asyncio.Event(), asyncio.Event()]
    await wait_any(*events, timeout=0)
    ours = [t for t in asyncio.all_tasks() if t.get_coro().cr_frame is not None
            and t.get_coro().cr_frame.f_locals.get("self") in events]  # fmt: skip
    assert ours == []


async def test_cancel_and_wait_returns_once_each_task_has_ended() -> None:
    started = asyncio.Event()

    async def cleans_up() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0)  # one more step after the cancel: awaited, it is done

    tasks = [asyncio.ensure_future(cleans_up()) for _ in range(2)]
    await started.wait()
    await cancel_and_wait(*tasks)
    assert all(t.cancelled() for t in tasks)


async def test_cancel_and_wait_of_nothing_returns() -> None:
    await cancel_and_wait()


async def test_cancel_and_wait_cancels_again_a_task_that_lost_its_cancel() -> None:
    """nats-py's connect can lose a cancel (asyncio.wait_for's race, Python 3.11) and go on
    retrying a dead server for ever: `tokenway up` hung at exit, 2 runs in 5, waiting for it."""
    waiting, lost = asyncio.Event(), asyncio.Event()

    async def loses_one() -> None:
        waiting.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            lost.set()  # swallowed, as the race does
        await asyncio.Event().wait()

    task = asyncio.create_task(loses_one())
    await waiting.wait()
    async with asyncio.timeout(30):
        await cancel_and_wait(task)
    assert lost.is_set() and task.cancelled()
