"""No input can stop the system (issue #29).

One request published with nats-py whose payload was just under the broker's
``max_payload`` was rejected by the router; its dead-letter copy, with the
headers the router adds, was over the limit, nats-server closed the services'
connection, nats-py did not reconnect, and ``renqueue up`` exited 50 s later,
and again after every restart on the same store (the message was never
acked). Here: requests of every size around the limits, through the router,
the worker and the dead-letter stream, each ended once, with the services
serving a good request after each, and again after a restart on the store.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _waits import until
from test_fallback import FAST
from test_restarts import TENANT
from test_wire_v2_hostile import config_of, nested, raw_request

from renqueue import Client, RequestFailedError, RequestRejectedError, Services
from renqueue.broker import Connection, EmbeddedServer, EventLog, JetStream, connect, provision
from renqueue.broker._dlq import DeadLetter, DeadLetterError, DeadLetterFilter, DeadLetters
from renqueue.broker._eventlog import DLQ_HOSTILE_EXCERPT
from renqueue.broker._nats import wire_size
from renqueue.config import Config
from renqueue.errors import NatsPayloadTooLargeError, ServiceFailedError
from renqueue.mock import MockBackend
from renqueue.schema import (
    REQUEST_DECODER,
    REQUEST_HEADROOM,
    InferenceRequest,
    Started,
    dispatch_subject,
    encode,
    is_terminal,
    kind_of,
    msg_id,
    request_subject,
)
from renqueue.schema._messages import request_limit
from renqueue.services import run_until_signalled
from renqueue.services.router._placement import Placement

#: The bytes the hostile request's ``Nats-Msg-Id`` header takes.
HEADER = wire_size(b"", {"Nats-Msg-Id": msg_id(TENANT, "too-big")})


def hostile(request_id: str, size: int) -> bytes:
    """A request payload of exactly ``size`` bytes: long user messages, each
    under ``MAX_TEXT`` (the bulk in ``params.extra`` would be refused
    ``out_of_range`` past 64 KiB, whatever the size)."""

    def build(lengths: list[int]) -> bytes:
        turns = b",".join(
            b'{"role":"user","content":"' + b"x" * length + b'"}' for length in lengths
        )
        return (
            b'{"id":"' + request_id.encode() + b'","tenant":"' + TENANT.encode() + b'",'
            b'"route":"chat","messages":[' + turns + b"]}"
        )

    turns = max(1, -(-size // 900_000))
    room = size - len(build([0] * turns))
    lengths = [room // turns] * turns
    lengths[-1] += room - sum(lengths)
    data = build(lengths)
    assert len(data) == size
    return data


async def publish_around_the_client(nc: Connection, request_id: str, total: int) -> bytes:
    """Publish a request whose payload and ``Nats-Msg-Id`` header take ``total``
    bytes of the broker's ``max_payload``, as a hostile client with nats-py can."""
    headers = {"Nats-Msg-Id": msg_id(TENANT, request_id)}
    data = hostile(request_id, total - wire_size(b"", headers))
    assert wire_size(data, headers) == total
    await nc.jetstream().publish(request_subject("normal", TENANT), data, headers=headers)
    return data


async def run_in_background(config: Config) -> tuple[Services, asyncio.Task[None]]:
    """New services run as ``renqueue up`` runs them (until a signal, or until
    a loop cannot go on: the task then raises), once they run."""
    services = Services(config)
    running = asyncio.create_task(run_until_signalled(services))

    async def up() -> bool:
        return bool(services.routers) or running.done()

    await until(up, "the services run")
    return services, running


def trip_the_router(
    monkeypatch: pytest.MonkeyPatch, trips: Callable[[InferenceRequest], bool]
) -> asyncio.Event:
    """Make the router's tier estimate raise for each request ``trips`` picks:
    a bug a request triggers, standing in for any we do not know of yet.
    The event returned is set the first time it trips."""
    estimated = Placement._estimated
    tripped = asyncio.Event()

    def buggy(self: Placement, request: InferenceRequest) -> Any:
        if trips(request):
            tripped.set()
            raise RuntimeError("a bug this request triggers")
        return estimated(self, request)

    monkeypatch.setattr(Placement, "_estimated", buggy)
    return tripped


async def dead_letters(js: JetStream) -> list[DeadLetter]:
    return (await DeadLetters(js).find(DeadLetterFilter())).entries


async def terminals(client: Client, request_id: str) -> list[str]:
    return [kind_of(e) for e in await client.handle(request_id).events() if is_terminal(e)]


@pytest.mark.parametrize(
    "room",
    [
        pytest.param(0, id="max_payload exactly"),
        pytest.param(1, id="max_payload minus 1"),
        pytest.param(300, id="room for a whole dead letter"),
        pytest.param(REQUEST_HEADROOM - 1 - HEADER, id="request_limit plus 1"),
    ],
)
async def test_a_request_too_big_to_admit_is_rejected_and_its_dead_letter_fits(
    isolated_server: EmbeddedServer, room: int
) -> None:
    """Refused as too big, whatever its size up to the broker's own limit: one
    ``rejected`` event, a dead letter that fits (an excerpt with the
    original's size, digest and sequence: a request rejected for its own
    content is never kept whole), and the services serve on over the same
    connection."""
    async with MockBackend(FAST) as mock:
        config = config_of(mock.url, nats_url=isolated_server.url)
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            nc = services.nc
            assert nc is not None
            limit = nc.max_payload
            total = limit - room
            data = await publish_around_the_client(client.nc, "too-big", total)
            with pytest.raises(RequestRejectedError, match="largest message"):
                await client.handle("too-big").result(timeout=20)
            assert await terminals(client, "too-big") == ["rejected"]

            dlq = DeadLetters(client.js)
            [entry] = await dead_letters(client.js)
            assert entry.request_id == "too-big"
            assert wire_size(entry.payload, entry.headers) <= limit
            stored_seq = int(entry.headers.get("Rq-Original-Seq", "0"))
            # Rejected for its own content (malformed): an excerpt, whatever its size.
            assert entry.payload == data[:DLQ_HOSTILE_EXCERPT]
            assert entry.original_size == len(data)
            assert entry.headers["Rq-Original-Sha256"] == hashlib.sha256(data).hexdigest()
            assert stored_seq >= 1
            with pytest.raises(DeadLetterError, match="excerpt"):
                await dlq.requeue(entry)

            after = await client.submit("still served", route="chat")
            assert (await after.result(timeout=20)).text
            assert nc.is_connected
            assert services.supervisor.reason is None


async def test_a_request_at_the_limit_the_services_admit_runs_and_its_dead_letter_is_whole(
    isolated_server: EmbeddedServer,
) -> None:
    """The largest request admitted (``request_limit``, as the services encode
    it) goes through the router
    and the worker; the mock refuses a body that large (aiohttp's 1 MB), the
    worker fails it for good, and its dispatch's dead letter is the whole
    dispatch: a request the services admit always leaves room for their own."""
    async with MockBackend(FAST) as mock:
        config = config_of(mock.url, nats_url=isolated_server.url)
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            size = request_limit(client.nc.max_payload)
            # The largest the services admit, as they write it (defaults spelled out).
            grown = len(encode(REQUEST_DECODER.decode(hostile("largest", size)))) - size
            data = hostile("largest", size - grown)
            await client.js.publish(
                request_subject("normal", TENANT),
                data,
                headers={"Nats-Msg-Id": msg_id(TENANT, "largest")},
            )
            with pytest.raises(RequestFailedError):
                await client.handle("largest").result(timeout=30)
            assert await terminals(client, "largest") == ["failed"]
            [entry] = await dead_letters(client.js)
            assert entry.stage == "dispatch"
            assert entry.original_size is None
            assert entry.request().id == "largest"
            after = await client.submit("still served", route="chat")
            assert (await after.result(timeout=20)).text


async def test_a_message_over_max_payload_with_its_headers_is_refused_before_it_is_sent(
    isolated_nc: Connection,
) -> None:
    """nats-py checks the payload alone; the server counts the headers too and
    closes the connection that sends more. Ours refuses it first, typed, and
    the connection stays open."""
    limit = isolated_nc.max_payload
    js = isolated_nc.jetstream()
    headers = {"Nats-Msg-Id": "t:x"}
    payload = b"x" * (limit - wire_size(b"", headers) + 1)
    with pytest.raises(NatsPayloadTooLargeError, match="headers included"):
        await isolated_nc.publish("anything", payload, headers=headers)
    with pytest.raises(NatsPayloadTooLargeError):
        await js.publish("anything", payload, headers=headers)
    with pytest.raises(NatsPayloadTooLargeError):
        await js.publish_async("anything", payload, headers=headers)
    with pytest.raises(NatsPayloadTooLargeError):
        await isolated_nc.request("anything", payload, headers=headers)
    await isolated_nc.flush()
    assert isolated_nc.is_connected


async def test_an_empty_header_block_counts_towards_max_payload(isolated_nc: Connection) -> None:
    """``headers={}`` is not ``headers=None``: nats-py sends an HPUB with its
    header block (``NATS/1.0`` and two line ends, 12 bytes), which the server
    counts. A payload within 12 bytes of the limit was let through as if it
    had no headers, and the server closed the connection (no reconnect)."""
    assert wire_size(b"x", {}) == 1 + len(b"NATS/1.0\r\n\r\n")
    payload = b"x" * (isolated_nc.max_payload - 4)
    with pytest.raises(NatsPayloadTooLargeError):
        await isolated_nc.publish("anything", payload, headers={})
    await isolated_nc.flush()
    assert isolated_nc.is_connected


async def publish_every_past_crasher(nc: Connection) -> None:
    """One of each message that has ever stopped a loop of the services."""
    js = nc.jetstream()
    # Issue #29: a request at the broker's own limit (its dead letter was over it).
    await publish_around_the_client(nc, "poison", nc.max_payload)
    # Issue #11 review: JSON nested past the decoder's recursion limit (it
    # ended a level's fetch loop, for every tenant).
    await js.publish(
        request_subject("normal", TENANT),
        raw_request("deep", nested(5000)),
        headers={"Nats-Msg-Id": msg_id(TENANT, "deep")},
    )
    # Projection views: a backend name that cannot be a KV key (the fold loop
    # failed after every checkpoint until the process died).
    forged = Started(request_id="forged", tenant=TENANT, at=1.0, backend="", attempt=1,
                     delivery=1, worker="w")  # fmt: skip
    await EventLog(js).append(forged)
    # A dispatch that is not one (the worker's poison path).
    await js.publish(dispatch_subject("b"), b"\xff not a dispatch")


async def test_services_restarted_on_a_store_holding_every_past_crasher_come_up_and_serve(
    tmp_path: Path,
) -> None:
    """Every message that ever stopped a loop, stored while no service runs:
    the services started on that store end each, and serve; started again on
    the same store, they serve again."""
    store = tmp_path / "nats"
    async with MockBackend(FAST) as mock, EmbeddedServer(store, port=-1) as server:
        config = config_of(mock.url, nats_url=server.url)
        nc = await connect(server.url, name="hostile")
        try:
            await provision(nc, config)
            await publish_every_past_crasher(nc)
        finally:
            await nc.close()
        for run in ("first", "second"):
            async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
                for rejected in ("poison", "deep"):
                    with pytest.raises(RequestRejectedError):
                        await client.handle(rejected).result(timeout=20)
                    assert await terminals(client, rejected) == ["rejected"]
                good = await client.submit(f"served on the {run} start", route="chat")
                assert (await good.result(timeout=20)).text
                assert services.projector is not None
                async with asyncio.timeout(20):
                    await services.projector.sync()
                assert services.supervisor.reason is None
                stages = sorted(e.stage for e in await dead_letters(client.js))
                assert stages == ["dispatch", "requests", "requests"]


async def test_services_carry_on_when_the_server_closes_their_connection(
    isolated_server: EmbeddedServer,
) -> None:
    """nats-server closes a connection after a protocol error (here: a subject
    past its 4 KB control line) and nats-py does not reconnect after that. The
    services start again on a new connection, and serve."""
    async with MockBackend(FAST) as mock:
        config = config_of(mock.url, nats_url=isolated_server.url)
        client_nc = await connect(isolated_server.url, name="client")
        try:
            async with Services(config) as services, Client(client_nc, tenant=TENANT) as client:
                before = await client.submit("before", route="chat")
                assert (await before.result(timeout=20)).text
                closed = services.nc
                assert closed is not None
                await closed.publish("x" * 5000)  # -ERR 'Maximum Control Line Exceeded'

                async def restarted() -> bool:
                    return services.keeper is not None and services.keeper.renewals == 1

                await until(restarted, "the services run on a new connection")
                assert closed.is_closed
                assert services.nc is not closed
                assert services.nc is not None
                assert services.nc.is_connected
                after = await client.submit("after", route="chat")
                assert (await after.result(timeout=20)).text
                assert services.supervisor.reason is None
        finally:
            await client_nc.close()


async def test_a_request_the_router_fails_on_every_time_is_ended_and_its_level_serves_on(
    isolated_server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that triggers a bug in the router (here: its tier estimate
    raises for it, standing in for any bug we do not know of yet) used to end
    its level's fetch loop on every delivery, until the supervisor gave up and
    the process exited, and again after every restart. Now it is delivered
    again twice, then rejected as ``unprocessable`` with a dead letter, and
    the level serves on."""
    trip_the_router(monkeypatch, lambda request: request.id.startswith("bug"))
    async with MockBackend(FAST) as mock:
        config = config_of(mock.url, nats_url=isolated_server.url)
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            bug = await client.submit("trips the router", route="chat", request_id="bug-1")
            good = await client.submit("beside it", route="chat")
            assert (await good.result(timeout=20)).text
            with pytest.raises(RequestRejectedError, match=r"failed on it 3 times") as caught:
                await bug.result(timeout=30)
            assert caught.value.error_type == "unprocessable"
            assert await terminals(client, "bug-1") == ["rejected"]
            [entry] = await dead_letters(client.js)
            assert entry.request_id == "bug-1"
            assert entry.error_type == "unprocessable"
            assert entry.request().id == "bug-1"  # a whole copy: requeue it once fixed
            after = await client.submit("after it", route="chat")
            assert (await after.result(timeout=20)).text
            assert services.supervisor.reason is None


async def test_a_process_without_nats_past_its_patience_exits_saying_why(tmp_path: Path) -> None:
    """With no server to reach (nats-py reconnecting all the while) the
    services stay up for ``nats.patience``, then stop, saying so."""
    async with MockBackend(FAST) as mock:
        server = EmbeddedServer(tmp_path / "nats", port=-1)
        await server.start()
        try:
            config = config_of(mock.url, nats_url=server.url, patience="2s")
            _services, running = await run_in_background(config)
        finally:
            await server.close()
        with pytest.raises(ServiceFailedError, match=r"cannot reach NATS .* nats\.patience \(2s\)"):
            await asyncio.wait_for(running, 30)
