"""Coalescing (issue #6 item 2, 8): every follower ends, in every leader outcome, once.

One backend with one slot, taken by a "blocker" while the coalescing group
waits, so a leader can expire or be cancelled while it is held.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from renqueue import (
    Client,
    RequestCancelledError,
    RequestExpiredError,
    Services,
    parse_config,
)
from renqueue.coalescing import Coalescer, Group
from renqueue.eventlog import EventLog
from renqueue.messages import Coalesced, Completed, Event, is_terminal
from renqueue.mockbackend import MockBackend, MockSettings
from renqueue.subjects import STATE_BUCKET


@pytest.fixture
async def slow() -> AsyncIterator[MockBackend]:
    async with MockBackend(MockSettings(ttft=0.0, tokens_per_second=40, output_tokens=40)) as m:
        yield m


@pytest.fixture
async def stack(tmp_path: Path, slow: MockBackend) -> AsyncIterator[Services]:
    config = parse_config(
        {
            "nats": {"data_dir": str(tmp_path / "nats"), "port": -1},
            "backends": {"one": {"base_url": slow.url, "model": "m", "limits": {"concurrency": 1}}},
            "routes": {"chat": {"backends": ["one"]}},
            "router": {"capacity_refresh": "50ms"},
        }
    )
    async with Services(config) as services:
        yield services


async def history(client: Client, request_id: str) -> list[Event]:
    return await EventLog(client.js).history(client.tenant, request_id)


async def terminals(client: Client, request_id: str) -> list[Event]:
    return [e for e in await history(client, request_id) if is_terminal(e)]


async def occupy(client: Client) -> object:
    """Take the backend's only slot; return once the blocker is generating."""
    blocker = await client.submit("blocker", route="chat")
    stream = blocker.stream(timeout=10)
    await anext(stream)
    await stream.aclose()
    return blocker


async def test_a_leader_that_expires_while_held_leaves_no_follower_stranded(
    stack: Services, slow: MockBackend
) -> None:
    async with Client(stack.nc, tenant="t") as client:
        await occupy(client)
        leader = await client.submit("same", route="chat", coalesce=True, timeout=0.3)
        follower = await client.submit("same", route="chat", coalesce=True)
        with pytest.raises(RequestExpiredError):
            await leader.result(timeout=10)
        # The follower runs on its own once its leader is gone...
        assert (await follower.result(timeout=15)).text
        # ...and an identical request arriving later never joins a dead leader.
        later = await client.submit("same", route="chat", coalesce=True)
        assert (await later.result(timeout=15)).text
        for handle in (leader, follower, later):
            assert len(await terminals(client, handle.id)) == 1
        joined = [e for e in await history(client, follower.id) if isinstance(e, Coalesced)]
        assert [e.leader for e in joined] == [leader.id]


async def test_a_cancelled_leader_hands_the_call_to_its_followers(
    stack: Services, slow: MockBackend
) -> None:
    async with Client(stack.nc, tenant="t") as client:
        await occupy(client)
        leader = await client.submit("again", route="chat", coalesce=True)
        followers = [await client.submit("again", route="chat", coalesce=True) for _ in range(2)]
        for handle in followers:
            await _wait_coalesced(client, handle.id)
        await leader.cancel()
        with pytest.raises(RequestCancelledError):
            await leader.result(timeout=10)
        results = [await handle.result(timeout=15) for handle in followers]
        assert results[0].text == results[1].text
        for handle in (leader, *followers):
            assert len(await terminals(client, handle.id)) == 1
    # The blocker and one shared call for both followers.
    assert slow.stats().completed == 2


async def test_a_follower_ends_on_its_own_cancel_and_deadline(
    stack: Services, slow: MockBackend
) -> None:
    async with Client(stack.nc, tenant="t") as client:
        await occupy(client)
        leader = await client.submit("q", route="chat", coalesce=True)
        quitter = await client.submit("q", route="chat", coalesce=True)
        hasty = await client.submit("q", route="chat", coalesce=True, timeout=0.5)
        patient = await client.submit("q", route="chat", coalesce=True)
        for handle in (quitter, hasty, patient):
            await _wait_coalesced(client, handle.id)
        await quitter.cancel()
        with pytest.raises(RequestCancelledError):
            await quitter.result(timeout=10)
        with pytest.raises(RequestExpiredError):
            await hasty.result(timeout=10)
        # The shared call goes on for the others.
        text = (await leader.result(timeout=15)).text
        shared = await patient.result(timeout=15)
        assert shared.text == text
        for handle in (leader, quitter, hasty, patient):
            assert len(await terminals(client, handle.id)) == 1
        [copy] = [e for e in await terminals(client, patient.id) if isinstance(e, Completed)]
        assert copy.shared_with == leader.id


async def test_a_group_whose_leader_ended_without_a_hand_out_is_settled_on_join(
    stack: Services,
) -> None:
    """A crash between a leader's end and its hand-out (or a leader re-read
    after it ended) leaves an open group led by a dead request: the next
    identical request settles it and leads a new one."""
    async with Client(stack.nc, tenant="t") as client:
        done = await client.submit("dead", route="chat", dedupe_key="k1")
        await done.result(timeout=10)
        # Re-create the group as a crash would leave it: open, led by a request
        # that already has its terminal event.
        kv = await stack.js.key_value(STATE_BUCKET)
        await kv.put("co.t.k1", msgspec.json.encode(Group(leader=done.id)))
        fresh = await client.submit("dead", route="chat", dedupe_key="k1")
        assert (await fresh.result(timeout=10)).text
        assert not [e for e in await history(client, fresh.id) if isinstance(e, Coalesced)]


async def _wait_coalesced(client: Client, request_id: str) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if any(isinstance(e, Coalesced) for e in await history(client, request_id)):
            return
        await asyncio.sleep(0.02)  # poll interval, not a synchronisation
    raise AssertionError(f"{request_id} never coalesced")


class _ReplacedAfterRead:
    """The real ``rq-state`` bucket, where another router replaces the group
    right after this reader read it (a request joining the closed group leads
    a new one): the interleaving a chaos run hit between ``_forget``'s read
    and its delete."""

    def __init__(self, kv: object, replacement: Group) -> None:
        self._kv = kv
        self._replacement = replacement

    async def get(self, name: str) -> object:
        entry = await self._kv.get(name)  # type: ignore[attr-defined]
        await self._kv.put(name, msgspec.json.encode(self._replacement))  # type: ignore[attr-defined]
        return entry

    def __getattr__(self, attr: str) -> object:
        return getattr(self._kv, attr)


async def test_a_group_replaced_while_its_leader_hands_out_does_not_fail_the_leader(
    stack: Services,
) -> None:
    """Seen in the chaos cluster run: a leader's hand-out read its closed group,
    a new identical request replaced it, and the delete with the old revision
    raised (nats-py: BadRequestError 10071, not KeyWrongLastSequenceError), so
    the worker failed the leader's finished run and ran it again (an extra
    backend call per occurrence). The group is not the leader's to drop any
    more: the hand-out ends quietly and the new group stays."""
    coalescer = Coalescer(stack.js, clock=time.time)
    kv = await stack.js.key_value(STATE_BUCKET)
    name = "co.t.some-key"
    await kv.put(name, msgspec.json.encode(Group(leader="old", closed=True)))
    coalescer._kv = _ReplacedAfterRead(kv, Group(leader="new"))
    await coalescer._forget("t", "some-key", "old")
    assert msgspec.json.decode((await kv.get(name)).value, type=Group).leader == "new"
