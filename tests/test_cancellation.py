"""Cancellation: a queued request never runs, a running one is stopped at the backend."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from renqueue import Client, RequestCancelledError, RequestExpiredError, Services, parse_config
from renqueue.eventlog import EventLog
from renqueue.messages import Cancelled, Expired, Started
from renqueue.mockbackend import MockBackend, MockSettings


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


async def test_cli_cancel(stack: Services) -> None:
    async with Client(stack.nc, tenant="t") as client:
        busy = await client.submit("slot", route="chat")
        waiting = await client.submit("waits", route="chat")
        await asyncio.sleep(0.2)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "renqueue", "--nats", stack.url, "cancel", waiting.id,
            "--tenant", "t", "--wait", "10",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "RENQUEUE_CONFIG": ""},
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        await busy.result(timeout=10)
    assert proc.returncode == 3, err  # the request ended cancelled
    assert b"cancellation requested" in out
    assert b"cancelled" in err


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
