"""cancel_and_wait ends a task even when one cancellation is swallowed."""

from __future__ import annotations

import asyncio

from renqueue.tasks import cancel_and_wait


async def test_a_loop_that_swallows_one_cancellation_is_still_stopped() -> None:
    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed == 0:  # what nats-py's fetch can do on Python 3.11
                    swallowed += 1
                    asyncio.current_task().uncancel()  # type: ignore[union-attr]
                    continue
                raise

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait([task], every=0.05), 5)
    assert task.cancelled()
    assert swallowed == 1


async def test_a_task_that_failed_is_waited_for_without_raising() -> None:
    async def broken() -> None:
        raise RuntimeError("boom")

    task = asyncio.create_task(broken())
    await asyncio.sleep(0)
    await cancel_and_wait([task])
    assert isinstance(task.exception(), RuntimeError)
