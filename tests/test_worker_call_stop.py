"""Stopping a backend call that runs in its run's own task (:class:`CallStop`).

A cancellation or a preemption stops the call, never the run: the run gets
:class:`CallStopped` and goes on (to record why), its task's cancellation
count as it was. A shutdown's cancellation of the run goes through as it came.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from renqueue import parse_config
from renqueue.services.worker._call import CallStop, CallStopped
from renqueue.services.worker._yielding import Preemptible, Run


async def test_a_call_stopped_while_under_way_ends_in_call_stopped_and_the_run_goes_on() -> None:
    entered = asyncio.Event()
    stops: list[CallStop] = []

    async def run() -> str:
        this = asyncio.current_task()
        assert this is not None
        stop = CallStop(this)
        stops.append(stop)
        try:
            with stop:
                entered.set()
                await asyncio.Event().wait()  # a call that never ends by itself
        except CallStopped:
            assert this.cancelling() == 0
            await asyncio.sleep(0)  # the run goes on: it is not cancelled
            return "stopped"
        return "completed"

    task = asyncio.create_task(run())
    await entered.wait()
    [stop] = stops
    assert not stop.done()
    stop.cancel()
    stop.cancel()  # idempotent
    assert await task == "stopped"
    assert stop.done()


async def test_a_call_stopped_before_it_begins_is_never_made() -> None:
    made = False

    async def run() -> None:
        nonlocal made
        this = asyncio.current_task()
        assert this is not None
        stop = CallStop(this)
        stop.cancel()
        with stop:
            made = True

    with pytest.raises(CallStopped):
        await asyncio.create_task(run())
    assert not made


async def test_a_shutdown_during_a_stopped_call_still_cancels_the_run() -> None:
    entered = asyncio.Event()
    stops: list[CallStop] = []

    async def run() -> None:
        this = asyncio.current_task()
        assert this is not None
        stop = CallStop(this)
        stops.append(stop)
        with stop:
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(run())
    await entered.wait()
    stops[0].cancel()
    task.cancel()  # the shutdown, at the same time
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()


async def test_a_call_that_ends_its_own_way_though_stopped_keeps_its_outcome() -> None:
    entered = asyncio.Event()
    stops: list[CallStop] = []

    async def call() -> str:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return "answered anyway"  # a call that swallows its cancellation
        return "never"

    async def run() -> str:
        this = asyncio.current_task()
        assert this is not None
        stop = CallStop(this)
        stops.append(stop)
        with stop:
            entered.set()
            outcome = await call()
        assert this.cancelling() == 0  # the stop's cancellation taken back
        await asyncio.sleep(0)
        return outcome

    task = asyncio.create_task(run())
    await entered.wait()
    stops[0].cancel()
    assert await task == "answered anyway"


async def test_a_call_that_ended_is_not_stopped_after() -> None:
    async def run() -> CallStop:
        this = asyncio.current_task()
        assert this is not None
        stop = CallStop(this)
        with stop:
            await asyncio.sleep(0)
        return stop

    stop = await asyncio.create_task(run())
    stop.cancel()  # too late: a no-op
    assert stop.done()
    assert not stop.stopped


async def test_a_call_being_stopped_is_not_offered_to_a_preemption() -> None:
    """A call stopped (a cancellation by request) that is still closing its
    stream is no run to preempt: offered, its run would be recorded as
    preempted and put back to routing, not as the cancellation it is."""
    policies = parse_config({}).level_policies()
    batch = parse_config({}).priority_rank("batch")
    preemptible = Preemptible("b", policies)
    entered = asyncio.Event()
    closing = asyncio.Event()
    closed = asyncio.Event()
    stops: list[CallStop] = []

    async def run() -> None:
        this = asyncio.current_task()
        assert this is not None
        stop = CallStop(this)
        stops.append(stop)
        preemptible.runs["t:r"] = Run(rank=batch, started=0.0, call=stop)
        with contextlib.suppress(CallStopped), stop:
            entered.set()
            try:
                await asyncio.Event().wait()
            finally:
                closing.set()
                await closed.wait()  # the backend's stream closing

    task = asyncio.create_task(run())
    await entered.wait()
    assert preemptible.victim(0) == "t:r"
    stops[0].cancel()
    await closing.wait()
    assert preemptible.victim(0) is None
    closed.set()
    await task
    assert preemptible.victim(0) is None
