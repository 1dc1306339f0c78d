"""A router's loops never die silently and never hold work hostage (issue #6 item 1).

Failures here are real broker failures, never mocks: a router connected as a
user the server refuses ``$JS.API.CONSUMER.INFO`` on the dispatch stream (its
every dispatch round's ``consumer_info`` times out), and a worker consumer
deleted under a running router (its every round finds it gone).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from _waits import until

from renqueue import Client, Services, parse_config
from renqueue.broker import EmbeddedServer, EventLog, connect
from renqueue.config import Config
from renqueue.errors import NatsUnavailableError, RequestFailedError, ServiceFailedError
from renqueue.logs import EVENT_ATTRIBUTE
from renqueue.mock import MockBackend, MockSettings
from renqueue.schema import (
    DISPATCH_STREAM,
    DLQ_STREAM,
    REQUESTS_STREAM,
    Routed,
    kind_of,
    router_consumer,
    worker_consumer,
)
from renqueue.services import run_until_signalled
from renqueue.services.router import Router
from renqueue.tasks import Supervisor

TENANT = "t"

#: Two users: ``svc`` may do everything; ``blind`` may not read a dispatch
#: consumer's info (a dispatch round's first JetStream call), nothing else.
SERVER_CONF = """
jetstream {}
authorization {
  users: [
    {user: svc, password: svc}
    {
      user: blind
      password: blind
      permissions: {
        publish: {allow: [">"], deny: ["$JS.API.CONSUMER.INFO.RQ_DISPATCH.>"]}
        subscribe: {allow: [">"]}
      }
    }
  ]
}
"""


def user_url(server: EmbeddedServer, user: str) -> str:
    return server.url.replace("nats://", f"nats://{user}:{user}@")


def make_config(url: str, mock: MockBackend, **router: Any) -> Config:
    return parse_config(
        {
            "nats": {"url": url},
            "backends": {"b": {"base_url": mock.url, "model": "m", "limits": {"concurrency": 2}}},
            "routes": {"chat": {"backends": ["b"]}},
            "worker": {"retry_delay": "100ms", "drain_timeout": "2s", "ack_wait": "3s"},
            "router": {"capacity_refresh": "20ms", "ack_wait": "3s", **router},
        }
    )


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[EmbeddedServer]:
    conf = tmp_path / "server.conf"
    conf.write_text(SERVER_CONF)
    async with EmbeddedServer(tmp_path / "nats", port=-1, config_file=conf) as server:
        yield server


async def held(js: Any) -> int:
    info = await js.consumer_info(REQUESTS_STREAM, router_consumer("normal"))
    return int(info.num_ack_pending)


async def test_a_router_whose_dispatch_rounds_fail_hands_its_requests_to_another(
    server: EmbeddedServer,
) -> None:
    """Reproduces the review: a router whose ``consumer_info`` times out kept
    its held requests alive forever (its dispatch task dead, its keepalive
    running), so no other router ever got them."""
    async with MockBackend(MockSettings(ttft=0.0, output_tokens=2, concurrency=2)) as mock:
        config = make_config(user_url(server, "svc"), mock)
        blind_nc = await connect(user_url(server, "blind"), name="blind-router")
        blind: Router | None = None
        try:
            async with (
                Services(config, routers=0) as services,
                Client(services.nc, tenant=TENANT) as client,
            ):
                # Only the failing router runs at first: it takes every request.
                blind = Router(blind_nc, blind_nc.jetstream(timeout=0.5), config, name="blind")
                await blind.start()
                handles = [
                    await client.submit(f"q{n}", route="chat", request_id=f"r{n}") for n in range(4)
                ]

                async def taken() -> bool:
                    return await held(services.js) > 0

                await until(taken, "the failing router took requests")
                # A healthy router joins: every request completes, including
                # those the failing router had taken.
                healthy = Router(services.nc, services.js, config, name="healthy")
                await healthy.start()
                try:
                    results = await asyncio.gather(*(h.result(timeout=20) for h in handles))
                finally:
                    await healthy.close()
                log = EventLog(services.js)
                for handle in handles:
                    routed = [
                        e for e in await log.history(TENANT, handle.id) if isinstance(e, Routed)
                    ]
                    assert len(routed) == 1
        finally:
            if blind is not None:
                await blind.close()
            await blind_nc.close()
    assert [r.backend for r in results] == ["b"] * 4
    assert blind.routed == 0
    assert mock.stats().requests == 4


async def test_a_router_loop_that_keeps_failing_fails_its_process(
    server: EmbeddedServer,
) -> None:
    """A dispatch round that cannot succeed (the backend's worker consumer is
    gone) is retried with backoff, then marks the process's supervisor failed:
    the process shuts down and ``run_until_signalled`` raises, so ``renqueue
    router`` exits non-zero. The request it held is left in its queue."""
    async with MockBackend(MockSettings(ttft=0.0, output_tokens=2)) as mock:
        config = make_config(user_url(server, "svc"), mock)
        services = Services(config, backends=[], projector=False)
        # Give up quickly (the default is 20 failures in a row, minutes apart).
        services.supervisor = Supervisor("test", give_up_after=3, max_backoff=0.05)
        running = asyncio.create_task(run_until_signalled(services))
        nc = await connect(user_url(server, "svc"), name="test-client")
        try:

            async def up() -> bool:
                return bool(services.routers) or running.done()

            await until(up, "the router runs")
            js = nc.jetstream()
            await js.delete_consumer(DISPATCH_STREAM, worker_consumer("b"))
            async with Client(nc, tenant=TENANT) as client:
                handle = await client.submit("q", route="chat")
                with pytest.raises(ServiceFailedError, match=r"dispatch.*NotFoundError"):
                    await asyncio.wait_for(running, 30)
                assert services.supervisor.failed.is_set()
                # Nothing was lost or ended: the request waits for a healthy router.
                assert (await js.stream_info(REQUESTS_STREAM)).state.messages == 1
                kinds = [kind_of(e) for e in await EventLog(js).history(TENANT, handle.id)]
                assert kinds == ["submitted"]
        finally:
            if not running.done():
                running.cancel()
            await nc.close()


async def test_graceful_router_restarts_do_not_use_up_a_waiting_requests_deliveries(
    server: EmbeddedServer,
) -> None:
    """Issue #6 item 4, for routers: every graceful stop hands what the router
    holds to the next binder (which re-creates the router consumers, so each
    restart is a fresh delivery). More restarts than ``router.max_deliver``
    while a request waits for room must not fail it (nor strand it at the
    consumer's ``max_deliver``): only failed dispatches count against it."""
    restarts = 4
    async with MockBackend(MockSettings(ttft=0.0, output_tokens=2)) as mock:
        config = make_config(user_url(server, "svc"), mock, max_deliver=2)
        assert restarts > config.router.max_deliver
        async with (
            Services(config, routers=0, backends=[]) as services,
            Client(services.nc, tenant=TENANT) as client,
        ):
            js = services.js

            async def deliveries() -> int:
                info = await js.consumer_info(REQUESTS_STREAM, router_consumer("normal"))
                return int(info.delivered.consumer_seq)

            # No worker yet: the blocker's dispatch takes the backend's slots
            # (concurrency 2) and sits unrun, so the next request waits, held.
            blockers = [await client.submit(f"blocker {n}", route="chat") for n in range(2)]
            waiting = await client.submit("waits for room", route="chat")
            seen = 0
            for n in range(restarts):
                router = Router(services.nc, js, config, name=f"router-{n}")
                await router.start()
                try:
                    # Each binder's consumer is new. The first router is
                    # delivered the blockers too.
                    async def delivered(expected: int = 3 if n == 0 else 1) -> bool:
                        return await deliveries() >= expected

                    await until(delivered, f"router {n} was delivered the waiting request")
                finally:
                    await router.close()  # graceful: hands it back with a nak
                seen += 1
            assert seen > config.router.max_deliver
            last = Router(services.nc, js, config, name="router-last")
            await last.start()
            try:
                async with Services(config, routers=0, backends=["b"], projector=False):
                    for handle in (*blockers, waiting):
                        await handle.result(timeout=20)
            finally:
                await last.close()
            kinds = [kind_of(e) for e in await EventLog(js).history(TENANT, waiting.id)]
    assert kinds.count("routed") == 1
    assert "failed" not in kinds


async def test_a_request_whose_dispatches_keep_failing_fails_after_router_max_deliver(
    server: EmbeddedServer,
) -> None:
    """What the budget does count: failed dispatches (here the dispatch stream
    takes no message as large as a dispatch, so every publish of the decision
    is refused). After
    ``router.max_deliver`` of them the request fails ``undeliverable``. (A
    dispatch refused because a store is full is no failed dispatch: the
    request waits for room, tests/test_bounds.py.)"""
    async with MockBackend(MockSettings(ttft=0.0, output_tokens=2)) as mock:
        config = make_config(user_url(server, "svc"), mock, max_deliver=2)
        async with (
            Services(config, backends=[]) as services,
            Client(services.nc, tenant=TENANT) as client,
        ):
            js = services.js
            info = await js.stream_info(DISPATCH_STREAM)
            await js.context.update_stream(dataclasses.replace(info.config, max_msg_size=16))
            doomed = await client.submit("finds every dispatch refused", route="chat")
            with pytest.raises(RequestFailedError) as failed:
                await doomed.result(timeout=30)
            kinds = [kind_of(e) for e in await EventLog(js).history(TENANT, doomed.id)]
            assert (await js.stream_info(DLQ_STREAM)).state.messages == 1
    assert failed.value.error_type == "undeliverable"
    # (`routed` is pipelined with the dispatch, so the log may show one.)
    assert kinds[0] == "submitted"
    assert kinds[-1] == "failed"
    assert kinds.count("failed") == 1
    assert "started" not in kinds


class RefusingSubmitted:
    """A router's JetStream context that refuses its first ``submitted``
    publishes the way nats-py does when a long reconnect has filled the
    connection's outbound buffer: the publish call itself raises. (A server
    that denies or drops the publish reports it only on the ack, which the
    dispatch awaits; this is what reaches the fetch loop.)"""

    def __init__(self, js: Any, refusals: int) -> None:
        self._js = js
        self.refusals = refusals

    async def publish_async(self, subject: str, payload: bytes = b"", **kwargs: Any) -> Any:
        if subject.endswith(".submitted") and self.refusals > 0:
            self.refusals -= 1
            raise NatsUnavailableError("nats: outbound buffer limit exceeded")
        return await self._js.publish_async(subject, payload, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._js, name)


async def test_a_fetch_loop_whose_submitted_publish_raises_is_logged_and_restarted(
    server: EmbeddedServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue #6 item 1, the fetch loop: publishing a request's `submitted`
    event raises (here three times); the loop is logged and started again,
    what it had fetched goes back to the queue, and every request still
    completes through this router, each logged once. The error is a
    transient broker fault: a warning naming it, without a traceback (issue #29).
    (The requests may coalesce, so their `submitted` is published when read; a
    request bound at once has it published with its binding, by its dispatch's
    task: tests/test_bound_at_once.py.)"""
    caplog.set_level(logging.WARNING, logger="renqueue")
    async with MockBackend(MockSettings(ttft=0.0, output_tokens=2)) as mock:
        config = make_config(user_url(server, "svc"), mock)
        async with (
            Services(config, routers=0) as services,
            Client(services.nc, tenant=TENANT) as client,
        ):
            refusing = RefusingSubmitted(services.js, refusals=3)
            router = Router(services.nc, refusing, config, name="flaky")
            await router.start()
            try:
                handles = [
                    await client.submit(f"q{n}", route="chat", request_id=f"f{n}", coalesce=True)
                    for n in range(4)
                ]
                results = await asyncio.gather(*(h.result(timeout=30) for h in handles))
            finally:
                await router.close()
            log = EventLog(services.js)
            kinds = [[kind_of(e) for e in await log.history(TENANT, h.id)] for h in handles]
    assert refusing.refusals == 0
    assert [r.backend for r in results] == ["b"] * 4
    assert router.routed == 4
    assert all(k.count("submitted") == 1 and k.count("completed") == 1 for k in kinds), kinds
    failed = [r for r in caplog.records if r.getMessage().startswith("background loop failed")]
    assert len(failed) == 3, [r.getMessage() for r in caplog.records]
    for record in failed:
        assert record.levelno == logging.WARNING
        fields = getattr(record, EVENT_ATTRIBUTE)
        assert fields["loop"] == "flaky-fetch-normal"
        assert record.exc_info is None
        assert fields["error"] == repr(NatsUnavailableError("nats: outbound buffer limit exceeded"))
