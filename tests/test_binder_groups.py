"""Binding split in groups (issue 31 item 4, docs/scaling.md).

Two routes that share no backend are two binding groups: each has its own
lease (``binder.<group>``), term, consumers and books, and a router may hold
several terms. These tests pin: two routers bind one group each at once; one
router binds both; a killed router's group is taken over by the other; a
request sent to today's subject (no route) is forwarded to its group's binder;
a route subject that disagrees with the payload is rejected; and nothing is
lost or run twice.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
from _waits import until
from test_exporter import exporting, scrape
from test_restarts import LEVELS, RouterProcess, assert_nothing_left, audit

from renqueue import Client, Services
from renqueue.broker import (
    EmbeddedServer,
    EventLog,
    connect,
    provision,
    router_consumer_configs,
)
from renqueue.broker._nats import wire_size
from renqueue.config import Config, load_config, parse_config
from renqueue.coordination import Coalescer, read_lease
from renqueue.errors import ConfigError, RequestRejectedError
from renqueue.mock import MockBackend, MockSettings
from renqueue.schema import (
    FORWARD_CONSUMER,
    REQUESTS_STREAM,
    Failed,
    Routed,
    binder_lease,
    is_terminal,
    msg_id,
    request_subject,
    router_consumer,
)
from renqueue.services import AdvisoryReader, MaxDeliveries
from renqueue.services.router._endings import Endings
from renqueue.services.router._forward import ACKS_WAIT, Forwarder, open_forwarding

TENANT = "t"
ROUTES = ("r1", "r2")
ROUTE_OF = {"b1": "r1", "b2": "r2"}


def write_config(
    path: Path,
    *,
    nats_url: str,
    backend_url: str,
    slots: int = 4,
    split: bool = True,
    lease_ttl: str = "1s",
) -> Path:
    """Routes r1 -> b1 and r2 -> b2: two binding groups. Short ack waits and
    lease ttl, so a killed router's work comes back quickly."""
    text = (
        f'[nats]\nurl = "{nats_url}"\n'
        f'[router]\nack_wait = "2s"\ncapacity_refresh = "20ms"\nlease_ttl = "{lease_ttl}"\n'
        f"split_binding = {str(split).lower()}\n"
        f'[worker]\nack_wait = "2s"\nretry_delay = "100ms"\ndrain_timeout = "1s"\n'
    )
    for backend, route in zip(("b1", "b2"), ROUTES, strict=True):
        text += (
            f'[backends.{backend}]\nbase_url = "{backend_url}"\nmodel = "mock"\n'
            f"[backends.{backend}.limits]\nconcurrency = {slots}\n"
            f'[routes.{route}]\nbackends = ["{backend}"]\n'
        )
    for level in LEVELS:
        text += f"[levels.{level}]\n"
        text += "preempts = false\n" if level == "critical" else "preemptible = false\n"
    path.write_text(text)
    return path


@asynccontextmanager
async def stack(
    tmp_path: Path, server: EmbeddedServer, *, split: bool = True, lease_ttl: str = "1s"
) -> AsyncIterator[tuple[Path, Config]]:
    """A mock backend and the two-group config file; yields (file, config)."""
    async with MockBackend(MockSettings(ttft=0.01, output_tokens=2, concurrency=64)) as mock:
        file = write_config(
            tmp_path / "rq.toml",
            nats_url=server.url,
            backend_url=mock.url,
            split=split,
            lease_ttl=lease_ttl,
        )
        yield file, load_config(file, environ={})


async def holders(js: Any) -> dict[str, str | None]:
    """Who holds each group's lease."""
    found = {group: await read_lease(js, binder_lease(group)) for group in ROUTES}
    return {group: None if held is None else held.holder for group, held in found.items()}


async def submit_both(client: Client, prefix: str, count: int) -> list[Any]:
    """``count`` requests to each route, round-robin over the levels."""
    return [
        await client.submit(f"{prefix} {n}", route=route, priority=LEVELS[n % len(LEVELS)])
        for n in range(count)
        for route in ROUTES
    ]


async def routed_by(js: Any, handles: list[Any]) -> dict[str, set[str]]:
    """The routers (lease holders) that bound each route's requests."""
    log = EventLog(js)
    by_route: dict[str, set[str]] = {route: set() for route in ROUTES}
    for handle in handles:
        for event in await log.history(TENANT, handle.id):
            if isinstance(event, Routed):
                by_route[ROUTE_OF[event.backend]].add(event.router)
    return by_route


def test_the_config_makes_two_groups_and_their_consumers(tmp_path: Path) -> None:
    config = load_config(
        write_config(tmp_path / "rq.toml", nats_url="nats://x:1", backend_url="http://x"),
        environ={},
    )
    assert config.sharded()
    assert [(g.name, g.routes, g.backends) for g in config.binding_groups()] == [
        ("r1", ("r1",), ("b1",)),
        ("r2", ("r2",), ("b2",)),
    ]
    # Each group's binder sees its own routes and backends only.
    first = config.for_group(config.binding_groups()[0])
    assert (list(first.routes), list(first.backends)) == (["r1"], ["b1"])
    assert router_consumer("normal", "r1") == "router-r1-normal"
    assert binder_lease("r1") == "binder.r1"
    assert request_subject("normal", TENANT, route="r1") == "rq.req.normal.t.r1"


def test_the_forwarding_consumer_gives_a_killed_routers_requests_back_soon() -> None:
    """No successor re-creates the forwarding consumer (it has no lease): what
    a killed router had fetched from it comes back after its ack wait, which
    is short (5 s), not the router consumers' (``router.ack_wait``, 30 s by
    default): put-backs and requests sent without their route go through it."""
    config = parse_config(
        {
            "backends": {n: {"base_url": "http://x", "model": "m"} for n in ("b1", "b2")},
            "routes": {"r1": {"backends": ["b1"]}, "r2": {"backends": ["b2"]}},
            "router": {"split_binding": True, "ack_wait": "30s"},
        }
    )
    [forward] = router_consumer_configs(config, group=FORWARD_CONSUMER)
    assert forward["ack_wait"] == 5_000_000_000
    [group, *_] = router_consumer_configs(config, group="r1")
    assert group["ack_wait"] == 30_000_000_000


def test_groups_are_merged_never_split() -> None:
    backends = {name: {"base_url": "http://x", "model": "m"} for name in ("b1", "b2", "b3")}
    merged = parse_config(
        {
            "backends": backends,
            "routes": {
                "r1": {"backends": ["b1"], "group": "g"},
                "r2": {"backends": ["b2"], "group": "g"},
                "r3": {"backends": ["b3", "b1"]},
            },
        }
    )
    assert not merged.sharded()
    # Routes sharing no backend are groups of their own only when asked.
    apart = {"r1": {"backends": ["b1"]}, "r2": {"backends": ["b2"]}}
    assert len(parse_config({"backends": backends, "routes": apart}).binding_groups()) == 2
    assert not parse_config({"backends": backends, "routes": apart}).sharded()
    assert [(g.name, g.routes) for g in merged.binding_groups()] == [("g", ("r1", "r2", "r3"))]
    with pytest.raises(ConfigError, match="can be merged, never split"):
        parse_config(
            {
                "backends": backends,
                "routes": {
                    "r1": {"backends": ["b1"], "group": "g"},
                    "r2": {"backends": ["b1"], "group": "h"},
                },
            }
        )
    with pytest.raises(ConfigError, match="may not be named 'requeue'"):
        parse_config(
            {
                "backends": backends,
                "routes": {"requeue": {"backends": ["b1"]}, "r2": {"backends": ["b2"]}},
                "router": {"split_binding": True},
            }
        )


async def test_two_routers_bind_one_group_each_at_once(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    async with (
        stack(tmp_path, isolated_server) as (_file, config),
        Services(config, routers=2) as services,
        Client(services.nc, tenant=TENANT) as old_client,
        Client(services.nc, tenant=TENANT, route_subjects=True) as client,
    ):
        js = services.js
        routers = services.routers

        async def spread() -> bool:
            groups = [router.binding_groups for router in routers]
            return sorted(g for held in groups for g in held) == list(ROUTES) and all(
                len(held) == 1 for held in groups
            )

        await until(spread, "each router binds one group")
        held = await holders(js)
        assert held["r1"] != held["r2"]
        # Today's subject (forwarded to the route's) and the route's own.
        handles = [*await submit_both(old_client, "old", 10), *await submit_both(client, "new", 10)]
        await asyncio.gather(*(h.result(timeout=30) for h in handles))
        await audit(js, handles)
        # Each group's requests were bound by that group's binder only.
        assert await routed_by(js, handles) == {route: {held[route]} for route in ROUTES}
        assert sum(router.forwarded for router in routers) == 20
        await assert_nothing_left(js)


async def test_one_router_binds_both_groups(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    async with (
        stack(tmp_path, isolated_server) as (_file, config),
        Services(config, routers=1) as services,
        Client(services.nc, tenant=TENANT) as client,
    ):
        js = services.js
        [router] = services.routers
        await until(
            lambda: asyncio.sleep(0, router.binding_groups == list(ROUTES)),
            "the router binds both groups",
        )
        assert await holders(js) == dict.fromkeys(ROUTES, router.holder)
        for level in LEVELS:
            for route in ROUTES:
                await js.consumer_info(REQUESTS_STREAM, router_consumer(level, route))
        await js.consumer_info(REQUESTS_STREAM, FORWARD_CONSUMER)
        handles = await submit_both(client, "one", 15)
        await asyncio.gather(*(h.result(timeout=30) for h in handles))
        await audit(js, handles)
        assert await routed_by(js, handles) == {route: {router.holder} for route in ROUTES}
        await assert_nothing_left(js)


async def test_the_exporter_shows_each_groups_binder(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    """Split in groups, each group's lease is a series of its own: held or not,
    and its term, kept once its router gives the lease up (the unlabelled pair
    speaks for all the groups together)."""
    async with stack(tmp_path, isolated_server) as (_file, config):
        nc = await connect(isolated_server.url, name="test-group-exporter")
        try:
            js = nc.jetstream()
            await provision(js, config)
            async with exporting(js, config) as (registry, _):
                first = await scrape(registry)
                for route in ROUTES:
                    assert first("renqueue_binder_group_present", group=route) == 0
                    assert first("renqueue_binder_group_term", group=route) == 0
                async with Services(config, routers=1) as services:
                    [router] = services.routers

                    async def both_held() -> bool:
                        now = await scrape(registry)
                        return all(
                            now("renqueue_binder_group_present", group=route) == 1
                            for route in ROUTES
                        )

                    await until(both_held, "the exporter sees both groups' binders")
                    terms = {
                        route: held.term
                        for route in ROUTES
                        if (held := await read_lease(js, binder_lease(route))) is not None
                    }
                    assert sorted(terms) == list(ROUTES)
                    held = await scrape(registry)
                    for route in ROUTES:
                        assert held("renqueue_binder_group_term", group=route) == terms[route] > 0
                    assert held("renqueue_binder_present") == 1
                    assert router.binding_groups == list(ROUTES)
                # The router gave its leases up: no binder; each group's last term is kept.
                gone = await scrape(registry)
                for route in ROUTES:
                    assert gone("renqueue_binder_group_present", group=route) == 0
                    assert gone("renqueue_binder_group_term", group=route) == terms[route]
                assert gone("renqueue_binder_present") == 0
        finally:
            await nc.close()


async def test_a_route_subject_that_disagrees_with_the_payload_is_rejected(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    async with (
        stack(tmp_path, isolated_server) as (_file, config),
        Services(config, routers=1) as services,
        Client(services.nc, tenant=TENANT) as client,
    ):
        js = services.js
        request = client.build_request("hi", route="r2", request_id="wrong-route")
        await js.publish(
            request_subject("normal", TENANT, route="r1"),
            msgspec.json.encode(request),
            headers={"Nats-Msg-Id": msg_id(TENANT, request.id)},
        )
        with pytest.raises(RequestRejectedError, match="does not match subject route") as info:
            await client.handle(request.id).result(timeout=20)
        assert info.value.error_type == "malformed"
        # A route no group has, sent without its route: forwarded to the first
        # group's first route, where admission rejects it (unknown_route).
        unknown = await client.submit("hi", route="no-such-route")
        with pytest.raises(RequestRejectedError):
            await unknown.result(timeout=20)
        # The forwarded copy's id is accepted only with its route in the subject.
        forged = client.build_request("hi", route="r1", request_id="forged-forward")
        await js.publish(
            request_subject("normal", TENANT),
            msgspec.json.encode(forged),
            headers={"Nats-Msg-Id": msg_id(TENANT, forged.id, "forwarded")},
        )
        with pytest.raises(RequestRejectedError, match="Nats-Msg-Id"):
            await client.handle(forged.id).result(timeout=20)

        # Nothing is left waiting (the rejected have their dead-letter copies);
        # a rejection is told before its message is acked, so wait for the acks.
        async def drained() -> bool:
            return (await js.stream_info(REQUESTS_STREAM)).state.messages == 0

        await until(drained, "every rejected request's message is acked")


async def test_a_killed_routers_group_is_taken_over_and_nothing_is_lost_or_run_twice(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    async with stack(tmp_path, isolated_server) as (file, config):
        started: list[RouterProcess] = []
        nc = await connect(isolated_server.url, name="test-client")
        try:
            async with (
                Services(config, routers=0, name="workers") as _workers,
                Client(nc, tenant=TENANT) as client,
            ):
                js = nc.jetstream()
                for index in range(2):
                    router = RouterProcess(file, tmp_path / f"router-{index}.log")
                    started.append(router)
                    await router.start()

                async def spread() -> bool:
                    held = await holders(js)
                    return None not in held.values() and held["r1"] != held["r2"]

                await until(spread, "each router process binds one group")
                held = await holders(js)
                victim = next(
                    r
                    for r in started
                    if f":{r.proc.pid}:" in str(held["r1"])  # type: ignore[union-attr]
                )
                survivor = next(r for r in started if r is not victim)
                before = await submit_both(client, "before", 20)
                victim.signal(signal.SIGKILL)
                await asyncio.wait_for(victim.proc.wait(), 10)  # type: ignore[union-attr]
                after = await submit_both(client, "after", 20)

                async def taken_over() -> bool:
                    now = await holders(js)
                    return now["r1"] is not None and now["r1"] == now["r2"] == held["r2"]

                await until(taken_over, "the surviving router binds both groups")
                handles = [*before, *after]
                await asyncio.gather(*(h.result(timeout=60) for h in handles))
                await audit(js, handles)
                await assert_nothing_left(js)
                assert survivor.proc is not None
                assert survivor.proc.returncode is None
        finally:
            for router in started:
                router.cleanup()
            for router in started:
                if router.proc is not None:
                    await asyncio.wait_for(router.proc.wait(), 10)
            await nc.close()


async def test_unsplit_a_route_subject_is_read_by_the_one_binder(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    """Without ``split_binding`` the layout is the unsplit one (one lease, one
    consumer a level), and a request naming its route in the subject is read
    and checked like any other."""
    async with (
        stack(tmp_path, isolated_server, split=False) as (_file, config),
        Services(config, routers=1) as services,
        Client(services.nc, tenant=TENANT, route_subjects=True) as client,
    ):
        js = services.js
        assert not config.sharded()
        [router] = services.routers
        assert router.binding_groups == []
        await js.consumer_info(REQUESTS_STREAM, router_consumer("normal"))
        assert (await read_lease(js, binder_lease())) is not None
        handles = await submit_both(client, "unsplit", 5)
        await asyncio.gather(*(h.result(timeout=30) for h in handles))
        await audit(js, handles)
        request = client.build_request("hi", route="r2", request_id="unsplit-wrong-route")
        await js.publish(
            request_subject("normal", TENANT, route="r1"),
            msgspec.json.encode(request),
            headers={"Nats-Msg-Id": msg_id(TENANT, request.id)},
        )
        with pytest.raises(RequestRejectedError, match="does not match subject route"):
            await client.handle(request.id).result(timeout=20)


async def test_a_stopped_routers_groups_are_taken_over_before_its_heartbeat_expires(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    """A router stopped gracefully takes its heartbeat away with its leases, so
    the other's share grows at once: it binds both groups long before the
    heartbeat would have expired (a lease ttl of 30 s here)."""
    async with (
        stack(tmp_path, isolated_server, lease_ttl="30s") as (_file, config),
        Services(config, routers=2) as services,
        Client(services.nc, tenant=TENANT) as client,
    ):
        js = services.js
        first, second = services.routers

        async def spread() -> bool:
            return len(first.binding_groups) == len(second.binding_groups) == 1

        await until(spread, "each router binds one group")
        await first.close()
        await until(
            lambda: asyncio.sleep(0, second.binding_groups == list(ROUTES)),
            "the other router binds both groups (its share grew at the stop)",
            within=15.0,
        )
        handles = await submit_both(client, "after", 5)
        await asyncio.gather(*(h.result(timeout=30) for h in handles))
        await audit(js, handles)
        assert await routed_by(js, handles) == {route: {second.holder} for route in ROUTES}


async def test_an_unknown_route_sent_without_its_route_is_rejected_as_unknown_route(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    """Split or not, a client written from the unsplit docs is told the same:
    a route the config does not have is ``unknown_route`` (forwarded to the
    first group's subject, it must not become ``malformed``)."""
    async with (
        stack(tmp_path, isolated_server) as (_file, config),
        Services(config, routers=1) as services,
        Client(services.nc, tenant=TENANT) as client,
    ):
        unknown = await client.submit("hi", route="no-such-route")
        with pytest.raises(RequestRejectedError) as info:
            await unknown.result(timeout=20)
        assert info.value.error_type == "unknown_route"
        assert services.routers[0].forwarded == 1


async def test_a_request_on_a_route_subject_out_of_deliveries_is_failed_as_its_tenants(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    """The advisory reader, the backstop that ends a request its consumer gave
    up on, reads the tenant from route subjects too: a put-back forwarded to
    ``rq.req.<level>.<tenant>.<route>.requeue`` ends as its tenant's request,
    not as an ``unknown`` tenant's while its own waits for ever."""
    async with (
        stack(tmp_path, isolated_server) as (_file, config),
        Services(config, routers=0) as services,
        Client(services.nc, tenant=TENANT) as client,
    ):
        js = services.js
        reader = AdvisoryReader(js)
        cases = {
            "put-back": (
                request_subject("normal", TENANT, route="r1", requeue=True),
                msg_id(TENANT, "put-back", "requeue", 1, "forwarded"),
            ),
            "forwarded": (
                request_subject("normal", TENANT, route="r2"),
                msg_id(TENANT, "forwarded", "forwarded"),
            ),
        }
        for request_id, (subject, header) in cases.items():
            request = client.build_request("hi", route=subject.split(".")[4], request_id=request_id)
            ack = await js.publish(
                subject, msgspec.json.encode(request), headers={"Nats-Msg-Id": header}
            )
            advisory = MaxDeliveries(
                stream=REQUESTS_STREAM,
                consumer=router_consumer("normal", "r1"),
                stream_seq=ack.seq,
                deliveries=200,
            )
            await reader.handle(advisory, at=time.time())
            ended = [e for e in await EventLog(js).history(TENANT, request_id) if is_terminal(e)]
            assert [type(e) for e in ended] == [Failed], request_id
            assert isinstance(ended[0], Failed)
            assert ended[0].error_type == "undeliverable"


async def test_a_forwarded_copy_carries_none_of_the_publishers_expectations(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    """A ``Nats-Expected-*`` header a tenant set on its publish held for the
    original's storing; copied onto the forwarded copy it would be refused for
    ever (nak'ed, retried every second, never bound). Forwarding keeps the
    id (with ``:forwarded``) and the trace, not the publisher's conditions."""
    async with (
        stack(tmp_path, isolated_server) as (_file, config),
        Services(config, routers=1) as services,
        Client(services.nc, tenant=TENANT) as client,
    ):
        js = services.js
        request = client.build_request("hi", route="r1", request_id="expecting")
        last = (await js.stream_info(REQUESTS_STREAM)).state.last_seq
        await js.publish(
            request_subject("normal", TENANT),
            msgspec.json.encode(request),
            headers={
                "Nats-Msg-Id": msg_id(TENANT, request.id),
                "Nats-Expected-Last-Sequence": str(last),
            },
        )
        assert (await client.handle(request.id).result(timeout=20)).text
        assert services.routers[0].forwarded == 1


async def test_a_request_whose_forwarded_copy_cannot_fit_is_rejected_and_routers_serve_on(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    """A tenant's request just under the broker's ``max_payload`` on today's
    subject: its copy (``:forwarded`` makes its id longer) cannot be sent. It
    is rejected as too big (as the binder rejects it unsplit), not a failure of
    the forwarding loop that, retried on every router, would take each down."""
    async with (
        stack(tmp_path, isolated_server) as (_file, config),
        Services(config, routers=1) as services,
        Client(services.nc, tenant=TENANT) as client,
    ):
        nc = services.nc
        assert nc is not None
        request_id = "near-the-limit"
        headers = {"Nats-Msg-Id": msg_id(TENANT, request_id)}

        def payload(length: int) -> bytes:
            return (
                b'{"id":"' + request_id.encode() + b'","tenant":"' + TENANT.encode() + b'",'
                b'"route":"r1","messages":[{"role":"user","content":"' + b"x" * length + b'"}]}'
            )

        room = nc.max_payload - 1 - wire_size(payload(0), headers)
        data = payload(room)
        assert wire_size(data, headers) == nc.max_payload - 1
        await nc.jetstream().publish(request_subject("normal", TENANT), data, headers=headers)
        with pytest.raises(RequestRejectedError, match="largest message") as info:
            await client.handle(request_id).result(timeout=20)
        assert info.value.error_type == "malformed"
        after = await client.submit("still served", route="r2")
        assert (await after.result(timeout=20)).text
        assert services.supervisor.reason is None


async def test_a_group_given_up_for_failing_is_taken_by_a_healthy_router_meanwhile(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    """A binder that gives its group's lease up for failing (its loops keep
    failing, its term cannot begin) sits the race out for ``5 * lease_ttl``
    so that a healthy router binds, as unsplit. Its heartbeat goes with it:
    counted, it kept the other router to its share (one group) and the group
    had no binder for the whole sit-out (10 s here)."""
    async with (
        stack(tmp_path, isolated_server, lease_ttl="2s") as (_file, config),
        Services(config, routers=2) as services,
        Client(services.nc, tenant=TENANT) as client,
    ):
        first, second = services.routers

        async def spread() -> bool:
            return len(first.binding_groups) == len(second.binding_groups) == 1

        await until(spread, "each router binds one group")
        [group] = second.binding_groups
        [sick] = [b for b in second._binders if b.group is not None and b.group.name == group]
        await sick.term.give_up("a binding loop keeps failing (the test)")
        await until(
            lambda: asyncio.sleep(0, first.binding_groups == list(ROUTES)),
            "the healthy router binds the group given up, while the other sits out",
            within=8.0,
        )
        handles = await submit_both(client, "meanwhile", 3)
        await asyncio.gather(*(h.result(timeout=30) for h in handles))


def _stopped(pid: int) -> bool:
    """The process is stopped (a signal is taken when the process next runs:
    until then, a thread on the other core may still answer)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


async def test_a_copy_whose_ack_never_comes_hands_its_request_back_and_forwarding_goes_on(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    """The broker stops answering (SIGSTOP: a hung server) between the copy's
    publish and its ack. The forwarder waits for the ack at most
    ``ACKS_WAIT`` and hands the original back, instead of waiting for ever:
    before, one lost ack stopped that router's forwarding for good, silently.
    Once the broker answers again the request is forwarded, once."""
    pid = isolated_server.pid
    assert pid is not None
    async with stack(tmp_path, isolated_server) as (_file, config):
        nc = await connect(isolated_server.url, name="test-forwarder")
        try:
            js = nc.jetstream()
            await provision(nc, config)
            endings = Endings(EventLog(js), Coalescer(js), clock=time.time)
            forwarder = Forwarder(nc, js, config, endings)
            psub = await open_forwarding(js)
            request = {"id": "hung", "tenant": TENANT, "route": "r1"}
            body = {**request, "messages": [{"role": "user", "content": "hi"}]}
            headers = {"Nats-Msg-Id": msg_id(TENANT, "hung")}
            await js.publish(
                request_subject("normal", TENANT), msgspec.json.encode(body), headers=headers
            )
            [msg] = await psub.fetch(batch=1, timeout=10)
            os.kill(pid, signal.SIGSTOP)
            await until(lambda: asyncio.to_thread(_stopped, pid), "the server is stopped")
            try:
                async with asyncio.timeout(ACKS_WAIT + 20):
                    await forwarder._forward([msg])
            finally:
                os.kill(pid, signal.SIGCONT)
            assert forwarder.forwarded == 0
            # Handed back: delivered again, and forwarded this time.
            [again] = await psub.fetch(batch=1, timeout=30)
            assert again.data == msg.data
            await forwarder._forward([again])
            assert forwarder.forwarded == 1
        finally:
            await nc.close()
