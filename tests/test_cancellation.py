"""Cancellation: a queued request never runs, a running one is stopped at the backend."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from _waits import until
from prometheus_client import REGISTRY

from renqueue import Client, RequestCancelledError, RequestExpiredError, Services, parse_config
from renqueue.broker import EventLog, provision
from renqueue.coordination import CancelWatch
from renqueue.errors import NatsNotFoundError
from renqueue.mock import MockBackend, MockSettings
from renqueue.schema import (
    EVENTS_STREAM,
    Cancelled,
    CancelRequested,
    Expired,
    Started,
    cancel_subject,
    encode,
    event_subject,
)


async def in_the_log(js: Any, tenant: str, request_id: str) -> None:
    """Wait until the log has sourced ``request_id``'s cancellation from
    ``RQ_CANCELS`` (where a client's ``cancel`` is acknowledged)."""

    async def there() -> bool:
        try:
            await js.get_last_msg(
                EVENTS_STREAM, event_subject(tenant, request_id, "cancel_requested"), direct=True
            )
        except NatsNotFoundError:
            return False
        return True

    await until(there, f"the log has {tenant}/{request_id}'s cancellation")


@pytest.fixture
async def slow() -> AsyncIterator[MockBackend]:
    async with MockBackend(MockSettings(tokens_per_second=20, output_tokens=40)) as mock:
        yield mock


@pytest.fixture
async def stack(tmp_path: Path, slow: MockBackend) -> AsyncIterator[Services]:
    config = parse_config(
        {
            "nats": {"data_dir": str(tmp_path / "nats"), "port": -1},
            "backends": {"one": {"base_url": slow.url, "model": "m", "limits": {"concurrency": 1}}},
            "routes": {"chat": {"backends": ["one"]}},
        }
    )
    async with Services(config) as services:
        yield services


def dropped(receiver: str) -> float:
    """This process's ``renqueue_misdirected_messages_total`` for ``receiver``."""
    value = REGISTRY.get_sample_value("renqueue_misdirected_messages_total", {"receiver": receiver})
    return value or 0.0


async def cancelled_event(client: Client, request_id: str) -> Cancelled:
    [event] = [
        e
        for e in await EventLog(client.js).history(client.tenant, request_id)
        if isinstance(e, Cancelled)
    ]
    return event


async def test_a_running_request_is_stopped_at_the_backend(
    stack: Services, slow: MockBackend
) -> None:
    async with Client(stack.nc, tenant="t") as client:
        handle = await client.submit("long answer", route="chat")
        stream = handle.stream(timeout=10)
        await anext(stream)  # it is generating
        await handle.cancel("changed my mind")
        with pytest.raises(RequestCancelledError):
            await handle.result(timeout=10)
        rest = [chunk async for chunk in stream]  # the stream ends too
        event = await cancelled_event(client, handle.id)
        for _ in range(50):  # the mock notices the closed connection
            if slow.stats().disconnects:
                break
            await asyncio.sleep(0.05)
    assert event.stage == "running"
    assert len(rest) < 39
    assert slow.stats().disconnects == 1
    assert slow.stats().completed == 0


async def test_a_queued_request_never_runs(stack: Services, slow: MockBackend) -> None:
    async with Client(stack.nc, tenant="t") as client:
        busy = await client.submit("takes the only slot", route="chat")
        waiting = await client.submit("waits", route="chat")
        await asyncio.sleep(0.2)  # held by the router: no free slot
        await waiting.cancel()
        with pytest.raises(RequestCancelledError):
            await waiting.result(timeout=10)
        await busy.result(timeout=10)
        event = await cancelled_event(client, waiting.id)
        history = await EventLog(client.js).history("t", waiting.id)
    assert event.stage == "queued"
    assert not any(isinstance(e, Started) for e in history)
    assert slow.stats().requests == 1


async def test_cancel_before_any_router_reads_it_and_after_it_ended(
    tmp_path: Path, slow: MockBackend
) -> None:
    config = parse_config(
        {
            "nats": {"data_dir": str(tmp_path / "nats"), "port": -1},
            "backends": {"one": {"base_url": slow.url, "model": "m"}},
            "routes": {"chat": {"backends": ["one"]}},
        }
    )
    # No routers yet: the request waits in its priority subject when cancelled.
    async with Services(config, routers=0, backends=[]) as bare:
        async with Client(bare.nc, tenant="t") as client:
            early = await client.submit("cancelled while nobody routes", route="chat")
            await early.cancel()
        nats = msgspec.structs.replace(config.nats, url=bare.url)
        later = Services(msgspec.structs.replace(config, nats=nats), provision_streams=False)
        async with later, Client(later.nc, tenant="t") as client:
            with pytest.raises(RequestCancelledError):
                await client.handle(early.id).result(timeout=10)
            history = await EventLog(client.js).history("t", early.id)
            # The router still records the submit before ending it.
            assert [type(e).__name__ for e in history].count("Submitted") == 1
            slow.update(tokens_per_second=0)
            done = await client.submit("quick", route="chat")
            result = await done.result(timeout=10)
            await done.cancel()  # too late: nothing changes
            assert (await done.result(timeout=5)).text == result.text
    assert slow.stats().requests == 1


async def until_submitted(client: Client, request_id: str, within: float = 15.0) -> None:
    """Until the router has read the request (its ``submitted`` event is logged)."""
    log = EventLog(client.js)
    give_up = time.monotonic() + within
    while not await log.history("t", request_id, kind="submitted"):
        assert time.monotonic() < give_up, f"{request_id} was never read"
        await asyncio.sleep(0.02)


async def test_cli_cancel(stack: Services, slow: MockBackend) -> None:
    # A minute per answer: "waits" is still waiting when the CLI's cancel lands,
    # however slowly a process starts on a loaded machine (2 s was not enough).
    slow.update(output_tokens=1200)
    async with Client(stack.nc, tenant="t") as client:
        busy = await client.submit("slot", route="chat")
        waiting = await client.submit("waits", route="chat")
        await until_submitted(client, waiting.id)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "renqueue", "--nats", stack.url, "cancel", waiting.id,
            "--tenant", "t", "--wait", "10",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "RENQUEUE_CONFIG": ""},
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        await busy.cancel()
        with pytest.raises(RequestCancelledError):
            await busy.result(timeout=10)
    assert proc.returncode == 0, err  # the request ended cancelled, as asked
    assert b"cancellation requested" in out
    assert b"cancelled" in out


async def test_a_running_request_past_its_deadline_is_stopped_and_expires(
    stack: Services, slow: MockBackend
) -> None:
    async with Client(stack.nc, tenant="t") as client:
        handle = await client.submit("too long for its deadline", route="chat", timeout=0.6)
        with pytest.raises(RequestExpiredError):
            await handle.result(timeout=10)
        history = await EventLog(client.js).history("t", handle.id)
        for _ in range(50):  # the mock notices the closed connection
            if slow.stats().disconnects:
                break
            await asyncio.sleep(0.05)
    [expired] = [e for e in history if isinstance(e, Expired)]
    assert expired.stage == "running"
    assert any(isinstance(e, Started) for e in history)
    assert slow.stats().disconnects == 1
    assert slow.stats().completed == 0


async def test_one_tenant_cannot_cancel_another_tenants_request(
    stack: Services, slow: MockBackend
) -> None:
    """Issue #6 item 15: the match is on (subject tenant, id), never on id alone."""
    slow.update(tokens_per_second=200)
    async with Client(stack.nc, tenant="victim") as victim, Client(stack.nc, tenant="evil") as evil:
        handle = await victim.submit("mine", route="chat", request_id="same-id")
        stream = handle.stream(timeout=10)
        await anext(stream)  # running
        # Its own request id, on its own subject...
        await evil.handle("same-id").cancel()
        # ...and a forged payload naming the victim, on its own subject.
        forged = CancelRequested(request_id="same-id", tenant="victim", at=time.time())
        await evil.js.publish(
            event_subject("evil", "same-id", "cancel_requested"),
            encode(forged),
            headers={"Nats-Msg-Id": "victim:same-id:cancel_requested"},
        )
        result = await handle.result(timeout=10)
        await stream.aclose()
    assert result.text
    assert slow.stats().completed == 1


async def test_the_watch_starts_at_once_when_every_cancellation_is_past_its_horizon(
    nc: Any,
) -> None:
    """Issue #6 item 7: the newest cancellation older than the horizon used to
    stall every start for 10 s (its catch-up message never came). Past the
    horizon a cancellation is still honoured: looked up in the log."""
    js = nc.jetstream()
    await provision(nc, parse_config({"routes": {}, "backends": {}}))
    old = CancelRequested(request_id="old-one", tenant="t", at=time.time())
    await EventLog(js).append(old)
    await in_the_log(js, "t", "old-one")
    # The watch's clock is a day ahead: the cancellation is past its horizon.
    watch = CancelWatch(js, horizon=60.0, clock=lambda: time.time() + 86_400)
    try:
        await asyncio.wait_for(watch.start(), 5)
        assert watch.caught_up
        assert not watch.is_cancelled("t", "old-one")
        assert await watch.was_cancelled("t", "old-one", since=time.time())
        assert not await watch.was_cancelled("other", "old-one", since=time.time())
    finally:
        await watch.close()


async def test_a_cancel_that_lands_while_a_run_starts_is_not_missed(
    stack: Services, slow: MockBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue #6 item 8: a cancel read after the worker's "cancelled?" check and
    before its backend call was registered ran the request to the end. The
    cancel is published (and seen by the watch) exactly in that window."""
    [worker] = stack.workers
    watch = stack.cancels
    assert watch is not None
    start = worker._start_run  # the window under test is inside the run
    seen = asyncio.Event()
    watch.listen(lambda _event: seen.set())

    async def start_then_cancel(delivery: Any) -> Any:
        acks = await start(delivery)
        request = delivery.dispatch.request
        await EventLog(stack.js).append(
            CancelRequested(request_id=request.id, tenant=request.tenant, at=time.time())
        )
        await asyncio.wait_for(seen.wait(), 10)  # the watch has read it
        return acks

    monkeypatch.setattr(worker, "_start_run", start_then_cancel)
    async with Client(stack.nc, tenant="t") as client:
        handle = await client.submit("cancel me as I start", route="chat")
        with pytest.raises(RequestCancelledError):
            await handle.result(timeout=10)
    assert slow.stats().completed == 0


async def test_a_starting_watch_knows_a_cancellation_the_log_has_not_sourced_yet(
    isolated_nc: Any,
) -> None:
    """Clients' cancellations are acknowledged by RQ_CANCELS and sourced into
    the log a moment later (134 ms for the first after the stream is made,
    measured): a router starting in between read none in the log and ran a
    request cancelled while it waited. A starting watch reads RQ_CANCELS's
    last minute too. Here the log does not source at all."""
    js = isolated_nc.jetstream()
    await provision(isolated_nc, parse_config({"routes": {}, "backends": {}}))
    reply = await isolated_nc.request(f"$JS.API.STREAM.INFO.{EVENTS_STREAM}", b"", timeout=2)
    unsourced = json.loads(reply.data)["config"]
    unsourced.pop("sources")
    reply = await isolated_nc.request(
        f"$JS.API.STREAM.UPDATE.{EVENTS_STREAM}", json.dumps(unsourced).encode(), timeout=2
    )
    assert "error" not in json.loads(reply.data), reply.data
    await EventLog(js).append(CancelRequested(request_id="waiting", tenant="t", at=time.time()))
    forged = CancelRequested(request_id="someone-else", tenant="t", at=time.time())
    await js.publish(cancel_subject("t", "not-that-one"), encode(forged))
    watch = CancelWatch(js)
    try:
        await asyncio.wait_for(watch.start(), 10)
        assert watch.is_cancelled("t", "waiting")
        assert not watch.is_cancelled("t", "not-that-one")
        assert not watch.is_cancelled("t", "someone-else")
    finally:
        await watch.close()


async def test_a_starting_watch_knows_a_cancellation_waiting_for_a_full_log_past_a_minute(
    isolated_nc: Any,
) -> None:
    """A cancellation acknowledged while the log is full waits in RQ_CANCELS
    until the log has room (the server copies it then, in order). A watch
    starting two minutes later read only RQ_CANCELS's last minute, so it did
    not know it, and the waiting request could run. It now reads RQ_CANCELS
    from where the log's source stopped."""
    js = isolated_nc.jetstream()
    await provision(isolated_nc, parse_config({"routes": {}, "backends": {}}))
    before = CancelRequested(request_id="sourced", tenant="t", at=time.time())
    await EventLog(js).append(before)
    await in_the_log(js, "t", "sourced")
    reply = await isolated_nc.request(f"$JS.API.STREAM.INFO.{EVENTS_STREAM}", b"", timeout=2)
    info = json.loads(reply.data)
    full = {**info["config"], "max_bytes": info["state"]["bytes"] + 1}
    reply = await isolated_nc.request(
        f"$JS.API.STREAM.UPDATE.{EVENTS_STREAM}", json.dumps(full).encode(), timeout=2
    )
    assert "error" not in json.loads(reply.data), reply.data
    await EventLog(js).append(CancelRequested(request_id="waiting", tenant="t", at=time.time()))
    # The watch starts two minutes on (its clock), the log still full.
    watch = CancelWatch(js, clock=lambda: time.time() + 120)
    try:
        await asyncio.wait_for(watch.start(), 20)
        assert watch.is_cancelled("t", "waiting")
        assert watch.is_cancelled("t", "sourced")
    finally:
        await watch.close()


async def test_a_flood_of_cancellations_stays_bounded_and_forgotten_ones_are_still_honoured(
    isolated_nc: Any,
) -> None:
    """A tenant publishing cancellations with made-up ids by the thousand must
    not grow a watch without bound, nor make each read walk all it holds: the
    oldest are forgotten one by one, and a request whose cancellation was
    forgotten still finds it, in the log."""
    js = isolated_nc.jetstream()
    await provision(isolated_nc, parse_config({"routes": {}, "backends": {}}))
    before = time.time() - 1.0  # a request stored before its cancellation
    log = EventLog(js)
    await log.append(CancelRequested(request_id="victim", tenant="t", at=time.time()))
    flood = 300
    acks = [
        await log.append_async(CancelRequested(request_id=f"made-up-{i}", tenant="evil", at=0.0))
        for i in range(flood)
    ]
    await asyncio.gather(*acks)
    await in_the_log(js, "evil", f"made-up-{flood - 1}")
    watch = CancelWatch(js, keep=50)
    try:
        await asyncio.wait_for(watch.start(), 10)
        assert watch.caught_up
        assert watch.is_cancelled("evil", f"made-up-{flood - 1}")
        assert len(watch) == 50
        # Each read forgot only what it had to: one cancellation past the cap.
        assert watch.forgotten == flood + 1 - 50
        assert not watch.is_cancelled("t", "victim")
        assert await watch.was_cancelled("t", "victim", since=before)
        assert not await watch.was_cancelled("t", "someone-else", since=before)
        assert len(watch) == 50
    finally:
        await watch.close()


async def test_a_cancellation_that_disagrees_with_its_subject_is_dropped_and_counted(
    isolated_nc: Any,
) -> None:
    """A tenant may publish anything on its own cancel_requested subjects: what is
    no cancellation of what its subject names is counted, not only logged
    (``renqueue_misdirected_messages_total{receiver="cancels"}``; bench/fuzz.py
    accounts every hostile message by it)."""
    js = isolated_nc.jetstream()
    await provision(isolated_nc, parse_config({"routes": {}, "backends": {}}))
    before = dropped("cancels")
    bad = [
        b"not json",
        b"[1, 2",
        encode(CancelRequested(request_id="other", tenant="t", at=time.time())),
        encode(CancelRequested(request_id="x", tenant="someone-else", at=time.time())),
        encode(
            Started(
                request_id="x",
                tenant="t",
                at=time.time(),
                backend="b",
                attempt=1,
                delivery=1,
                worker="w",
            )
        ),
    ]
    for payload in bad:
        await js.publish(event_subject("t", "x", "cancel_requested"), payload)
    await js.publish(
        event_subject("t", "x", "cancel_requested"),
        encode(CancelRequested(request_id="x", tenant="t", at=time.time())),
    )
    watch = CancelWatch(js)
    try:
        await asyncio.wait_for(watch.start(), 10)
        assert watch.caught_up
        assert watch.is_cancelled("t", "x")
        assert dropped("cancels") - before == len(bad)
    finally:
        await watch.close()


async def test_another_tenant_cannot_drop_a_cancellation_by_taking_its_message_id(
    stack: Services, slow: MockBackend
) -> None:
    """Deduplication is stream-wide: a cancellation published under
    ``<tenant>:<id>:cancel_requested`` could be dropped by another tenant
    publishing that id first, on its own subject. Cancellations carry none."""
    async with Client(stack.nc, tenant="victim") as victim, Client(stack.nc, tenant="evil") as evil:
        await evil.js.publish(
            event_subject("evil", "anything", "cancel_requested"),
            encode(CancelRequested(request_id="anything", tenant="evil", at=time.time())),
            headers={"Nats-Msg-Id": "victim:waits:cancel_requested"},
        )
        busy = await victim.submit("takes the only slot", route="chat")
        stream = busy.stream(timeout=10)
        await anext(stream)  # running: the next request waits
        await stream.aclose()
        waiting = await victim.submit("waits", route="chat", request_id="waits")
        await waiting.cancel()
        with pytest.raises(RequestCancelledError):
            await waiting.result(timeout=10)
    assert slow.stats().requests == 1
