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
from renqueue.advisories import AdvisoryReader, MaxDeliveries
from renqueue.coalescing import Coalescer, Group
from renqueue.eventlog import EventLog
from renqueue.messages import (
    REQUEST_DECODER,
    Cancelled,
    Coalesced,
    Completed,
    Event,
    Expired,
    Failed,
    InferenceRequest,
    Submitted,
    is_terminal,
)
from renqueue.mockbackend import MockBackend, MockSettings
from renqueue.subjects import REQUESTS_STREAM, STATE_BUCKET, request_subject


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


async def _terminal_within(client: Client, request_id: str, bound: float = 15.0) -> Event:
    """The request's terminal event, polled from the log for at most ``bound`` s."""
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        ended = await terminals(client, request_id)
        if ended:
            return ended[0]
        await asyncio.sleep(0.05)  # poll interval, not a synchronisation
    raise AssertionError(f"{request_id} has no terminal event after {bound} s")


async def test_a_leader_that_runs_out_of_deliveries_hands_out_to_its_followers(
    stack: Services,
) -> None:
    """The advisory reader ends a leader whose message ran out of deliveries:
    its followers get their outcome first (here: they run on their own)."""
    async with Client(stack.nc, tenant="t") as client:
        await occupy(client)
        leader = await client.submit("undeliverable", route="chat", coalesce=True)
        follower = await client.submit("undeliverable", route="chat", coalesce=True)
        await _wait_coalesced(client, follower.id)
        # The leader waits in a router's hold; its message is the one left on
        # the tenant's subject (the blocker's and the follower's were acked).
        stored = await stack.js.get_last_msg(REQUESTS_STREAM, request_subject("normal", "t"))
        assert REQUEST_DECODER.decode(stored.data).id == leader.id
        advisory = MaxDeliveries(
            stream=REQUESTS_STREAM, consumer="router-normal", stream_seq=stored.seq, deliveries=9
        )
        await AdvisoryReader(stack.js).handle(advisory, at=time.time())
        [ended] = await terminals(client, leader.id)
        assert isinstance(ended, Failed)
        assert ended.error_type == "undeliverable"
        assert (await follower.result(timeout=15)).text
        assert len(await terminals(client, follower.id)) == 1


async def test_a_worker_that_finds_a_leader_ended_hands_out_to_its_followers(
    stack: Services,
) -> None:
    """A dispatch of a leader that already ended (its terminal claim exists,
    its hand-out never ran) is dropped by the worker, which hands out first."""
    async with Client(stack.nc, tenant="t") as client:
        await occupy(client)
        leader = await client.submit("ended", route="chat", coalesce=True)
        follower = await client.submit("ended", route="chat", coalesce=True)
        await _wait_coalesced(client, follower.id)
        [submitted] = [e for e in await history(client, leader.id) if isinstance(e, Submitted)]
        # The leader ends by a path that skipped the hand-out.
        cancelled = Cancelled(request_id=leader.id, tenant="t", at=time.time(), stage="queued")
        assert await EventLog(stack.js).finish(cancelled)
        # The router still holds the leader: once the slot frees it dispatches it,
        # and the worker finds its claim.
        with pytest.raises(RequestCancelledError):
            await leader.result(timeout=10)
        assert submitted.request.id == leader.id
        ended = await _terminal_within(client, follower.id)
        assert isinstance(ended, Completed)
        assert len(await terminals(client, follower.id)) == 1


async def test_a_follower_whose_end_fails_once_still_ends_and_leaves_its_group(
    stack: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ending a follower on its deadline or its cancellation survives a
    transient failure (a publish timing out during a reconnect): it is retried."""
    real = EventLog.finish
    failed: list[str] = []

    async def flaky(self: EventLog, event: Event, **kwargs: int) -> bool:
        follower = isinstance(event, Expired | Cancelled) and event.request_id.startswith("foll")
        if follower and event.request_id not in failed:
            failed.append(event.request_id)
            raise TimeoutError("publish timed out (simulated: a reconnect)")
        return await real(self, event, **kwargs)

    monkeypatch.setattr(EventLog, "finish", flaky)
    async with Client(stack.nc, tenant="t") as client:
        await occupy(client)
        leader = await client.submit("flaky", route="chat", coalesce=True, request_id="lead-x")
        hasty = await client.submit(
            "flaky", route="chat", coalesce=True, timeout=0.5, request_id="foll-hasty"
        )
        quitter = await client.submit("flaky", route="chat", coalesce=True, request_id="foll-quit")
        await _wait_coalesced(client, quitter.id)
        await quitter.cancel()
        with pytest.raises(RequestExpiredError):
            await hasty.result(timeout=10)
        with pytest.raises(RequestCancelledError):
            await quitter.result(timeout=10)
        assert sorted(failed) == ["foll-hasty", "foll-quit"]
        # Both left the group: the hand-out gives nothing more to them.
        kv = await stack.js.key_value(STATE_BUCKET)
        [entry] = [await kv.get(key) for key in await kv.keys() if key.startswith("co.t.")]
        assert msgspec.json.decode(entry.value, type=Group).followers == []
        assert (await leader.result(timeout=15)).text
        for handle in (leader, hasty, quitter):
            assert len(await terminals(client, handle.id)) == 1


async def test_a_cancel_read_while_a_request_joins_its_group_is_not_missed(
    stack: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancellation the router reads after it checked for one, and before
    the request's `coalesced` event is stored, still ends the follower."""
    assert stack.cancels is not None
    watch = stack.cancels
    real = Coalescer.join

    async def join_then_cancel(self: Coalescer, request: InferenceRequest, key: str) -> str | None:
        leader = await real(self, request, key)
        if request.id == "gap-follower":
            # The cancel lands in the gap: joined, `coalesced` not yet logged.
            await client.handle(request.id).cancel()
            deadline = time.monotonic() + 10
            while not watch.is_cancelled("t", request.id):
                assert time.monotonic() < deadline, "the watch never read the cancel"
                await asyncio.sleep(0.01)  # poll interval, not a synchronisation
        return leader

    monkeypatch.setattr(Coalescer, "join", join_then_cancel)
    async with Client(stack.nc, tenant="t") as client:
        await occupy(client)
        leader = await client.submit("gap", route="chat", coalesce=True)
        follower = await client.submit(
            "gap", route="chat", coalesce=True, request_id="gap-follower"
        )
        with pytest.raises(RequestCancelledError):
            await follower.result(timeout=15)
        assert (await leader.result(timeout=15)).text
        assert len(await terminals(client, follower.id)) == 1


async def test_a_follower_is_not_lost_to_a_requeue_id_another_tenant_took(
    stack: Services,
) -> None:
    """A follower whose leader was cancelled is put back on its queue under a
    message id another tenant may have taken first (on its own subject): the
    group forgets it only once a copy of it is surely stored."""
    async with Client(stack.nc, tenant="t") as client, Client(stack.nc, tenant="evil") as evil:
        await evil.js.publish(
            "rq.req.normal.evil",
            b'{"id": "x", "tenant": "evil", "route": "chat", "messages": []}',
            headers={"Nats-Msg-Id": "t:lone:requeue:leader:lead"},
        )
        await occupy(client)
        leader = await client.submit("forged", route="chat", coalesce=True, request_id="lead")
        follower = await client.submit("forged", route="chat", coalesce=True, request_id="lone")
        await _wait_coalesced(client, follower.id)
        await leader.cancel()
        with pytest.raises(RequestCancelledError):
            await leader.result(timeout=10)
        assert (await follower.result(timeout=15)).text
        assert len(await terminals(client, follower.id)) == 1


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
