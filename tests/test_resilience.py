"""What the hostile review of issue #29's changes found, each pinned down.

A closed connection must be replaced without the replacement itself ending
the process; patience bounds every wait on NATS, connected or not; a request
that trips the router is ended only after failures of its own, and its
coalescing followers are not stranded; what the services write of a request
or an answer fits the broker, or the request is ended once, without paying a
backend again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from _waits import until
from test_gateway_sdk import MESSAGES, start
from test_poison import run_in_background, trip_the_router
from test_restarts import TENANT
from test_wire_v2_hostile import config_of

import renqueue.tasks as tasks
from renqueue import Client, RequestFailedError, RequestRejectedError, Services, parse_config
from renqueue.broker import (
    Connection,
    EmbeddedServer,
    EventLog,
    Message,
    _connection,
    connect,
    provision,
)
from renqueue.coordination import StateView
from renqueue.errors import NatsTimeoutError, ServiceFailedError
from renqueue.gateway import Gateway
from renqueue.mock import MockBackend, MockSettings
from renqueue.schema import (
    GenerationParams,
    Rejected,
    is_terminal,
    kind_of,
    msg_id,
    request_subject,
)
from renqueue.services.router._intake import Intake
from renqueue.tasks import Supervisor

FAST = MockSettings(ttft=0.01, output_tokens=3)

#: nats-server's own default max_payload (what an external server has unless told).
ONE_MB_CONFIG = """\
max_payload: 1MB
http: "127.0.0.1:-1"
jetstream { max_memory_store: 256MB }
"""


def one_mb_server(tmp_path: Path) -> EmbeddedServer:
    conf = tmp_path / "one-mb.conf"
    conf.write_text(ONE_MB_CONFIG)
    return EmbeddedServer(tmp_path / "nats", port=-1, config_file=conf)


def before_starting_again(
    monkeypatch: pytest.MonkeyPatch, then: Callable[[], Awaitable[object]]
) -> None:
    """Await ``then()`` before the services start their components the second
    time: on the new connection, after the server closed the first."""
    start_components = Services._start_components
    calls = 0

    async def start(self: Services) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            await then()
        await start_components(self)

    monkeypatch.setattr(Services, "_start_components", start)


async def terminals(client: Client, request_id: str) -> list[str]:
    return [kind_of(e) for e in await client.handle(request_id).events() if is_terminal(e)]


async def test_an_answer_over_max_payload_ends_once_after_one_backend_call(
    tmp_path: Path,
) -> None:
    """A small request whose answer (150k tokens, ~1.2 MB) makes its
    ``completed`` event over a 1 MB broker: the run counted as an internal
    failure, and the backend was called (and billed) five times."""
    settings = MockSettings(ttft=0.01, output_tokens=150_000)
    async with MockBackend(settings) as mock, one_mb_server(tmp_path) as server:
        config = config_of(mock.url, nats_url=server.url)
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            handle = await client.submit(
                "a long answer", route="chat", params=GenerationParams(max_tokens=150_000)
            )
            with pytest.raises(RequestFailedError, match="too big to record whole") as caught:
                await handle.result(timeout=60)
            assert caught.value.error_type == "answer_too_large"
            assert await terminals(client, handle.id) == ["failed"]
            assert mock.stats().requests == 1


async def test_a_loop_that_never_gets_an_answer_while_connected_gives_up_after_patience(
    isolated_server: EmbeddedServer,
) -> None:
    """The binder's lease bucket deleted under running services: every renewal
    gets no responders on a live connection. Broker faults are not counted
    toward giving up, but they are bounded by ``nats.patience``: the process
    says what it waited for, for its supervisor to restart (and provision) it."""
    async with MockBackend(FAST) as mock:
        config = config_of(mock.url, nats_url=isolated_server.url, patience="2s")
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            first = await client.submit("before", route="chat")
            assert (await first.result(timeout=20)).text
            await client.js.context.delete_stream("KV_rq-leases")
            await asyncio.wait_for(services.supervisor.failed.wait(), 30)
            assert services.supervisor.reason is not None
            assert "renew" in services.supervisor.reason
            assert "failed for" in services.supervisor.reason


async def test_one_failure_after_hand_backs_is_not_three_failures(
    isolated_server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The router counted a message's deliveries, not its failures: a request
    handed back twice (each a nak, each a delivery) that then failed once was
    rejected at once as failing 3 times."""
    take = Intake._take
    failed: list[int] = []

    async def flaky(
        self: Intake, msg: Message, level: str, rank: int, now: float, *args: Any, **kw: Any
    ) -> None:
        if b'"handed-back"' in msg.data:
            if msg.metadata.num_delivered < 3:
                await msg.nak(delay=0.1)  # a hand-back
                return
            if not failed:
                failed.append(1)
                raise RuntimeError("a one-off fault, on one delivery")
        await take(self, msg, level, rank, now, *args, **kw)

    monkeypatch.setattr(Intake, "_take", flaky)
    async with MockBackend(FAST) as mock:
        config = config_of(mock.url, nats_url=isolated_server.url)
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            handle = await client.submit("x", route="chat", request_id="handed-back")
            assert (await handle.result(timeout=30)).text
            assert failed == [1]


async def test_a_server_lost_while_the_services_start_again_still_exits_after_patience(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server closes the services' connection, and goes away before the
    components are started again on the new one: their starts wait for
    JetStream (``nats.startup_wait``, forever), so patience must bound the
    whole renewal, or the process neither serves nor exits."""
    server = EmbeddedServer(tmp_path / "nats", port=-1)
    await server.start()
    before_starting_again(monkeypatch, server.close)
    running: asyncio.Task[None] | None = None
    try:
        async with MockBackend(FAST) as mock:
            config = config_of(mock.url, nats_url=server.url, patience="2s")
            services, running = await run_in_background(config)
            assert services.nc is not None
            await services.nc.publish("x" * 5000)  # the server closes the connection
            with pytest.raises(ServiceFailedError, match="patience"):
                await asyncio.wait_for(asyncio.shield(running), 30)
    finally:
        if running is not None and not running.done():
            running.cancel()
            with contextlib.suppress(BaseException):
                await running
        await server.close()


async def test_loops_failing_on_the_closed_connection_while_workers_drain_do_not_end_the_process(
    isolated_server: EmbeddedServer,
) -> None:
    """The server closes the services' connection while a run waits for a slow
    first token: the renewal must not wait out ``worker.drain_timeout`` with
    every other loop failing on the closed connection (each failure once a
    counted fault, logged with a traceback, until the process gave up)."""
    async with MockBackend(MockSettings(ttft=30.0, output_tokens=3)) as mock:
        config = parse_config(
            {
                "nats": {"url": isolated_server.url},
                "worker": {"drain_timeout": "60s"},
                "backends": {"b": {"base_url": mock.url, "model": "m"}},
                "routes": {"chat": {"backends": ["b"]}},
            }
        )
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            await client.submit("slow", route="chat")

            async def running() -> bool:
                return mock.stats().in_flight == 1

            await until(running, "the run waits for its first token")
            assert services.nc is not None
            await services.nc.publish("x" * 5000)  # the server closes the connection

            async def renewed() -> bool:
                keeper = services.keeper
                return keeper is not None and keeper.renewals == 1

            await until(renewed, "restarted on a new connection", within=15)
            assert services.supervisor.reason is None


async def test_a_coalescing_leader_ended_as_unprocessable_does_not_strand_its_followers(
    isolated_server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leader joins its group before the router's bug trips on it; ended
    with ``rejected`` (no ``leader_ended``) its followers waited for a
    hand-out that never came: without a deadline, forever."""
    leader_taken = trip_the_router(monkeypatch, lambda request: request.id == "leader")
    async with MockBackend(FAST) as mock:
        config = config_of(mock.url, nats_url=isolated_server.url)
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            leader = await client.submit("same", route="chat", request_id="leader", coalesce=True)
            await asyncio.wait_for(leader_taken.wait(), 10)
            follower = await client.submit(
                "same", route="chat", request_id="follower", coalesce=True
            )
            with pytest.raises(RequestRejectedError, match="failed on it"):
                await leader.result(timeout=30)
            assert "coalesced" in [kind_of(e) for e in await follower.events()]
            with contextlib.suppress(RequestFailedError):  # any terminal outcome will do
                await follower.result(timeout=20)
            assert len(await terminals(client, "follower")) == 1


async def test_a_request_whose_reencoding_is_over_the_limit_is_refused_as_too_big(
    isolated_server: EmbeddedServer,
) -> None:
    """Admission measured the bytes published; the services publish the request
    re-encoded, and numbers re-encode longer (``9e15``: ``9000000000000000.0``).
    A 2.3 MB request made an 8.7 MB ``submitted`` event."""
    floats = b",".join([b"9e15"] * 470_000)
    raw = (
        b'{"id":"floats","tenant":"' + TENANT.encode() + b'","route":"chat",'
        b'"messages":[{"role":"user","content":"hi"}],"params":{"extra":{"x":[' + floats + b"]}}}"
    )
    async with MockBackend(FAST) as mock:
        config = config_of(mock.url, nats_url=isolated_server.url)
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            assert len(raw) < client.nc.max_payload - 64 * 1024
            await client.js.publish(
                request_subject("normal", TENANT),
                raw,
                headers={"Nats-Msg-Id": msg_id(TENANT, "floats")},
            )
            with pytest.raises(RequestRejectedError, match="as the services write it") as caught:
                await client.handle("floats").result(timeout=30)
            assert caught.value.error_type == "malformed"
            assert services.supervisor.reason is None


async def test_a_client_gone_while_the_gateway_moves_connections_is_cancelled_on_the_new_one(
    tmp_path: Path,
) -> None:
    """An SDK call waits on a slow model when the server closes the gateway's
    connection, then times out: the disconnect's cancellation was spawned on
    the tenant's client of the closed connection and failed on every try (the
    request never cancelled; once a counted fault, the process gave up)."""
    async with MockBackend(MockSettings(ttft=60.0, output_tokens=3)) as mock:
        async for stack in start(tmp_path, mock):
            call = asyncio.create_task(
                stack.sdk(timeout=3.0).chat.completions.create(model="chat", messages=MESSAGES)
            )

            async def waiting() -> bool:
                return mock.stats().in_flight == 1

            await until(waiting, "the call waits for its first token")
            await stack.gateway.js.connection.publish("x" * 5000)  # the server closes it
            with pytest.raises(openai.APIError):
                await call

            async def cancelled(gateway: Gateway = stack.gateway) -> bool:
                info = await gateway.js.context.stream_info(
                    "RQ_EVENTS", subjects_filter="rq.evt.acme.*.cancelled"
                )
                return bool(info.state.subjects) and not gateway.supervisor.jobs("cancel-")

            await until(cancelled, "the request is cancelled")
            keeper = stack.gateway.keeper
            assert keeper is not None
            assert keeper.renewals == 1
            assert stack.gateway.supervisor.reason is None


async def test_a_loop_that_works_between_passing_timeouts_is_not_given_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A loop on a slow but live broker works a while, then one call times out,
    and again: never down for long. Its streak of broker faults was reset only
    by a run of ``HEALTHY_AFTER`` (30 s), so runs of 25 s between timeouts
    made one streak, and after ``nats.patience`` the process was stopped
    (scaled down here: runs of 0.1 s, patience 0.3 s)."""
    monkeypatch.setattr(tasks, "PROGRESS_AFTER", 0.05)
    runs = 0
    enough = asyncio.Event()

    async def busy() -> None:
        nonlocal runs
        runs += 1
        if runs >= 10:  # a second of runs: three times the patience
            enough.set()
            return
        await asyncio.sleep(0.1)  # the loop's work: it routes, for a while
        raise NatsTimeoutError("nats: timeout")  # then one slow ack

    supervisor = Supervisor(
        "test", base_backoff=0.001, max_backoff=0.01, give_up_after=20, broker_patience=0.3
    )
    supervisor.spawn("dispatch", busy)
    try:
        await asyncio.wait_for(enough.wait(), 10)
        assert supervisor.reason is None
    finally:
        await supervisor.close()


async def test_an_outage_after_a_closed_connection_shorter_than_patience_is_ridden_out(
    isolated_server: EmbeddedServer, isolated_nc: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server closes the services' connection; the new one takes most of
    the patience to open (3 s of 4: an outage), and starting again on it
    takes a while (1.5 s: a projector catching up, say). NATS was never out
    of reach for longer than the patience, but the renewal had only what was
    left of it after connecting, and the process was stopped."""
    real_connect = _connection.connect

    async def connect_after_an_outage(url: str, **options: Any) -> Connection:
        await asyncio.sleep(3.0)  # the outage, as the keeper lives it
        return await real_connect(url, **options)

    monkeypatch.setattr(_connection, "connect", connect_after_an_outage)
    # A projector catching up, say.
    before_starting_again(monkeypatch, functools.partial(asyncio.sleep, 1.5))
    async with MockBackend(FAST) as mock:
        config = config_of(mock.url, nats_url=isolated_server.url, patience="4s")
        async with Services(config) as services, Client(isolated_nc, tenant=TENANT) as client:
            assert services.nc is not None
            await services.nc.publish("x" * 5000)  # the server closes the connection

            async def renewed() -> bool:
                keeper = services.keeper
                return (keeper is not None and keeper.renewals == 1) or bool(
                    services.supervisor.reason
                )

            await until(renewed, "the services run on a new connection")
            assert services.supervisor.reason is None
            served = await client.submit("after the outage", route="chat")
            assert (await served.result(timeout=20)).text


SMALL_CONFIG = """\
max_payload: 256KB
http: "127.0.0.1:-1"
jetstream { max_memory_store: 256MB }
"""


async def test_a_projection_grown_past_max_payload_keeps_its_views_up_and_stops_nothing(
    tmp_path: Path,
) -> None:
    """The checkpoint holds every tenant ever seen: 2,000 tenants' rejections
    on a 256 KB broker (~7,000 on a stock 1 MB one; without NATS auth anyone
    can make a tenant). Its write was refused, the fold loop failed on every
    try, and the process stopped, and again after every restart. Now the
    views are kept up, the checkpoint is tried again later, and requests are
    served. (Bounding the state itself is issue #30's.)"""
    conf = tmp_path / "small.conf"
    conf.write_text(SMALL_CONFIG)
    async with (
        MockBackend(FAST) as mock,
        EmbeddedServer(tmp_path / "nats", port=-1, config_file=conf) as server,
    ):
        config = config_of(mock.url, nats_url=server.url)
        nc = await connect(server.url, name="hostile")
        try:
            await provision(nc, config)
            log = EventLog(nc.jetstream())
            await asyncio.gather(
                *(
                    log.finish(
                        Rejected(
                            request_id="r",
                            tenant=f"t{index:05d}" + "x" * 94,
                            at=1.0,
                            error_type="malformed",
                            reason="junk",
                        )
                    )
                    for index in range(2000)
                )
            )
        finally:
            await nc.close()
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            projector = services.projector
            assert projector is not None

            async def refused() -> bool:
                return projector.oversized >= 1

            await until(refused, "the checkpoint write is refused as too big")
            good = await client.submit("served", route="chat")
            assert (await good.result(timeout=20)).text

            async def folded() -> bool:  # its events are in the views all the same
                view = await StateView.open(client.js)
                try:
                    return view.state.backends.get("b") is not None
                finally:
                    await view.close()

            await until(folded, "the views show the request's backend")
            assert services.supervisor.reason is None
