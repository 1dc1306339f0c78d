"""One binding order across all routers (issue #7 item 1).

Exactly one router binds at a time: the holder of the binder's lease
(:mod:`renqueue.coordination._lease`). These tests pin what that buys: with several routers
the order is global (a critical request never waits behind batch work another
router bound), a dead binder's standby takes over, and what the dead one held
is delivered to the new binder at once, not after ``router.ack_wait``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import pytest
from _waits import until
from test_restarts import (
    LEVELS,
    assert_nothing_left,
    audit,
    await_all,
    client_of,
    router_processes,
    workers,
    write_config,
)

from renqueue import Client, Services, parse_config
from renqueue.broker import EmbeddedServer, EventLog, connect, provision
from renqueue.config import Config, load_config
from renqueue.coordination import Lease, LeaseHolder, read_lease
from renqueue.errors import NatsNotFoundError, NatsUnavailableError
from renqueue.mock import MockBackend, MockSettings
from renqueue.schema import (
    DISPATCH_STREAM,
    REQUEST_DECODER,
    REQUESTS_STREAM,
    Dispatch,
    Routed,
    encode,
    router_consumer,
)
from renqueue.schema._subjects import dispatch_subject, msg_id
from renqueue.services.router import Router
from renqueue.services.router import _term as term_module

TENANT = "t"


def strict_config(url: str, mock: MockBackend, slots: int) -> Config:
    """Five levels, no aging, no preemption: the order is priority, then age."""
    return parse_config(
        {
            "nats": {"url": url},
            "backends": {
                "b": {"base_url": mock.url, "model": "m", "limits": {"concurrency": slots}}
            },
            "routes": {"chat": {"backends": ["b"]}},
            "router": {"capacity_refresh": "20ms"},
            "worker": {"drain_timeout": "2s"},
            "levels": {
                level: {"never_age": True, "preempts": False, "preemptible": False}
                for level in LEVELS
            },
        }
    )


async def held(js: Any) -> int:
    infos = [await js.consumer_info(REQUESTS_STREAM, router_consumer(level)) for level in LEVELS]
    return sum(info.num_ack_pending for info in infos)


async def test_with_three_routers_critical_work_is_bound_before_batch_work_held_elsewhere(
    isolated_server: EmbeddedServer,
) -> None:
    """Reproduces the review: each router held its own slice of the waiting
    requests and bound its own best when a slot freed, so with three routers
    batch work held by one was bound while critical work waited in another."""
    slots = 4
    async with MockBackend(MockSettings(ttft=0.02, output_tokens=2, concurrency=slots)) as mock:
        config = strict_config(isolated_server.url, mock, slots)
        async with (
            Services(config, routers=3, backends=[]) as services,
            Client(services.nc, tenant=TENANT) as client,
        ):
            js = services.js
            # No worker yet: batch work fills the free slots (bound into the
            # backend's subject) and the rest waits, held.
            batch = [
                await client.submit(f"batch {n}", route="chat", priority="batch") for n in range(24)
            ]

            async def read_all(level: str, count: int) -> bool:
                info = await js.consumer_info(REQUESTS_STREAM, router_consumer(level))
                dispatched = (await js.stream_info(DISPATCH_STREAM)).state.messages
                return info.num_pending == 0 and await held(js) + dispatched >= count

            await until(lambda: read_all("batch", len(batch)), "the batch work is read")
            critical = [
                await client.submit(f"critical {n}", route="chat", priority="critical")
                for n in range(6)
            ]
            await until(
                lambda: read_all("critical", len(batch) + len(critical)),
                "the critical work is read too",
            )
            log = EventLog(js)
            bound_early = {
                handle.id
                for handle in batch
                if any(isinstance(e, Routed) for e in await log.history(TENANT, handle.id))
            }
            # Slots free one by one from here: every critical request must be
            # bound before any batch request still waiting.
            async with Services(config, routers=0, backends=["b"], projector=False):
                await asyncio.gather(*(h.result(timeout=30) for h in (*batch, *critical)))
            routed: dict[str, Routed] = {}
            for handle in (*batch, *critical):
                events = [e for e in await log.history(TENANT, handle.id) if isinstance(e, Routed)]
                assert len(events) == 1, handle.id
                routed[handle.id] = events[0]
    assert len(bound_early) <= slots, "more work was bound than the backend has slots"
    late_batch = [routed[h.id].at for h in batch if h.id not in bound_early]
    last_critical = max(routed[h.id].at for h in critical)
    # (Requests bound in one round share its time: the round walks critical first.)
    assert last_critical <= min(late_batch), "a batch request was bound while critical work waited"
    # One router decided every one of them.
    assert len({event.router for event in routed.values()}) == 1
    assert all(event.term > 0 for event in routed.values())


async def test_a_killed_binders_standby_binds_what_it_held_at_once(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    """``kill -9`` of the binder: its standby takes the lease over, and the
    requests the dead one held are delivered to it at once (its router
    consumers are re-created), not after ``router.ack_wait`` (here 120 s, far
    beyond the test's budget)."""
    slots = 2
    settings = MockSettings(ttft=0.05, output_tokens=4, concurrency=slots)
    async with MockBackend(settings) as mock:
        file = write_config(
            tmp_path / "rq.toml",
            nats_url=isolated_server.url,
            backend_url=mock.url,
            slots=slots,
            router_ack_wait="120s",
        )
        async with (
            router_processes(file, tmp_path) as new_router,
            client_of(isolated_server.url) as (client, nc),
        ):
            js = nc.jetstream()
            first = await new_router()
            second = await new_router()
            binders = [r for r in (first, second) if "router is binding" in r.text()]
            assert len(binders) == 1, "exactly one of two routers binds"
            binder = binders[0]
            standby = second if binder is first else first
            handles = [
                await client.submit(f"q{n}", route="chat", priority=LEVELS[n % len(LEVELS)])
                for n in range(30)
            ]

            async def holding() -> bool:
                return await held(js) >= 20

            # No worker yet: all but the slots' worth wait in the binder's hold.
            await until(holding, "the binder holds the waiting requests")
            await binder.kill()

            async def took_over() -> bool:
                return "router is binding" in standby.text()

            await until(took_over, "the standby took the lease over")
            async with workers(load_config(file, environ={})):
                await await_all(client, handles, within=30)
            await audit(js, handles)
            await assert_nothing_left(js)
            assert await standby.terminate() == 0


async def test_a_lease_has_one_holder_expires_with_its_holder_and_can_be_given_up(
    isolated_server: EmbeddedServer,
) -> None:
    config = parse_config({"router": {"lease_ttl": "500ms"}})
    nc = await connect(isolated_server.url, name="lease")
    try:
        js = nc.jetstream()
        await provision(nc, config)
        a = Lease(js, "role", "a", ttl=0.5)
        b = Lease(js, "role", "b", ttl=0.5)
        assert await a.try_acquire()
        assert a.valid()
        assert a.term is not None
        assert not await b.try_acquire()
        assert not b.valid()
        # Its own entry is its own: a restarted loop of the same holder adopts it.
        assert await a.try_acquire()
        assert await a.renew()

        # a stops renewing (dies): the server expires its entry, b acquires.
        async def b_acquires() -> bool:
            return await b.try_acquire()

        await until(b_acquires, "the dead holder's lease expired and b took it")
        # a's next renewal finds the key moved on: lost, not valid.
        assert not await a.renew()
        assert not a.valid()
        assert b.term is not None
        assert b.term > 0
        # Given up, it is free at once.
        await b.release()
        assert not b.valid()
        assert await a.try_acquire()
        entry = await (await js.key_value("rq-leases")).get("role")
        assert entry.value == b"a"
    finally:
        await nc.close()


async def test_the_lease_names_its_holder_and_term_for_anyone_to_read(
    isolated_server: EmbeddedServer,
) -> None:
    """The term is the revision of the create that began it, renewals move the
    revision on: the entry names its term, and a restarted loop of the same
    holder adopts the term it had."""
    nc = await connect(isolated_server.url, name="lease")
    try:
        js = nc.jetstream()
        await provision(nc, parse_config({"router": {"lease_ttl": "5s"}}))
        assert await read_lease(js, "role") is None
        a = Lease(js, "role", "a@host:1:abc", ttl=5.0)
        assert await a.try_acquire()
        term = a.term
        assert term is not None
        assert await read_lease(js, "role") == LeaseHolder(holder="a@host:1:abc", term=term)
        for _ in range(3):
            assert await a.renew()
        entry = await (await js.key_value("rq-leases")).get("role")
        assert entry.revision == term + 3
        assert await read_lease(js, "role") == LeaseHolder(holder="a@host:1:abc", term=term)
        restarted = Lease(js, "role", "a@host:1:abc", ttl=5.0)
        assert await restarted.try_acquire()
        assert restarted.term == term
        other = Lease(js, "role", "b", ttl=5.0)
        assert not await other.try_acquire()
        await restarted.release()
        assert await read_lease(js, "role") is None
    finally:
        await nc.close()


async def test_a_router_judges_its_lease_by_the_buckets_expiry_when_that_is_shorter(
    isolated_server: EmbeddedServer,
) -> None:
    """Review finding: validity was judged by the router's own ``lease_ttl``
    while the server expires the lease by the bucket's ``max_age``, which the
    last process to provision set; two leases could then be valid at once."""
    short = parse_config({"router": {"lease_ttl": "1s"}})
    long = parse_config({"router": {"lease_ttl": "5s"}})
    nc = await connect(isolated_server.url, name="ttl")
    try:
        await provision(nc, short)  # the bucket expires entries after 1 s
        router = Router(nc, nc.jetstream(), long, name="long")
        await router.start()
        try:
            assert router.binding
            assert router.lease_ttl == pytest.approx(1.0)
        finally:
            await router.close()
    finally:
        await nc.close()


async def test_provisioning_never_shortens_the_lease_bucket_under_a_running_binder(
    isolated_server: EmbeddedServer,
) -> None:
    """Review finding: a binder judges its lease by the bucket's ``max_age`` as
    it read it at start. A process of a new config (``lease_ttl = "1s"``) that
    provisioned shortened it in place, the server then expired the binder's
    lease between its renewals, and a second router bound beside it for about
    a second. Provisioning now keeps the longer ttl (shortening needs every
    router stopped and the bucket deleted), so the binder's judgement holds."""
    short = parse_config({"router": {"lease_ttl": "1s"}})
    long = parse_config({"router": {"lease_ttl": "10s"}})
    nc = await connect(isolated_server.url, name="ttl")
    try:
        js = nc.jetstream()
        await provision(nc, long)
        binder = Router(nc, js, long, name="long")
        await binder.start()
        try:
            assert binder.binding
            report = await provision(nc, short)  # e.g. a worker of the new config starts
            info = await js.stream_info("KV_rq-leases")
            assert info.config.max_age == pytest.approx(10.0)
            leases = next(item for item in report.items if item.name == "rq-leases")
            assert leases.action.value == "unchanged"
            # A router of the new config judges by the bucket's (longer) expiry
            # only when that is shorter than its own: its own 1 s stands.
            other = Router(nc, js, short, name="short")
            await other.start()
            try:
                assert not other.binding
                assert binder.binding
            finally:
                await other.close()
        finally:
            await binder.close()
        # Lengthening is safe and applies in place.
        await provision(nc, parse_config({"router": {"lease_ttl": "20s"}}))
        assert (await js.stream_info("KV_rq-leases")).config.max_age == pytest.approx(20.0)
    finally:
        await nc.close()


def two_backends(url: str, **router: Any) -> Config:
    return parse_config(
        {
            "nats": {"url": url},
            "backends": {
                name: {"base_url": "http://127.0.0.1:9", "model": "m", "limits": {"concurrency": 1}}
                for name in ("a", "b")
            },
            "routes": {"chat": {"backends": ["a", "b"]}},
            "router": {"capacity_refresh": "20ms", **router},
        }
    )


async def test_a_rebind_logs_the_backend_an_earlier_bind_dispatched_to(
    isolated_server: EmbeddedServer,
) -> None:
    """Review finding: a binder stored attempt 1's dispatch on ``a`` and died
    before its ``routed`` event was stored. The next binder, seeing ``a`` full
    (it holds that very dispatch), chose ``b``: the dispatch to ``b`` was
    deduplicated by its per-attempt id, and ``routed(b)`` was logged for a
    request that sits on ``a``. The decision logged is now the stored one."""
    config = two_backends(isolated_server.url)
    nc = await connect(isolated_server.url, name="rebind")
    try:
        js = nc.jetstream()
        await provision(nc, config)
        async with Client(nc, tenant=TENANT) as client:
            await client.submit("hello", route="chat", request_id="r1")
            request = REQUEST_DECODER.decode((await js.get_msg(REQUESTS_STREAM, seq=1)).data)
            # The dead binder's last act: its dispatch on a, its decision lost.
            await js.publish(
                dispatch_subject("a"),
                encode(Dispatch(request=request, backend="a", attempt=1, routed_at=0.0)),
                headers={"Nats-Msg-Id": msg_id(TENANT, "r1", "dispatch", 1)},
            )
            log = EventLog(js)

            async def routed() -> list[Routed]:
                return [e for e in await log.history(TENANT, "r1") if isinstance(e, Routed)]

            router = Router(nc, js, config, name="next-binder")
            await router.start()
            try:
                await until(lambda: _truthy(routed()), "the request's decision is logged")
                # Its message is acked: nothing will bind it again.
                await until(lambda: _no_pending(js), "the request message is settled")
            finally:
                await router.close()
            events = await routed()
            assert [(e.backend, e.attempt) for e in events] == [("a", 1)]
            assert "earlier bind" in events[0].reason
            assert (await js.stream_info(DISPATCH_STREAM)).state.messages == 1
            assert (await js.consumer_info(DISPATCH_STREAM, "worker-a")).num_pending == 1
            assert (await js.consumer_info(DISPATCH_STREAM, "worker-b")).num_pending == 0
    finally:
        await nc.close()


async def _truthy(value: Awaitable[Any]) -> bool:
    return bool(await value)


async def _no_pending(js: Any) -> bool:
    infos = [await js.consumer_info(REQUESTS_STREAM, router_consumer(level)) for level in LEVELS]
    return all(i.num_pending == 0 and i.num_ack_pending == 0 for i in infos)


def two_slots(url: str, **router: Any) -> Config:
    """One backend of concurrency 2 and no worker: what is dispatched stays queued."""
    return parse_config(
        {
            "nats": {"url": url},
            "backends": {
                "a": {"base_url": "http://127.0.0.1:9", "model": "m", "limits": {"concurrency": 2}}
            },
            "routes": {"chat": {"backends": ["a"]}},
            "router": {"capacity_refresh": "20ms", **router},
        }
    )


class SlowDispatchStore:
    """The router's JetStream, but each dispatch takes ``delay`` to be sent
    (a busy replicated stream); it counts the binder's capacity reads."""

    def __init__(self, js: Any, delay: float) -> None:
        self._js = js
        self._delay = delay
        self.stored = 0
        self.reads_after_stored = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._js, name)

    async def publish_async(self, subject: str, payload: bytes = b"", headers: Any = None) -> Any:
        if subject.startswith(dispatch_subject("")):
            await asyncio.sleep(self._delay)  # the store's latency, not a synchronisation
            future = await self._js.publish_async(subject, payload, headers=headers)
            future.add_done_callback(lambda _f: setattr(self, "stored", self.stored + 1))
            return future
        return await self._js.publish_async(subject, payload, headers=headers)

    async def consumer_info(self, stream: str, name: str) -> Any:
        info = await self._js.consumer_info(stream, name)
        if stream == DISPATCH_STREAM and self.stored:
            self.reads_after_stored += 1
        return info


async def test_a_slow_dispatch_store_never_overfills_a_backend(
    isolated_server: EmbeddedServer,
) -> None:
    """Review finding: a capacity read replaced the binder's count of its own
    dispatches with the broker's, though those dispatches were not stored yet:
    every read during a slow store freed the backend's whole concurrency again
    (12 dispatches for 2 slots with a 300 ms store). Unconfirmed dispatches
    now stay counted until a read that began after their store counts them."""
    config = two_slots(isolated_server.url)
    nc = await connect(isolated_server.url, name="slow-store")
    try:
        js = nc.jetstream()
        await provision(nc, config)
        async with Client(nc, tenant=TENANT) as client:
            for n in range(12):
                await client.submit(f"q{n}", route="chat", request_id=f"r{n}")
            router = Router(nc, js, config, name="binder")
            slow = SlowDispatchStore(js, 0.3)
            router._js = slow  # type: ignore[assignment]
            router._round._capacity._js = slow  # type: ignore[assignment]
            router._round._dispatcher._js = slow  # type: ignore[assignment]
            await router.start()
            try:

                async def many_reads_after_the_stores() -> bool:
                    return slow.stored >= 2 and slow.reads_after_stored >= 10

                await until(many_reads_after_the_stores, "the binder read the load 10 more times")
                stored = (await js.stream_info(DISPATCH_STREAM)).state.messages
            finally:
                await router.close()
        assert stored == 2, f"{stored} dispatches for a backend of concurrency 2"
    finally:
        await nc.close()


class HeldDecisions:
    """The router's JetStream, but ``routed`` events are not sent until
    ``release`` is set (a broker slow to ack the decision); it counts the
    binder's capacity reads."""

    def __init__(self, js: Any) -> None:
        self._js = js
        self.release = asyncio.Event()
        self.reads = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._js, name)

    async def publish_async(self, subject: str, payload: bytes = b"", headers: Any = None) -> Any:
        if subject.endswith(".routed"):
            await self.release.wait()
        return await self._js.publish_async(subject, payload, headers=headers)

    async def consumer_info(self, stream: str, name: str) -> Any:
        self.reads += 1
        return await self._js.consumer_info(stream, name)


async def test_a_stored_dispatch_is_counted_once_while_its_decision_is_on_its_way(
    isolated_server: EmbeddedServer,
) -> None:
    """The soak's binder counted p50 29 requests in flight where the broker
    counted 23: a dispatch stayed counted as "on its way" until its decision's
    ack came back too (40-120 ms on a loaded broker), while the broker counted
    it already, so its slot sat idle. A dispatch's slot is settled by its own
    ack: after a read of the load, each stored dispatch is counted once."""
    config = two_slots(isolated_server.url)
    nc = await connect(isolated_server.url, name="held-decisions")
    try:
        js = nc.jetstream()
        await provision(nc, config)
        async with Client(nc, tenant=TENANT) as client:
            for n in range(4):
                await client.submit(f"q{n}", route="chat", request_id=f"r{n}")
            router = Router(nc, js, config, name="binder")
            held = HeldDecisions(js)
            router._round._dispatcher._log._js = held  # type: ignore[attr-defined]
            router._round._capacity._js = held  # type: ignore[assignment]
            await router.start()
            try:

                async def both_stored() -> bool:
                    return (await js.stream_info(DISPATCH_STREAM)).state.messages == 2

                await until(both_stored, "both slots' dispatches were stored")
                reads = held.reads

                async def read_twice_since() -> bool:
                    return held.reads >= reads + 2

                await until(read_twice_since, "the binder read the load twice more")
                counted = router._round._capacity.in_flight("a")
            finally:
                held.release.set()
                await router.close()
        assert counted == 2, f"2 dispatches stored, counted as {counted} in flight"
    finally:
        await nc.close()


NO_CONSUMER_DELETE = """
jetstream {}
authorization {
  users: [
    {user: svc, password: svc}
    {
      user: nodelete
      password: nodelete
      permissions: {
        publish: {allow: [">"], deny: ["$JS.API.CONSUMER.DELETE.RQ_REQUESTS.>"]}
        subscribe: {allow: [">"]}
      }
    }
  ]
}
"""


async def test_a_binder_whose_term_cannot_begin_gives_the_lease_up(tmp_path: Path) -> None:
    """Review finding: a router that took the lease but could not begin its
    term (here it may not re-create the router consumers: a permissions file
    older than the binder) kept renewing the lease, so no router ever bound.
    After 3 failed beginnings it gives the lease up and sits out."""
    conf = tmp_path / "server.conf"
    conf.write_text(NO_CONSUMER_DELETE)
    async with EmbeddedServer(tmp_path / "nats", port=-1, config_file=conf) as server:

        def url(user: str) -> str:
            return server.url.replace("nats://", f"nats://{user}:{user}@")

        config = two_backends(url("svc"))
        svc = await connect(url("svc"), name="svc")
        denied = await connect(url("nodelete"), name="nodelete")
        try:
            js = svc.jetstream()
            await provision(svc, config)
            first = Router(svc, js, config, name="first")
            await first.start()
            assert first.binding
            bad = Router(denied, denied.jetstream(), config, name="bad")
            await bad.start()
            assert not bad.binding
            await first.close()  # gives the lease up: the router that cannot bind takes it
            lease = await js.key_value("rq-leases")

            async def held_by_bad() -> bool:
                try:
                    return (await lease.get("binder")).value.decode().startswith("bad")
                except NatsNotFoundError:
                    return False

            await until(held_by_bad, "the router that cannot bind holds the lease")
            healthy = Router(svc, js, config, name="healthy")
            await healthy.start()
            try:

                async def binding() -> bool:
                    return healthy.binding

                await until(binding, "a router that can bind binds", within=60.0)
                assert not bad.binding
            finally:
                await healthy.close()
                await bad.close()
        finally:
            await denied.close()
            await svc.close()


async def test_earlier_lease_loop_failures_never_make_a_healthy_binder_give_up(
    isolated_server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review finding: the give-up rule read the lease loop's failure count,
    which NATS blips during a standby's life had raised and nothing lowered.
    A renewal that came while a slow term was beginning then saw no term and
    3 failures, and gave the lease up at every take-over. Only failed term
    beginnings in a row count now."""
    config = two_backends(isolated_server.url)
    nc = await connect(isolated_server.url, name="stale")
    try:
        js = nc.jetstream()
        await provision(nc, config)
        holder = Router(nc, js, config, name="holder")
        await holder.start()
        standby = Router(nc, js, config, name="standby")
        await standby.start()
        assert holder.binding
        assert not standby.binding
        # Its lease loop failed 3 times at some point (a NATS restart, long ago).
        standby._supervisor._loops[standby._loop_name("lease")].failures = 3
        real_renew = term_module.renew_router_consumers

        async def slow_renew(*args: Any, **kwargs: Any) -> None:
            await asyncio.sleep(0.25)  # a replicated cluster's consumer re-creation
            await real_renew(*args, **kwargs)

        monkeypatch.setattr(term_module, "renew_router_consumers", slow_renew)
        renewals = 0
        real_lease_renew = standby._lease.renew

        async def counted() -> bool:
            nonlocal renewals
            renewals += 1
            return await real_lease_renew()

        standby._lease.renew = counted  # type: ignore[method-assign]
        try:
            await holder.close()  # the standby takes over, slowly

            async def binding() -> bool:
                return standby.binding

            await until(binding, "the standby binds")
            since = renewals

            async def renewed_often() -> bool:
                return renewals >= since + 10

            await until(renewed_often, "ten more renewals")
            assert standby.binding
            holder_now = await read_lease(js, "binder")
            assert holder_now is not None
            assert holder_now.holder == standby.holder
        finally:
            await standby.close()
    finally:
        await nc.close()


async def test_a_binder_whose_lease_is_lost_stands_by_and_binds_again_once_it_is_free(
    isolated_server: EmbeddedServer,
) -> None:
    """The lease loop sleeps while a term runs (only the term's end gives it
    anything to do): a binder whose lease is taken from it (here its key
    deleted under it, as the server's expiry would after a stall) ends its
    term at the next renewal, and its lease loop seeks the lease again and
    begins a new term."""
    config = two_backends(isolated_server.url)
    nc = await connect(isolated_server.url, name="lost")
    try:
        js = nc.jetstream()
        await provision(nc, config)
        router = Router(nc, js, config, name="lost")
        await router.start()
        try:
            assert router.binding
            first = await read_lease(js, "binder")
            assert first is not None
            await (await js.key_value("rq-leases")).delete("binder")

            async def new_term() -> bool:
                now = await read_lease(js, "binder")
                return (
                    router.binding
                    and now is not None
                    and now.holder == router.holder
                    and now.term > first.term
                )

            await until(new_term, "the router binds again, in a new term")
        finally:
            await router.close()
    finally:
        await nc.close()


class RefusedFirstDispatch:
    """The router's JetStream, but the first dispatch of ``request_id`` is
    refused (the dispatch stream had no leader for a moment)."""

    def __init__(self, js: Any, request_id: str) -> None:
        self._js = js
        self._id = request_id
        self.refused = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._js, name)

    async def publish_async(self, subject: str, payload: bytes = b"", headers: Any = None) -> Any:
        if not self.refused and (headers or {}).get("Nats-Msg-Id", "").endswith(
            f":{self._id}:dispatch:1"
        ):
            self.refused = True
            refusal: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            refusal.set_exception(NatsUnavailableError("JetStream system temporarily unavailable"))
            return refusal
        return await self._js.publish_async(subject, payload, headers=headers)


async def test_a_refused_dispatch_never_leaves_its_decision_logged(
    isolated_server: EmbeddedServer,
) -> None:
    """Review finding: the dispatch and the decision are published together;
    a refused dispatch left ``routed(a)`` stored, the request went to ``b`` on
    its next delivery, and ``routed(b)`` was dropped as a duplicate of the
    attempt's decision: the log named a backend the request was not on. A
    decision already logged for the attempt now stands: the request's next
    delivery dispatches it there (one over the slots, for a moment)."""
    config = two_backends(isolated_server.url)
    nc = await connect(isolated_server.url, name="refused")
    try:
        js = nc.jetstream()
        await provision(nc, config)
        log = EventLog(js)

        async def backends(request_id: str) -> list[str]:
            return [
                e.backend for e in await log.history(TENANT, request_id) if isinstance(e, Routed)
            ]

        async with Client(nc, tenant=TENANT) as client:
            router = Router(nc, js, config, name="binder")
            refusing = RefusedFirstDispatch(js, "r1")
            router._round._dispatcher._js = refusing  # type: ignore[assignment]
            await router.start()
            try:
                await client.submit("one", route="chat", request_id="r1")

                async def refused() -> bool:
                    return refusing.refused

                await until(refused, "r1's first dispatch is refused")
                await client.submit("two", route="chat", request_id="r2")  # takes a meanwhile

                async def both_dispatched() -> bool:
                    stored = (await js.stream_info(DISPATCH_STREAM)).state.messages
                    return stored == 2 and await _no_pending(js)

                await until(both_dispatched, "both requests are dispatched and settled")
            finally:
                await router.close()
            queued = {
                name: (await js.consumer_info(DISPATCH_STREAM, f"worker-{name}")).num_pending
                for name in ("a", "b")
            }
            logged = {rid: await backends(rid) for rid in ("r1", "r2")}
            assert logged == {"r1": ["a"], "r2": ["a"]}
            assert queued == {"a": 2, "b": 0}
    finally:
        await nc.close()


class LateStore(SlowDispatchStore):
    """Each dispatch's ack comes ``delay`` after it was sent (past the
    router's acks timeout): the store lands after the router gave up waiting."""

    sent = 0

    async def publish_async(self, subject: str, payload: bytes = b"", headers: Any = None) -> Any:
        if not subject.startswith(dispatch_subject("")):
            return await self._js.publish_async(subject, payload, headers=headers)
        ack: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.sent += 1

        async def land() -> None:
            await asyncio.sleep(self._delay)  # the store's latency, not a synchronisation
            try:
                stored = await self._js.publish(subject, payload, headers=headers)
            except Exception as exc:
                if not ack.done():
                    ack.set_exception(exc)
                return
            self.stored += 1
            if not ack.done():  # (the router may have stopped waiting)
                ack.set_result(stored)

        task = asyncio.create_task(land())
        self._landing = {*getattr(self, "_landing", set()), task}
        return ack


async def test_a_dispatch_whose_ack_times_out_stays_counted(
    isolated_server: EmbeddedServer,
) -> None:
    """Review finding: a dispatch whose ack did not come in time freed its slot
    at once, though the store could still land: a 2-slot backend got 4."""
    config = two_slots(isolated_server.url, ack_wait="1s")
    nc = await connect(isolated_server.url, name="late-store")
    try:
        js = nc.jetstream()
        await provision(nc, config)
        async with Client(nc, tenant=TENANT) as client:
            for n in range(12):
                await client.submit(f"q{n}", route="chat", request_id=f"r{n}")
            router = Router(nc, js, config, name="binder")
            late = LateStore(js, 1.5)
            router._round._capacity._js = late  # type: ignore[assignment]
            router._round._dispatcher._js = late  # type: ignore[assignment]
            await router.start()
            try:

                async def settled() -> bool:
                    # Long after the first stores landed (a slot freed too
                    # early is re-bound within a read), and every dispatch
                    # sent meanwhile has landed too.
                    return late.reads_after_stored >= 60 and late.stored == late.sent

                await until(settled, "60 reads after the first stores, every dispatch landed")
                stored = (await js.stream_info(DISPATCH_STREAM)).state.messages
            finally:
                await router.close()
        assert stored == 2, f"{stored} dispatches for a backend of concurrency 2"
    finally:
        await nc.close()


async def test_nothing_is_bound_to_a_backend_whose_worker_has_stopped(
    isolated_server: EmbeddedServer,
) -> None:
    """Issue #30 item 6 (a rolling restart, stop-first): while a backend's only
    worker restarted, the binder went on binding to it (its consumer had room), and
    those requests waited in its queue for the new worker although the route's other
    backend had free slots. With ``router.require_worker``, a backend no worker asks
    for work counts as full."""
    async with MockBackend(MockSettings(ttft=0.01, output_tokens=2, concurrency=8)) as mock:
        config = parse_config(
            {
                "nats": {"url": isolated_server.url},
                "backends": {
                    name: {"base_url": mock.url, "model": "m", "limits": {"concurrency": 2}}
                    for name in ("a", "b")
                },
                "routes": {"chat": {"backends": ["a", "b"]}},
                "router": {"capacity_refresh": "20ms", "require_worker": True},
            }
        )
        async with (
            Services(config, routers=1, backends=["a", "b"]) as services,
            Client(services.nc, tenant=TENANT) as client,
        ):
            log = EventLog(services.js)

            async def backend_of(handle: Any) -> str:
                await handle.result(timeout=20)
                events = [e for e in await log.history(TENANT, handle.id) if isinstance(e, Routed)]
                return events[-1].backend

            # Both workers up: the route's first backend takes the work.
            assert await backend_of(await client.submit("first", route="chat")) == "a"
            worker_a = next(w for w in services.workers if w.backend_name == "a")
            await worker_a.close()  # a's worker stops (SIGTERM), no other runs
            for n in range(4):
                handle = await client.submit(f"after a stopped {n}", route="chat")
                assert await backend_of(handle) == "b"
            info = await services.js.consumer_info(DISPATCH_STREAM, "worker-a")
            assert (info.num_pending, info.num_ack_pending) == (0, 0)


async def test_require_worker_false_binds_to_a_backend_with_no_worker(
    isolated_server: EmbeddedServer,
) -> None:
    """``router.require_worker = false`` (the default): room is the consumer's slots
    whatever pulls them (what is bound waits in the backend's queue for a worker)."""
    config = parse_config(
        {
            "nats": {"url": isolated_server.url},
            "backends": {
                "a": {"base_url": "http://127.0.0.1:9", "model": "m", "limits": {"concurrency": 2}}
            },
            "routes": {"chat": {"backends": ["a"]}},
            "router": {"capacity_refresh": "20ms", "require_worker": False},
        }
    )
    async with (
        Services(config, routers=1, backends=[]) as services,
        Client(services.nc, tenant=TENANT) as client,
    ):
        for n in range(3):
            await client.submit(f"r{n}", route="chat")

        async def queued() -> bool:
            info = await services.js.consumer_info(DISPATCH_STREAM, "worker-a")
            return info.num_pending == 2

        await until(queued, "the backend's two slots are bound, with no worker")
