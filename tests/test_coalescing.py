"""Coalescing (issue #6 item 2, 8): every follower ends, in every leader outcome, once.

One backend with one slot, taken by a "blocker" while the coalescing group
waits, so a leader can expire or be cancelled while it is held.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import msgspec
import pytest

from renqueue import (
    Client,
    RequestCancelledError,
    RequestExpiredError,
    RequestFailedError,
    RequestHandle,
    Services,
    parse_config,
)
from renqueue.broker import Connection, EventLog, provision
from renqueue.broker._dlq import DeadLetterFilter, DeadLetters
from renqueue.config import Config
from renqueue.coordination import Coalescer, Group, coalesce_key
from renqueue.errors import NatsNotFoundError
from renqueue.mock import MockBackend, MockSettings
from renqueue.schema import (
    REQUEST_DECODER,
    REQUESTS_STREAM,
    STATE_BUCKET,
    Cancelled,
    Coalesced,
    Completed,
    Event,
    Expired,
    Failed,
    InferenceRequest,
    Preempted,
    Submitted,
    is_terminal,
    request_subject,
)
from renqueue.services import AdvisoryReader, MaxDeliveries


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


async def occupy(client: Client) -> RequestHandle:
    """Take the backend's only slot; return once the blocker is generating."""
    blocker = await client.submit("blocker", route="chat")
    stream = blocker.stream(timeout=30)
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


def unrun_config(tmp_path: Path, url: str, **router: str) -> Config:
    """One backend with one slot; the tests start its worker when they choose."""
    return parse_config(
        {
            "nats": {"data_dir": str(tmp_path / "nats"), "port": -1},
            "backends": {"one": {"base_url": url, "model": "m", "limits": {"concurrency": 1}}},
            "routes": {"chat": {"backends": ["one"]}},
            "worker": {"retry_delay": "50ms", "drain_timeout": "1s"},
            "router": {"capacity_refresh": "20ms", **router},
        }
    )


def workers_of(config: Config, services: Services) -> Services:
    """A worker process for ``config``'s backend, joining ``services``' server."""
    joined = msgspec.structs.replace(
        config, nats=msgspec.structs.replace(config.nats, url=services.url)
    )
    return Services(joined, routers=0, backends=["one"], projector=False, name="workers")


async def group_of(js: object, request: InferenceRequest) -> Group | None:
    """The coalescing group ``request`` would join, as stored (``None``: none)."""
    kv = await js.key_value(STATE_BUCKET)  # type: ignore[attr-defined]
    try:
        entry = await kv.get(f"co.{request.tenant}.{coalesce_key(request)}")
    except NatsNotFoundError:
        return None
    return msgspec.json.decode(entry.value, type=Group)


async def _until(check: Callable[[], Awaitable[bool]], what: str, bound: float = 20.0) -> None:
    deadline = time.monotonic() + bound
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {bound} s waiting until {what}")
        await asyncio.sleep(0.05)  # poll interval, not a synchronisation


async def test_a_group_expires_while_its_leader_waits_and_its_followers_still_end(
    tmp_path: Path,
) -> None:
    """Issue #6 item 2, "groups expire": a group no one touches for
    ``router.coalesce_ttl`` is gone from the bucket, even while its leader
    still waits. A later identical request then leads a group of its own (a
    second call), and the followers of the expired group are found in the
    log (their `coalesced` events) when the leader ends: each gets the
    leader's outcome, once. The markers left by finished hand-outs expire too."""
    async with MockBackend(MockSettings(ttft=0.0, output_tokens=4)) as mock:
        config = unrun_config(tmp_path, mock.url, coalesce_ttl="2s")
        # No worker yet: the blocker's dispatch takes the slot and waits unrun.
        async with (
            Services(config, backends=[]) as services,
            Client(services.nc, tenant="t") as client,
        ):
            same = client.build_request("same", route="chat", coalesce=True)
            blocker = await client.submit("blocker", route="chat")
            leader = await client.submit("same", route="chat", coalesce=True)
            follower = await client.submit("same", route="chat", coalesce=True)
            await _wait_coalesced(client, follower.id)
            group = await group_of(services.js, same)
            assert group is not None
            assert (group.leader, group.followers) == (leader.id, [follower.id])

            async def expired() -> bool:
                return await group_of(services.js, same) is None

            await _until(expired, "the group expired while its leader waits")
            later = await client.submit("same", route="chat", coalesce=True)

            async def regrouped() -> bool:
                group = await group_of(services.js, same)
                return group is not None and group.leader == later.id

            await _until(regrouped, "the later request leads a group of its own")
            async with workers_of(config, services):
                for handle in (blocker, leader, follower, later):
                    await handle.result(timeout=20)
            for handle in (leader, follower, later):
                assert len(await terminals(client, handle.id)) == 1
            [copy] = await terminals(client, follower.id)
            assert isinstance(copy, Completed)
            assert copy.shared_with == leader.id
            assert not [e for e in await history(client, later.id) if isinstance(e, Coalesced)]
            await _until(expired, "the finished groups' markers expired")
    # The blocker, the leader's call (shared with the follower), the later one's.
    assert mock.stats().requests == 3


async def test_a_follower_that_joins_a_second_leader_has_both_joins_in_the_log(
    tmp_path: Path,
) -> None:
    """A follower whose leader ends on its own (cancelled) is put back and
    joins a new leader within the duplicate window: its second `coalesced`
    event is stored too, naming the new leader (before: it had the first
    one's message id, `<tenant>:<id>:coalesced`, and was dropped as a
    duplicate, so the log said it followed the cancelled leader while its
    completion named the other)."""
    async with MockBackend(MockSettings(ttft=0.0, output_tokens=4)) as mock:
        config = unrun_config(tmp_path, mock.url)
        # No worker yet: the blocker's dispatch takes the slot and waits unrun.
        async with (
            Services(config, backends=[]) as services,
            Client(services.nc, tenant="t") as client,
        ):
            same = client.build_request("twice", route="chat", coalesce=True)
            blocker = await client.submit("blocker", route="chat")
            first = await client.submit("twice", route="chat", coalesce=True)
            followers = [await client.submit("twice", route="chat", coalesce=True) for _ in "ab"]
            for handle in followers:
                await _wait_coalesced(client, handle.id)
            await first.cancel()
            with pytest.raises(RequestCancelledError):
                await first.result(timeout=10)
            ids = {handle.id for handle in followers}

            async def regrouped() -> bool:
                # Put back, one of the two leads a group and the other joins it.
                group = await group_of(services.js, same)
                return (
                    group is not None
                    and group.leader in ids
                    and group.followers == sorted(ids - {group.leader})
                )

            await _until(regrouped, "the followers put back form a group of their own")
            group = await group_of(services.js, same)
            assert group is not None
            [again] = group.followers
            async with workers_of(config, services):
                for handle in (blocker, *followers):
                    await handle.result(timeout=20)
            [copy] = await terminals(client, again)
            assert isinstance(copy, Completed)
            assert copy.shared_with == group.leader
            joins = [e.leader for e in await history(client, again) if isinstance(e, Coalesced)]
            assert joins == [first.id, group.leader]
    # The blocker's call and the new leader's (shared with the other follower).
    assert mock.stats().requests == 2


async def test_a_leader_whose_call_fails_for_good_fails_its_followers_once(
    tmp_path: Path,
) -> None:
    """The leader's backend call fails for good (a 400): its followers end
    `failed` (`shared_call_failed`), each once, and the call is not repeated."""
    async with MockBackend(MockSettings(ttft=0.0, output_tokens=4)) as mock:
        config = unrun_config(tmp_path, mock.url)
        async with (
            Services(config, backends=[]) as services,
            Client(services.nc, tenant="t") as client,
        ):
            leader = await client.submit("doomed", route="chat", coalesce=True)
            followers = [await client.submit("doomed", route="chat", coalesce=True) for _ in "ab"]
            for handle in followers:
                await _wait_coalesced(client, handle.id)
            mock.update(failure_rate=1.0, failure_status=400)
            async with workers_of(config, services):
                with pytest.raises(RequestFailedError) as failed:
                    await leader.result(timeout=20)
                shared = []
                for handle in followers:
                    with pytest.raises(RequestFailedError) as info:
                        await handle.result(timeout=20)
                    shared.append(info.value.error_type)
            for handle in (leader, *followers):
                assert len(await terminals(client, handle.id)) == 1
            # Each failed follower has its own dead-letter copy, to requeue.
            listing = await DeadLetters(client.js).find(DeadLetterFilter(tenant="t"))
    assert failed.value.error_type == "backend_bad_request"
    assert shared == ["shared_call_failed", "shared_call_failed"]
    assert mock.stats().requests == 1
    dead = {(entry.request_id, entry.error_type) for entry in listing.entries}
    assert dead >= {(handle.id, "shared_call_failed") for handle in followers}


async def test_a_leader_judged_hopeless_at_the_router_lets_its_follower_run_alone(
    tmp_path: Path,
) -> None:
    """The router gives up a held leader that can no longer meet its deadline
    (every candidate's expected call time ends past it, `expired` before any
    call): its follower, which has no deadline, runs on its own, once."""
    async with MockBackend(MockSettings(ttft=0.8, output_tokens=2)) as mock:
        config = unrun_config(tmp_path, mock.url)
        async with (
            Services(config, backends=[]) as services,
            Client(services.nc, tenant="t") as client,
        ):
            async with workers_of(config, services):
                for n in range(5):  # the projection learns a call takes ~0.8 s
                    await (await client.submit(f"warm {n}", route="chat")).result(timeout=10)
            [router] = services.routers

            async def learned() -> bool:
                # White box: the router's view of the projection, once it folded them.
                view = router._state
                return view is not None and view.expected_duration("one") is not None

            await _until(learned, "the router knows how long a call takes")
            blocker = await client.submit("blocker", route="chat")  # takes the slot, unrun
            # Not hopeless when read (0.8 s of 3 s), hopeless once 2.2 s have passed.
            leader = await client.submit("late", route="chat", coalesce=True, timeout=3.0)
            follower = await client.submit("late", route="chat", coalesce=True)
            await _wait_coalesced(client, follower.id)
            with pytest.raises(RequestExpiredError, match="cannot meet the deadline"):
                await leader.result(timeout=10)
            async with workers_of(config, services):
                assert (await blocker.result(timeout=20)).text
                alone = await follower.result(timeout=20)
            assert alone.text
            for handle in (leader, follower):
                assert len(await terminals(client, handle.id)) == 1
            [ended] = await terminals(client, follower.id)
            assert isinstance(ended, Completed)
            assert ended.shared_with is None
    assert mock.stats().requests == 5 + 2  # warm-ups, the blocker, the follower alone


async def test_followers_of_a_hand_out_cut_short_are_found_in_the_log(
    stack: Services, slow: MockBackend
) -> None:
    """A leader's hand-out closed its group and stopped (its process died);
    before it ran again, an identical request found the group closed and
    replaced it with a group of its own. The leader's next hand-out finds no
    group of its own: it finds its followers in the log (their `coalesced`
    events) and ends each once. (Before: they were stranded.)

    The blocker holds the slot until the followers have joined the newcomer
    (its call never ends on its own; it is cancelled then): with a 1 s
    blocker, a loaded machine ran the leader before the test had closed its
    group."""
    async with Client(stack.nc, tenant="t") as client:
        same = client.build_request("cut", route="chat", coalesce=True)
        slow.update(output_tokens=10_000)  # 250 s at 40 tokens/s: past the test's timeout
        blocker = await occupy(client)
        slow.update(output_tokens=40)  # the calls after the blocker's: 1 s each
        leader = await client.submit("cut", route="chat", coalesce=True)
        followers = [await client.submit("cut", route="chat", coalesce=True) for _ in "ab"]
        for handle in followers:
            await _wait_coalesced(client, handle.id)
        # The hand-out as a crash left it: closed, nobody given an outcome yet.
        kv = await stack.js.key_value(STATE_BUCKET)
        name = f"co.t.{coalesce_key(same)}"
        entry = await kv.get(name)
        closed = msgspec.structs.replace(msgspec.json.decode(entry.value, type=Group), closed=True)
        await kv.update(name, msgspec.json.encode(closed), last=entry.revision)
        newcomer = await client.submit("cut", route="chat", coalesce=True)

        async def replaced() -> bool:
            group = await group_of(stack.js, same)
            return group is not None and group.leader == newcomer.id

        await _until(replaced, "the newcomer replaced the closed group")
        await leader.cancel()
        with pytest.raises(RequestCancelledError):
            await leader.result(timeout=10)

        async def joined_the_newcomer() -> bool:
            # Put back on their queue, the followers join the newcomer's group
            # (open while it waits for the slot). Seen in the group, where all
            # of them are at once (their second `coalesced` events are logged
            # one by one).
            group = await group_of(stack.js, same)
            return (
                group is not None
                and group.leader == newcomer.id
                and all(handle.id in group.followers for handle in followers)
            )

        await _until(joined_the_newcomer, "the followers joined the newcomer's call")
        await blocker.cancel()  # the slot is free for the newcomer
        with pytest.raises(RequestCancelledError):
            await blocker.result(timeout=10)
        text = (await newcomer.result(timeout=20)).text
        for handle in followers:
            assert (await handle.result(timeout=20)).text == text
        for handle in (leader, newcomer, *followers):
            assert len(await terminals(client, handle.id)) == 1
    # One call completed: the newcomer's, shared with the followers (the
    # blocker's was cancelled).
    assert slow.stats().completed == 1


async def test_a_follower_put_back_takes_a_routing_attempt_no_earlier_one_used(
    isolated_nc: Connection,
) -> None:
    """A follower that was preempted twice before it joined (attempts 1 and 2
    routed) and whose leader is then cancelled is put back with an attempt of
    its own (3, then routed as 4): reusing attempt 2 would give its dispatch
    the message id of the earlier one, dropped as a duplicate inside the
    window, and the request would be lost. Real NATS, the hand-out called
    directly: the double preemption is out of reach from outside."""
    js = isolated_nc.jetstream()
    await provision(isolated_nc, parse_config({"routes": {}, "backends": {}}))
    log = EventLog(js)
    client = Client(isolated_nc, tenant="t")
    request = client.build_request("twice preempted", route="chat", coalesce=True)
    await log.append(Submitted(request_id=request.id, tenant="t", at=time.time(), request=request))
    for attempt in (1, 2):
        preempted = Preempted(
            request_id=request.id,
            tenant="t",
            at=time.time(),
            backend="b",
            attempt=attempt,
            delivery=attempt,
            by="urgent",
        )
        await log.append(preempted)
    key = coalesce_key(request)
    assert key is not None
    kv = await js.key_value(STATE_BUCKET)
    await kv.put(f"co.t.{key}", msgspec.json.encode(Group(leader="lead", followers=[request.id])))
    cancelled = Cancelled(request_id="lead", tenant="t", at=time.time(), stage="queued")
    await Coalescer(js, clock=time.time).leader_ended("t", "lead", key, cancelled)
    stored = await js.get_last_msg(REQUESTS_STREAM, request_subject("normal", "t", requeue=True))
    again = REQUEST_DECODER.decode(stored.data)
    assert (again.id, again.requeues) == (request.id, 3)
