"""The dispatcher's wait for a decision's acks (``Dispatcher._kept_alive``).

It waits on the ack futures themselves (no gathering or shielding future
between): the results come back in order; the first failure is raised as soon
as it comes, whatever is still pending; and given up on (a timeout), the acks
still pending are cancelled (their pending slots freed), all but the one it
was told to spare (the dispatch's own, whose answer settles its slot),
while the request's message is kept in progress meanwhile.
"""

from __future__ import annotations

import asyncio
import gc

import pytest

from renqueue import parse_config
from renqueue.broker import EventLog, JetStream, Message, PubAck
from renqueue.errors import StoreFullError
from renqueue.services.router._dispatch import Dispatcher


async def _dispatcher_and_message(js: JetStream, name: str) -> tuple[Dispatcher, Message]:
    """A dispatcher whose acks may take 0.3 s (``router.ack_wait``), and a
    request message fetched from a real stream to keep in progress."""
    config = parse_config(
        {
            "nats": {"url": "nats://127.0.0.1:4222"},
            "router": {"ack_wait": "300ms"},
            "backends": {"b": {"base_url": "http://127.0.0.1:1", "model": "m"}},
            "routes": {"chat": {"backends": ["b"]}},
        }
    )

    async def end_request(*_: object) -> None:
        return None

    dispatcher = Dispatcher(
        js, EventLog(js), config, holder="test", clock=lambda: 0.0, end_request=end_request
    )
    await js.context.add_stream(name=name, subjects=[f"{name.lower()}.>"])
    await js.publish(f"{name.lower()}.x", b"request")
    psub = await js.pull_subscribe(f"{name.lower()}.>", durable="reader", stream=name)
    (msg,) = await psub.fetch(1, timeout=5.0)
    return dispatcher, msg


async def test_the_acks_come_back_in_order_and_a_missing_one_is_skipped(
    isolated_js: JetStream,
) -> None:
    dispatcher, msg = await _dispatcher_and_message(isolated_js, "ORDER")
    loop = asyncio.get_running_loop()
    first, second = loop.create_future(), loop.create_future()
    second.set_result(PubAck(stream="S", seq=2))
    loop.call_soon(first.set_result, PubAck(stream="S", seq=1))
    acks = await dispatcher._kept_alive(msg, first, None, second, spare=first)
    assert [ack.seq for ack in acks] == [1, 2]
    assert await dispatcher._kept_alive(msg, None) == []


async def test_a_failed_ack_is_raised_at_once_and_the_pending_ones_are_cancelled(
    isolated_js: JetStream,
) -> None:
    dispatcher, msg = await _dispatcher_and_message(isolated_js, "FAILS")
    loop = asyncio.get_running_loop()
    never, spared, failing = (loop.create_future() for _ in range(3))
    loop.call_soon(failing.set_exception, StoreFullError("the event log is full"))
    with pytest.raises(StoreFullError):
        await dispatcher._kept_alive(msg, never, spared, failing, spare=spared)
    assert never.cancelled()
    assert not spared.done()


async def test_acks_that_never_come_time_out_and_all_but_the_spared_are_cancelled(
    isolated_js: JetStream,
) -> None:
    dispatcher, msg = await _dispatcher_and_message(isolated_js, "NEVER")
    loop = asyncio.get_running_loop()
    never, spared = loop.create_future(), loop.create_future()
    with pytest.raises(TimeoutError):
        await dispatcher._kept_alive(msg, never, spared, spare=spared)
    assert never.cancelled()
    assert not spared.done()


async def test_a_cancelled_wait_cancels_the_pending_acks_but_the_spared_one(
    isolated_js: JetStream,
) -> None:
    dispatcher, msg = await _dispatcher_and_message(isolated_js, "STOPPED")
    loop = asyncio.get_running_loop()
    never, spared = loop.create_future(), loop.create_future()
    waiting = asyncio.create_task(dispatcher._kept_alive(msg, never, spared, spare=spared))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert never.cancelled()
    assert not spared.done()


def _unretrieved(loop: asyncio.AbstractEventLoop) -> list[dict[str, object]]:
    """Start collecting what ``loop`` reports of futures whose exception no one
    read (``Future exception was never retrieved``, reported as they are freed)."""
    reported: list[dict[str, object]] = []

    def handler(_: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
        if "never retrieved" in str(context.get("message", "")):
            reported.append(context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
    return reported


async def _failed_wait(dispatcher: Dispatcher, msg: Message, *acks: object, spare: object) -> str:
    """``_kept_alive`` over ``acks``: the name of the error it raised (the error
    itself is not kept: its traceback would keep the futures alive)."""
    try:
        await dispatcher._kept_alive(msg, *acks, spare=spare)  # type: ignore[arg-type]
    except StoreFullError as exc:
        return type(exc).__name__
    return "nothing"


async def test_no_failed_ack_is_left_never_retrieved(isolated_js: JetStream) -> None:
    # Two acks that fail together (the event log full: the request's
    # `submitted` and its `routed`), two that had failed before the wait, and
    # a spared one (the dispatch's) that fails after the wait gave up: each
    # failure is read, as gather and shield read them, and none is reported.
    dispatcher, msg = await _dispatcher_and_message(isolated_js, "UNREAD")
    loop = asyncio.get_running_loop()
    reported = _unretrieved(loop)
    try:
        spared, first, second = (loop.create_future() for _ in range(3))
        loop.call_soon(first.set_exception, StoreFullError("the event log is full"))
        loop.call_soon(second.set_exception, StoreFullError("the event log is full"))
        assert await _failed_wait(dispatcher, msg, spared, first, second, spare=spared) == (
            "StoreFullError"
        )
        spared.set_exception(StoreFullError("the dispatch queue is full"))
        await asyncio.sleep(0)  # (its done callbacks run)
        failed_before = [loop.create_future() for _ in range(2)]
        for ack in failed_before:
            ack.set_exception(StoreFullError("the event log is full"))
        assert await _failed_wait(dispatcher, msg, *failed_before, spare=None) == ("StoreFullError")
        del spared, first, second, failed_before, ack
        gc.collect()
    finally:
        loop.set_exception_handler(None)
    assert reported == []


async def test_an_ack_failed_before_the_wait_gives_the_others_up_as_one_failing_in_it(
    isolated_js: JetStream,
) -> None:
    # The request's `submitted` failed before its decision's wait began: the
    # `routed` still pending is given up on (cancelled) and the spared
    # dispatch's answer still read, as when the failure comes during the wait.
    dispatcher, msg = await _dispatcher_and_message(isolated_js, "EARLY")
    loop = asyncio.get_running_loop()
    reported = _unretrieved(loop)
    try:
        spared, failed_before, pending = (loop.create_future() for _ in range(3))
        failed_before.set_exception(StoreFullError("the event log is full"))
        assert await _failed_wait(
            dispatcher, msg, spared, failed_before, pending, spare=spared
        ) == ("StoreFullError")
        assert pending.cancelled()
        assert not spared.done()
        spared.set_exception(StoreFullError("the dispatch queue is full"))
        await asyncio.sleep(0)  # (its done callbacks run)
        del spared, failed_before, pending
        gc.collect()
    finally:
        loop.set_exception_handler(None)
    assert reported == []


async def test_a_spared_ack_answered_after_a_timeout_is_read(isolated_js: JetStream) -> None:
    # The request's `submitted` spared by the wait for it (a decision's first
    # step), answered with a failure only after that wait timed out.
    dispatcher, msg = await _dispatcher_and_message(isolated_js, "LATE")
    loop = asyncio.get_running_loop()
    reported = _unretrieved(loop)
    try:
        spared = loop.create_future()
        with pytest.raises(TimeoutError):
            await dispatcher._kept_alive(msg, spared, spare=spared)
        spared.set_exception(StoreFullError("the event log is full"))
        await asyncio.sleep(0)  # (its done callbacks run)
        del spared
        gc.collect()
    finally:
        loop.set_exception_handler(None)
    assert reported == []
