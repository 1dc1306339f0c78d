"""The server is the clock (issue #6 item 17).

A request's wait (its order among its level, its aging) and the log's
``submitted`` time come from the timestamp the broker gave the request when it
stored it, never from the ``submitted_at`` a client wrote into the payload: a
tenant can neither backdate a request to jump the queue nor future-date one to
stop the projection's clock.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import pytest
from _waits import until

from renqueue import Client, RequestCancelledError, Services, parse_config
from renqueue.broker import EventLog
from renqueue.config import Config
from renqueue.mock import MockBackend, MockSettings
from renqueue.schema import (
    REQUESTS_STREAM,
    Coalesced,
    Preempted,
    Routed,
    Started,
    Submitted,
    encode,
    msg_id,
    request_subject,
    router_consumer,
)

TENANT = "t"
AN_HOUR = 3600.0


def one_slot(tmp_path: Path, url: str, nats_url: str = "") -> Config:
    return parse_config(
        {
            "nats": {"data_dir": str(tmp_path / "nats"), "port": -1, "url": nats_url},
            "backends": {"b": {"base_url": url, "model": "m", "limits": {"concurrency": 1}}},
            "routes": {"chat": {"backends": ["b"]}},
            "worker": {"retry_delay": "100ms", "drain_timeout": "2s"},
            "router": {"capacity_refresh": "20ms"},
        }
    )


async def start_of(client: Client, request_id: str) -> float:
    history = await EventLog(client.js).history(TENANT, request_id)
    return next(e.at for e in history if isinstance(e, Started))


@pytest.mark.parametrize("how", ["submit", "forged requeue"])
async def test_a_backdated_request_does_not_jump_ahead_of_an_earlier_one(
    tmp_path: Path, how: str
) -> None:
    async with MockBackend(MockSettings(output_tokens=2)) as mock:
        config = one_slot(tmp_path, mock.url)
        # No worker yet: the first request takes the one slot (its dispatch
        # waits unrun), so the next two are both held when the slot frees.
        async with Services(config, backends=[]) as services:
            client = Client(services.nc, tenant=TENANT)
            async with client:
                blocker = await client.submit("blocker", route="chat")
                earlier = await client.submit("earlier", route="chat")
                backdated = msgspec.structs.replace(
                    client.build_request("backdated", route="chat"),
                    submitted_at=time.time() - AN_HOUR,
                )
                if how == "submit":
                    handle = await client.submit_request(backdated)
                else:
                    # As if a worker had requeued it after a preemption the
                    # log never saw: the payload's time must not count either.
                    again = msgspec.structs.replace(backdated, requeues=1)
                    await services.js.publish(
                        request_subject("normal", TENANT, requeue=True),
                        encode(again),
                        headers={"Nats-Msg-Id": msg_id(TENANT, again.id, "requeue", 1)},
                    )
                    handle = client.handle(again.id)

                async def both_held() -> bool:
                    info = await services.js.consumer_info(
                        REQUESTS_STREAM, router_consumer("normal")
                    )
                    return int(info.num_ack_pending) == 2

                await until(both_held, "the router holds both requests")
                workers = one_slot(tmp_path, mock.url, nats_url=services.url)
                async with Services(workers, routers=0, backends=["b"], projector=False):
                    for h in (blocker, earlier, handle):
                        await h.result(timeout=20)
                assert await start_of(client, earlier.id) < await start_of(client, handle.id)
                history = await EventLog(client.js).history(TENANT, handle.id)
                [submitted] = [e for e in history if isinstance(e, Submitted)]
                assert submitted.at > backdated.submitted_at + AN_HOUR / 2


async def test_a_future_dated_request_does_not_stall_the_projection_clock(
    tmp_path: Path,
) -> None:
    async with MockBackend(MockSettings(output_tokens=2)) as mock:
        config = one_slot(tmp_path, mock.url)
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            year_3000 = 32_503_680_000.0
            future = msgspec.structs.replace(
                client.build_request("from the future", route="chat"), submitted_at=year_3000
            )
            await (await client.submit_request(future)).result(timeout=10)
            later = await client.submit("later", route="chat")
            await later.result(timeout=10)
            assert services.projector is not None
            state = await asyncio.wait_for(services.projector.sync(), 10)
            log = EventLog(client.js)
            [submitted] = [
                e for e in await log.history(TENANT, future.id) if isinstance(e, Submitted)
            ]
            last = max(e.at for e in await log.history(TENANT, later.id))
    # The log and the projection's clock keep the services' time: the clock is
    # at the last event folded (the later request's), not in the year 3000.
    assert state.log_time == last
    assert abs(submitted.at - time.time()) < AN_HOUR


async def held_by_routers(services: Services) -> int:
    info = await services.js.consumer_info(REQUESTS_STREAM, router_consumer("normal"))
    return int(info.num_ack_pending)


async def test_a_follower_put_back_to_run_alone_keeps_its_place(tmp_path: Path) -> None:
    """A coalesced follower whose leader is cancelled is put back on its queue
    to run alone. Its wait still counts from its own submit (server time, from
    its `submitted` event): it goes before a request submitted after it,
    though its requeued copy was stored after that one."""
    async with MockBackend(MockSettings(output_tokens=2)) as mock:
        config = one_slot(tmp_path, mock.url)
        # No worker yet: the blocker's dispatch takes the one slot, unrun.
        async with (
            Services(config, backends=[]) as services,
            Client(services.nc, tenant=TENANT) as client,
        ):
            blocker = await client.submit("blocker", route="chat")
            leader = await client.submit("same", route="chat", coalesce=True)
            follower = await client.submit("same", route="chat", coalesce=True)
            log = EventLog(client.js)

            async def coalesced() -> bool:
                return any(isinstance(e, Coalesced) for e in await log.history(TENANT, follower.id))

            await until(coalesced, "the follower joined the leader's call")
            later = await client.submit("later", route="chat")
            await leader.cancel()
            with pytest.raises(RequestCancelledError):
                await leader.result(timeout=10)

            async def both_held() -> bool:
                return await held_by_routers(services) == 2

            await until(both_held, "the router holds the later request and the follower")
            workers = one_slot(tmp_path, mock.url, nats_url=services.url)
            async with Services(workers, routers=0, backends=["b"], projector=False):
                for handle in (blocker, follower, later):
                    await handle.result(timeout=20)
            assert await start_of(client, follower.id) < await start_of(client, later.id)
            history = await log.history(TENANT, follower.id)
    [submitted] = [e for e in history if isinstance(e, Submitted)]
    [routed] = [e for e in history if isinstance(e, Routed)]
    assert routed.queue_wait == pytest.approx(routed.at - submitted.at, abs=1e-6)


async def test_a_preempted_request_keeps_its_wait_from_its_first_submit(tmp_path: Path) -> None:
    """A preempted request put back by its worker (attempt 2) keeps the time
    of its first `submitted` event: its second `routed` counts its wait from
    there, not from the requeue."""
    long = MockSettings(ttft=0.0, tokens_per_second=25, output_tokens=50)
    async with MockBackend(long) as mock:
        config = one_slot(tmp_path, mock.url)
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            batch = await client.submit("long batch", route="chat", priority="batch")
            stream = batch.stream(timeout=10)
            for _ in range(12):
                # Its first run streams for a while (~0.45 s at 25 tokens/s): 5
                # chunks (~0.16 s) plus a preemption that no longer waits came
                # to 0.19 s, under the 0.2 s the wait is checked against below.
                await anext(stream)
            await stream.aclose()
            urgent = await client.submit("now", route="chat", priority="critical", max_tokens=2)
            await urgent.result(timeout=20)
            await batch.result(timeout=30)
            history = await EventLog(client.js).history(TENANT, batch.id)
    [submitted] = [e for e in history if isinstance(e, Submitted)]
    [preempted] = [e for e in history if isinstance(e, Preempted)]
    first, second = (e for e in history if isinstance(e, Routed))
    assert (first.attempt, second.attempt) == (1, 2)
    # From the requeue, the wait would be shorter by the first run's length.
    assert preempted.at - submitted.at > 0.2
    assert second.queue_wait == pytest.approx(second.at - submitted.at, abs=1e-6)
