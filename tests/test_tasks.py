"""Task ownership: cancel_and_wait ends a task for sure; Supervisor restarts or escalates."""

from __future__ import annotations

import asyncio
import logging

import pytest

from renqueue.errors import (
    NatsClosedError,
    NatsTimeoutError,
    NatsUnavailableError,
    StoreFullError,
)
from renqueue.logs import EVENT_ATTRIBUTE
from renqueue.tasks import Fatal, Supervisor, cancel_and_wait


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


async def test_a_failing_loop_is_restarted_and_logged_not_lost() -> None:
    runs = 0
    third = asyncio.Event()

    async def flaky() -> None:
        nonlocal runs
        runs += 1
        if runs < 3:
            raise ConnectionError("broker hiccup")
        third.set()
        await asyncio.Event().wait()  # runs for good from now on

    supervisor = Supervisor("test", base_backoff=0.001, max_backoff=0.01)
    supervisor.spawn("flaky", flaky)
    await asyncio.wait_for(third.wait(), 5)
    assert runs == 3
    assert supervisor.healthy("flaky")
    assert not supervisor.failed.is_set()
    await supervisor.close()
    assert not supervisor.healthy()


async def test_a_transient_broker_fault_is_a_warning_without_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue #29: every broker restart made the fetching loops log a 503 or a
    timeout at error level with a traceback. A transient broker fault is a
    warning naming the error; anything else (a bug, a closed connection that
    will not come back) keeps its traceback. Both are restarted alike."""
    caplog.set_level(logging.WARNING, logger="renqueue")
    failures: list[Exception] = [
        NatsUnavailableError("nats: ServiceUnavailableError: code=None"),
        NatsTimeoutError("nats: timeout"),
        RuntimeError("a bug"),
        NatsClosedError("nats: connection closed"),
    ]
    running = asyncio.Event()

    async def through_a_restart() -> None:
        if failures:
            raise failures.pop(0)
        running.set()
        await asyncio.Event().wait()

    supervisor = Supervisor("test", base_backoff=0.001, max_backoff=0.01)
    supervisor.spawn("fetch", through_a_restart)
    await asyncio.wait_for(running.wait(), 5)
    await supervisor.close()
    records = [r for r in caplog.records if r.getMessage().startswith("background loop failed")]
    assert [(r.levelno, r.exc_info is not None) for r in records] == [
        (logging.WARNING, False),
        (logging.WARNING, False),
        (logging.ERROR, True),
        (logging.ERROR, True),
    ]
    fields = [getattr(r, EVENT_ATTRIBUTE) for r in records]
    assert "ServiceUnavailableError" in fields[0]["error"]
    assert "NatsTimeoutError" in fields[1]["error"]
    assert [f["failures"] for f in fields] == [1, 2, 3, 4]
    assert all(f["loop"] == "fetch" for f in fields)
    assert isinstance(records[2].exc_info[1], RuntimeError)
    assert isinstance(records[3].exc_info[1], NatsClosedError)


async def test_a_loop_that_keeps_failing_fails_the_supervisor() -> None:
    async def broken() -> None:
        raise RuntimeError("bug")

    supervisor = Supervisor("test", base_backoff=0.001, max_backoff=0.001, give_up_after=4)
    supervisor.spawn("broken", broken)
    await asyncio.wait_for(supervisor.failed.wait(), 5)
    assert supervisor.reason is not None
    assert "broken" in supervisor.reason
    assert "4 times" in supervisor.reason
    assert not supervisor.healthy()
    await supervisor.close()


async def test_fatal_fails_the_supervisor_at_once() -> None:
    runs = 0

    async def doomed() -> None:
        nonlocal runs
        runs += 1
        raise Fatal("consumer deleted")

    supervisor = Supervisor("test")
    supervisor.spawn("doomed", doomed)
    await asyncio.wait_for(supervisor.failed.wait(), 5)
    assert runs == 1
    assert supervisor.reason is not None
    assert "consumer deleted" in supervisor.reason
    await supervisor.close()


async def test_stopping_some_loops_leaves_the_others_running() -> None:
    async def forever() -> None:
        await asyncio.Event().wait()

    supervisor = Supervisor("test")
    supervisor.spawn("a", forever)
    supervisor.spawn("b", forever)
    await asyncio.sleep(0)
    await asyncio.wait_for(supervisor.cancel("a", "unknown"), 5)
    assert supervisor.healthy("b")
    assert supervisor.healthy()  # "a" is forgotten, not counted as down
    supervisor.spawn("a", forever)  # the name may be used again
    await supervisor.close()


async def test_a_job_is_retried_until_it_succeeds_then_forgotten() -> None:
    tries = 0
    retried = asyncio.Event()
    done = asyncio.Event()
    ended = asyncio.Event()

    async def flaky_once() -> None:
        nonlocal tries
        tries += 1
        if tries == 1:
            raise TimeoutError("transient")
        retried.set()
        await done.wait()
        ended.set()

    supervisor = Supervisor("test", base_backoff=0.001, max_backoff=0.01)
    assert supervisor.spawn_job("end-it", flaky_once)
    assert not supervisor.spawn_job("end-it", flaky_once)  # already under way
    await asyncio.wait_for(retried.wait(), 5)
    assert supervisor.jobs() == ["end-it"]
    done.set()
    await asyncio.wait_for(ended.wait(), 5)
    await asyncio.sleep(0)  # let the job's task finish its bookkeeping
    assert supervisor.jobs() == []
    assert tries == 2
    assert not supervisor.failed.is_set()
    await supervisor.close()


async def test_a_broker_that_does_not_answer_is_waited_for_however_often_a_loop_fails() -> None:
    """Transient broker faults do not count toward giving up: a NATS outage
    longer than ``give_up_after`` backoffs must not stop a process (how long
    it may go without NATS is ``nats.patience``). A bug still does."""
    runs = 0
    recovered = asyncio.Event()

    async def outage() -> None:
        nonlocal runs
        runs += 1
        if runs <= 12:
            raise NatsTimeoutError("the broker did not answer")
        recovered.set()

    supervisor = Supervisor("test", base_backoff=0.001, max_backoff=0.001, give_up_after=4)
    supervisor.spawn("fetch", outage)
    await asyncio.wait_for(recovered.wait(), 5)
    assert not supervisor.failed.is_set()
    assert runs == 13
    await supervisor.close()


async def test_a_loop_failing_for_the_brokers_sake_alone_gives_up_after_the_patience() -> None:
    """A loop that never gets an answer on a live connection (a deleted
    bucket, a lost permission) is not kept alive forever: past the process's
    patience it gives up, and says how long it tried."""

    async def never_answered() -> None:
        raise NatsTimeoutError("the broker did not answer")

    supervisor = Supervisor(
        "test", base_backoff=0.001, max_backoff=0.01, give_up_after=4, broker_patience=0.2
    )
    supervisor.spawn("renew", never_answered)
    await asyncio.wait_for(supervisor.failed.wait(), 5)
    assert supervisor.reason is not None
    assert "renew" in supervisor.reason
    assert "failed for 0 s" in supervisor.reason
    await supervisor.close()


async def test_a_loop_refused_by_a_full_store_waits_past_the_patience() -> None:
    """A full store (a stream at its byte limit) is not an outage: room comes
    back as work is done or a limit is raised, and a process that stopped for
    it would come back to the same store. Such a loop keeps trying, however
    long it lasts (before, it gave up after ``nats.patience``, 5 minutes, and
    took its process down)."""
    attempts = 0
    answered = asyncio.Event()

    async def full_then_room() -> None:
        nonlocal attempts
        attempts += 1
        if attempts < 60:
            raise StoreFullError("maximum bytes exceeded", err_code=10077)
        answered.set()

    supervisor = Supervisor(
        "test", base_backoff=0.001, max_backoff=0.01, give_up_after=4, broker_patience=0.05
    )
    supervisor.spawn("fold", full_then_room)
    await asyncio.wait_for(answered.wait(), 10)
    assert not supervisor.failed.is_set(), supervisor.reason
    await supervisor.close()
