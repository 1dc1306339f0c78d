"""Preemption: one urgent request takes exactly one preemptible run's slot (issue #6 item 19).

The ask must reach the worker process that holds the run to preempt (not a
random member of the backend's workers), one ask must never preempt two runs
(not on two workers of one backend, not on two candidate backends), and it
must work under ``nats/auth.conf``'s users (the worker's answer goes to the
service user's inbox).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from _waits import until

from renqueue import Client, Services, parse_config
from renqueue.broker import Connection, EmbeddedServer, EventLog, provision
from renqueue.config import Config
from renqueue.errors import RequestCancelledError
from renqueue.mock import MockBackend, MockSettings
from renqueue.policy import least_urgent_victim
from renqueue.schema import (
    DISPATCH_STREAM,
    Dispatch,
    Preempted,
    Started,
    dispatch_subject,
    encode,
    worker_consumer,
)
from renqueue.services.router import _asking
from renqueue.services.router._hold import Held
from renqueue.services.worker._delivery import Delivery
from renqueue.services.worker._yielding import Preemptible, Run, put_back

TENANT = "t"
AUTH_CONF = Path(__file__).resolve().parent.parent / "nats" / "auth.conf"
PASSWORDS = {
    "RQ_SERVICE_PASSWORD": "service-secret",
    "RQ_TENANT_ACME_PASSWORD": "acme-secret",
    "RQ_TENANT_GLOBEX_PASSWORD": "globex-secret",
    "RQ_SYS_PASSWORD": "sys-secret",
}
#: Runs that outlast any test (10,000 tokens at 25/s: past the per-test
#: timeout): a run admitted under these lasts until it is preempted or
#: cancelled, so a test's steps never race its end, however loaded the machine.
#: A token every 40 ms, so a preempted call's closed stream is seen at once.
ENDLESS = MockSettings(ttft=0.0, tokens_per_second=25, output_tokens=10_000)


def short_from_now(mock: MockBackend) -> None:
    """Calls the mock admits from now on are short (the runs it already
    admitted keep their length): a preempted run's rerun ends."""
    mock.update(output_tokens=4)


async def until_admitted(mock: MockBackend, calls: int) -> None:
    """Wait until ``mock`` has ``calls`` calls in flight: a request's
    ``started`` can be logged before the mock admits its call, and only then
    is the call's length fixed (so only then may :func:`short_from_now`)."""

    async def admitted() -> bool:
        return mock.stats().in_flight == calls

    await until(admitted, f"the mock admitted {calls} long call(s)")


def config_of(nats: dict[str, Any], backends: dict[str, tuple[str, int]]) -> Config:
    return parse_config(
        {
            "nats": nats,
            "backends": {
                name: {"base_url": url, "model": "m", "limits": {"concurrency": slots}}
                for name, (url, slots) in backends.items()
            },
            "routes": {"chat": {"backends": list(backends)}},
            "worker": {"retry_delay": "100ms", "drain_timeout": "1s"},
            "router": {"capacity_refresh": "20ms"},
        }
    )


async def until_started(client: Client, request_id: str, within: float = 30.0) -> None:
    log = EventLog(client.js)
    async with asyncio.timeout(within):
        while True:
            if any(isinstance(e, Started) for e in await log.history(TENANT, request_id)):
                return
            await asyncio.sleep(0.02)


async def histories(client: Client, ids: list[str]) -> dict[str, list[Any]]:
    log = EventLog(client.js)
    return {rid: await log.history(TENANT, rid) for rid in ids}


@pytest.mark.parametrize("other", ["normal", "low"])
async def test_the_ask_reaches_the_worker_holding_the_run_to_preempt(
    tmp_path: Path, other: str
) -> None:
    """Two worker processes of one backend, one slot each: A runs a batch
    request, B a ``normal`` (not preemptible) or ``low`` (preemptible, but more
    urgent than batch) one. A critical request preempts A's batch run, once,
    and never B's run. (Before: the ask went to one worker of a queue group,
    chosen at random, which preempted its own run or answered "none".)

    Both runs last until the urgent request is done (``ENDLESS``): B's is
    then cancelled, still in its one run. (Before, 2 s runs: on a loaded
    machine A's could end before the urgent request was routed, and nothing
    was preempted.)"""
    async with MockBackend(ENDLESS) as mock:
        # The broker allows two runs of backend b; each worker process one.
        shared = config_of({"data_dir": str(tmp_path / "nats"), "port": -1}, {"b": (mock.url, 2)})
        async with Services(shared, backends=[]) as services:
            one_each = config_of({"url": services.url}, {"b": (mock.url, 1)})
            only = {"routers": 0, "backends": ["b"], "provision_streams": False}
            async with Client(services.nc, tenant=TENANT) as client:
                async with Services(one_each, **only, projector=False, name="worker-a"):
                    batch = await client.submit("long batch", route="chat", priority="batch")
                    await until_started(client, batch.id)
                    async with Services(one_each, **only, projector=False, name="worker-b"):
                        busy = await client.submit("long", route="chat", priority=other)
                        await until_started(client, busy.id)
                        await until_admitted(mock, 2)
                        short_from_now(mock)
                        urgent = await client.submit(
                            "now", route="chat", priority="critical", max_tokens=2
                        )
                        for handle in (urgent, batch):
                            await handle.result(timeout=30)
                        await busy.cancel()
                        [ended] = await asyncio.gather(
                            busy.result(timeout=30), return_exceptions=True
                        )
                events = await histories(client, [batch.id, busy.id, urgent.id])
    preempted = [(rid, e.by) for rid, es in events.items() for e in es if isinstance(e, Preempted)]
    assert preempted == [(batch.id, urgent.id)]
    assert sum(isinstance(e, Started) for e in events[busy.id]) == 1
    assert isinstance(ended, RequestCancelledError), ended  # still in its one run


@pytest.fixture
async def auth_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[str]:
    """A server running nats/auth.conf; yields the service user's URL."""
    for name, value in PASSWORDS.items():
        monkeypatch.setenv(name, value)
    async with EmbeddedServer(tmp_path / "nats", port=-1, config_file=AUTH_CONF) as server:
        yield server.url.replace("nats://", f"nats://renqueue:{PASSWORDS['RQ_SERVICE_PASSWORD']}@")


async def test_one_urgent_request_preempts_one_run_under_the_auth_config(
    auth_server: str,
) -> None:
    """Two candidate backends, each full with a batch run: one critical request
    preempts exactly one of them. (Before: ``auth.conf`` refused the worker's
    answer, the router timed out and asked the next backend, which preempted
    a second run for the same request.)

    Both batch runs last until preempted or cancelled (``ENDLESS``): the
    preempted one reruns short and completes, the other is then cancelled,
    still in its one run. (Before, 2 s runs: on a loaded machine they could
    end before the urgent request was routed, and nothing was preempted.)"""
    async with MockBackend(ENDLESS) as first, MockBackend(ENDLESS) as second:
        config = config_of(
            {"url": auth_server, "inbox_prefix": "_INBOX_renqueue"},
            {"b1": (first.url, 1), "b2": (second.url, 1)},
        )
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            batches = [
                await client.submit(f"long batch {n}", route="chat", priority="batch")
                for n in range(2)
            ]
            for handle in batches:
                await until_started(client, handle.id)
            for mock in (first, second):
                await until_admitted(mock, 1)
                short_from_now(mock)
            urgent = await client.submit("now", route="chat", priority="critical", max_tokens=2)
            await urgent.result(timeout=30)
            # The preempted batch reruns short and ends; the other still runs.
            ends = {asyncio.ensure_future(h.result(timeout=30)): h for h in batches}
            done, running = await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)
            for end in running:
                await ends[end].cancel()
            outcomes = await asyncio.gather(*done, *running, return_exceptions=True)
            events = await histories(client, [h.id for h in (*batches, urgent)])
    preempted = [(rid, e.by) for rid, es in events.items() for e in es if isinstance(e, Preempted)]
    assert preempted == [(ends[end].id, urgent.id) for end in done]
    for end, outcome in zip([*done, *running], outcomes, strict=True):
        if end in done:
            assert not isinstance(outcome, BaseException), outcome
            assert outcome.text
        else:  # still in its one run
            assert isinstance(outcome, RequestCancelledError), outcome
            assert sum(isinstance(e, Started) for e in events[ends[end].id]) == 1


async def test_a_preempted_request_is_not_lost_to_a_requeue_id_another_tenant_took(
    tmp_path: Path,
) -> None:
    """Another tenant publishes, on its own subject, with the message id the
    victim's requeue after a preemption will carry: the requeue is then a
    "duplicate" that stored nothing of the victim's. The worker must not ack
    the preempted dispatch until a copy is surely stored, or the request is lost.

    The batch run lasts until preempted (``ENDLESS``), its rerun is short.
    (Before, a 2 s run: on a loaded machine it could end before the urgent
    request was routed, and nothing was preempted.)"""
    async with MockBackend(ENDLESS) as mock:
        config = config_of({"data_dir": str(tmp_path / "nats"), "port": -1}, {"b": (mock.url, 1)})
        async with (
            Services(config) as services,
            Client(services.nc, tenant=TENANT) as client,
            Client(services.nc, tenant="evil") as evil,
        ):
            await evil.js.publish(
                "rq.req.normal.evil",
                b'{"id": "x", "tenant": "evil", "route": "chat", "messages": []}',
                headers={"Nats-Msg-Id": f"{TENANT}:victim:requeue:1"},
            )
            batch = await client.submit(
                "long batch", route="chat", priority="batch", request_id="victim"
            )
            await until_started(client, batch.id)
            await until_admitted(mock, 1)
            short_from_now(mock)
            urgent = await client.submit("now", route="chat", priority="critical", max_tokens=2)
            await urgent.result(timeout=30)
            assert (await batch.result(timeout=30)).text
            events = await histories(client, [batch.id])
    assert [e.by for e in events[batch.id] if isinstance(e, Preempted)] == [urgent.id]


async def test_nothing_is_preempted_for_a_request_that_stopped_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The router confirms a preemption after its offer window: if the urgent
    request was bound, ended or handed back meanwhile, it needs no slot and no
    run may be preempted for it. (Before: the confirm went out regardless.)
    White box: the window is too short to hit from outside without sleeps.

    The batch run lasts until it is cancelled (``ENDLESS``), and its call is
    running at the mock when the ask goes out and still when it is answered:
    the worker had a run to offer all along. (Before, a 2 s run: on a loaded
    machine it could end before the ask, and nothing could be preempted at
    all, whatever the router did.) The offer window waits here for the
    worker's offer before it settles: on a loaded machine the offer could miss
    the window, and nothing would be preempted whatever the router did."""
    weighed: list[int] = []
    settle = _asking._until_settled

    async def after_an_offer(
        arrived: asyncio.Event, offers: list[Any], unbeatable: Callable[[], bool]
    ) -> None:
        await asyncio.wait_for(arrived.wait(), 30.0)
        await settle(arrived, offers, unbeatable)
        weighed.append(len(offers))

    monkeypatch.setattr(_asking, "_until_settled", after_an_offer)
    async with MockBackend(ENDLESS) as mock:
        config = config_of({"data_dir": str(tmp_path / "nats"), "port": -1}, {"b": (mock.url, 1)})
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            batch = await client.submit("long", route="chat", priority="batch")
            await until_started(client, batch.id)
            await until_admitted(mock, 1)
            urgent = client.build_request("urgent", route="chat", priority="critical")
            now = services.routers[0]._round._clock()
            gone = Held(
                msg=None,
                request=urgent,
                rank=config.priorities.index("critical"),
                submitted=now,
                touched=now,
            )  # held by no router
            await services.routers[0]._round._ask_preemption(gone, gone.rank, ["b"])
            assert weighed == [1]  # the worker's offer of the batch run came, and was weighed
            assert not gone.preempted_one
            # The batch call never stopped: the one call, still running.
            assert (mock.stats().in_flight, mock.stats().requests) == (1, 1)
            await batch.cancel()
            [ended] = await asyncio.gather(batch.result(timeout=30), return_exceptions=True)
            history = (await histories(client, [batch.id]))[batch.id]
    assert isinstance(ended, RequestCancelledError), ended  # still in its one run
    assert not any(isinstance(event, Preempted) for event in history)
    assert mock.stats().requests == 1


async def test_a_run_of_a_request_put_back_the_most_times_is_never_preempted() -> None:
    """A request put back ``MAX_REQUEUES`` times cannot be put back again (its
    copy would be rejected at admission as malformed), so its run is never
    offered as a victim: the urgent request waits for another slot."""
    policies = parse_config({}).level_policies()
    batch = parse_config({}).priority_rank("batch")
    preemptible = Preemptible("b", policies)
    call = asyncio.create_task(asyncio.Event().wait())
    try:
        preemptible.runs["t:often"] = Run(rank=batch, started=0.0, call=call, may_requeue=False)
        assert preemptible.victim(0) is None
        preemptible.runs["t:once"] = Run(rank=batch, started=1.0, call=call)
        assert preemptible.victim(0) == "t:once"
    finally:
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)


async def test_an_offer_no_other_can_beat_is_confirmed_without_waiting_for_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one worker's offer is a batch run on the route's first backend: no
    offer can beat it, so the router confirms it at once. (Before: the router
    always collected offers for a fixed window, 200 ms of every preemption;
    made endless here, the urgent request waited for the batch run to end.)"""
    monkeypatch.setattr(_asking, "OFFER_WINDOW", 3600.0)
    long_batch = MockSettings(ttft=0.0, tokens_per_second=10, output_tokens=3000)
    async with MockBackend(long_batch) as mock:
        config = config_of({"data_dir": str(tmp_path / "nats"), "port": -1}, {"b": (mock.url, 1)})
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            batch = await client.submit("long batch", route="chat", priority="batch")
            await until_started(client, batch.id)
            urgent = await client.submit("now", route="chat", priority="critical", max_tokens=2)
            await until_started(client, urgent.id, within=30)
            await batch.cancel("seen enough")
            events = await histories(client, [batch.id])
    assert [e.by for e in events[batch.id] if isinstance(e, Preempted)] == [urgent.id]


async def test_a_put_back_is_counted_free_by_the_broker_before_its_slot_is_announced(
    isolated_server: EmbeddedServer, isolated_nc: Connection
) -> None:
    """A worker announces a freed slot once the put-back is done, and the
    binder then reads the worker consumer's counts: they must no longer count
    the dispatch put back. (Before: the ack was not waited for, and the read
    could still count it now and then: the urgent request waited for the
    binder's next periodic read.)"""
    config = config_of({"url": isolated_server.url}, {"b": ("http://127.0.0.1:9/v1", 1)})
    await provision(isolated_nc, config)
    js = isolated_nc.jetstream()
    psub = await js.pull_subscribe_bind(durable=worker_consumer("b"), stream=DISPATCH_STREAM)
    client = Client(isolated_nc, tenant=TENANT)
    still_counted = 0
    for n in range(100):
        request = client.build_request(f"put back {n}", route="chat", priority="batch")
        await js.publish(dispatch_subject("b"), encode(Dispatch(request=request, backend="b")))
        [msg] = await psub.fetch(batch=1, timeout=5)
        delivery = Delivery(msg, ack_wait=30)
        delivery.open(backend="b", stride=10)
        await put_back(js, delivery)
        info = await js.consumer_info(DISPATCH_STREAM, worker_consumer("b"))
        still_counted += (info.num_ack_pending or 0) + (info.num_pending or 0)
    assert still_counted == 0


async def test_a_backend_s_preempt_grace_keeps_the_slot_until_the_server_let_go(
    tmp_path: Path,
) -> None:
    """A server that refuses calls past its one slot (429) and notices a
    closed stream only at its next write: with ``preempt_grace`` the urgent
    call reaches it once it let the preempted call go, and is never refused."""
    refusing = MockSettings(ttft=0.0, tokens_per_second=25, output_tokens=50, concurrency=1)
    async with MockBackend(refusing) as mock:
        config = parse_config(
            {
                "nats": {"data_dir": str(tmp_path / "nats"), "port": -1},
                "backends": {
                    "b": {
                        "base_url": mock.url,
                        "model": "m",
                        "limits": {"concurrency": 1},
                        "preempt_grace": "1s",
                    }
                },
                "routes": {"chat": {"backends": ["b"]}},
                "worker": {"retry_delay": "100ms", "drain_timeout": "1s"},
                "router": {"capacity_refresh": "20ms"},
            }
        )
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            batch = await client.submit("long batch", route="chat", priority="batch")
            await until_started(client, batch.id)
            urgent = await client.submit("now", route="chat", priority="critical", max_tokens=2)
            for handle in (urgent, batch):
                await handle.result(timeout=30)
            events = await histories(client, [batch.id])
    assert [e.by for e in events[batch.id] if isinstance(e, Preempted)] == [urgent.id]
    assert mock.stats().busy == 0


def test_the_least_urgent_victim_is_the_least_urgent_preemptible_level() -> None:
    """An offer of a run at this rank on the first candidate cannot be beaten."""
    defaults = parse_config({})
    assert least_urgent_victim(defaults.level_policies()) == defaults.priority_rank("batch")
    only_low = parse_config({"levels": {"batch": {"preemptible": False}}})
    assert least_urgent_victim(only_low.level_policies()) == only_low.priority_rank("low")
    kept = {"preemptible": False}
    none = parse_config({"levels": {"low": kept, "batch": kept}})
    assert least_urgent_victim(none.level_policies()) is None
