"""The client follows every token and every handle to its end (issue #6 items 6, 11),
and says so when the tokens are gone (past ``nats.tokens.max_age``).

Token chunks are published straight to ``RQ_TOKENS`` here, as workers do, so a
test can arrange exactly what the follower sees live and what only the store
has. A connection with ``no_echo`` does not receive its own publishes: chunks
published through it reach the store but not the follower's live
subscription on that connection, as a chunk lost to a reconnect would.
"""

from __future__ import annotations

import asyncio
import datetime
import gc
import logging
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import msgspec
import pytest
from _waits import until
from nats.js.api import ConsumerConfig, ConsumerInfo, SequenceInfo

from renqueue import Client, Services, TokensExpiredError, UnknownPriorityError, parse_config
from renqueue.broker import Connection, EmbeddedServer, EventLog, provision
from renqueue.broker._eventlog import _anything_to_deliver
from renqueue.client._tap import Waiter, _time_out
from renqueue.client._tokens import TokenFollower
from renqueue.errors import NatsError, NatsTimeoutError
from renqueue.mock import MockBackend, MockSettings
from renqueue.schema import (
    EVENTS_STREAM,
    Cancelled,
    Completed,
    Event,
    TokenChunk,
    Usage,
    encode,
    event_subject,
    kind_of,
    token_subject,
)


@pytest.fixture
async def quiet_follower(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TokenFollower, "IDLE", 0.2, raising=False)


@pytest.fixture
async def streams(isolated_server: EmbeddedServer) -> AsyncIterator[tuple[Connection, Connection]]:
    """(a connection that does not hear itself, a normal one), streams provisioned."""
    deaf = Connection()
    await deaf.open(5, servers=isolated_server.url, no_echo=True)
    loud = Connection()
    await loud.open(5, servers=isolated_server.url)
    await provision(loud, parse_config({"routes": {}, "backends": {}}))
    try:
        yield deaf, loud
    finally:
        await deaf.close()
        await loud.close()


async def put(nc: Connection, request_id: str, **fields: object) -> None:
    chunk = TokenChunk(request_id=request_id, **fields)  # type: ignore[arg-type]
    await nc.jetstream().publish(token_subject("t", request_id), encode(chunk))


async def end(nc: Connection, event: Event) -> None:
    """Store ``event`` (terminal) in the log, as a service would."""
    subject = event_subject(event.tenant, event.request_id, kind_of(event))
    await nc.jetstream().publish(subject, encode(event))


async def texts(handle: object) -> list[tuple[int, int, str]]:
    return [
        (chunk.delivery, chunk.seq, chunk.text)
        async for chunk in handle.stream(timeout=5)  # type: ignore[attr-defined]
    ]


@pytest.mark.usefixtures("quiet_follower")
async def test_a_stream_ends_when_its_final_chunk_is_only_in_the_store(
    streams: tuple[Connection, Connection],
) -> None:
    deaf, loud = streams
    async with Client(deaf, tenant="t") as client:
        handle = client.handle("lost-final")
        stream = handle.stream(timeout=5)
        await put(loud, "lost-final", delivery=1, seq=0, text="a")
        first = await anext(stream)
        # The final chunk reaches the store, never the live subscription.
        await put(deaf, "lost-final", delivery=1, seq=1, final=True)
        rest = [chunk async for chunk in stream]
    assert (first.seq, first.text) == (0, "a")
    assert rest == []


@pytest.mark.usefixtures("quiet_follower")
async def test_a_gap_is_filled_from_the_store_and_a_zombie_run_is_dropped(
    streams: tuple[Connection, Connection],
) -> None:
    deaf, loud = streams
    async with Client(deaf, tenant="t") as client:
        handle = client.handle("gappy")
        stream = handle.stream(timeout=5)
        await put(loud, "gappy", delivery=1, seq=0, text="a")
        assert (await anext(stream)).text == "a"
        await put(deaf, "gappy", delivery=1, seq=1, text="b")  # missed live
        await put(loud, "gappy", delivery=1, seq=2, text="c")
        # A second run begins; a late chunk of the first (a zombie worker) is void.
        await put(loud, "gappy", delivery=2, seq=0, text="A", restart=True)
        await put(loud, "gappy", delivery=1, seq=3, text="zombie")
        await put(loud, "gappy", delivery=2, seq=1, text="B")
        await put(loud, "gappy", delivery=2, seq=2, final=True)
        rest = [(c.delivery, c.seq, c.text) async for c in stream]
    assert rest == [(1, 1, "b"), (1, 2, "c"), (2, 0, "A"), (2, 1, "B")]


@pytest.mark.usefixtures("quiet_follower")
async def test_a_final_chunk_without_its_position_still_ends_the_stream(
    streams: tuple[Connection, Connection],
) -> None:
    """Final chunks written before they carried their run's next seq (seq 0)."""
    deaf, loud = streams
    async with Client(deaf, tenant="t") as client:
        for seq, text in enumerate("xy"):
            await put(loud, "old-final", delivery=1, seq=seq, text=text)
        await put(loud, "old-final", delivery=3, seq=0, final=True)
        assert await texts(client.handle("old-final")) == [(1, 0, "x"), (1, 1, "y")]


@pytest.mark.usefixtures("quiet_follower")
async def test_a_stream_whose_tokens_aged_out_of_the_store_ends_with_tokens_expired(
    streams: tuple[Connection, Connection],
) -> None:
    """RQ_TOKENS keeps chunks 1 h; the log keeps the outcome 30 d. A stream of
    an ended request whose chunks are gone (all, or its first ones) raises
    instead of waiting forever."""
    _deaf, loud = streams
    usage = Usage(prompt_tokens=1, completion_tokens=2)
    await end(
        loud,
        Completed(
            request_id="all-gone",
            tenant="t",
            at=1.0,
            backend="b",
            attempt=1,
            delivery=1,
            text="xy",
            usage=usage,
            cost=0.0,
        ),
    )
    # Its first chunk aged out, its last one and the final chunk are left.
    await put(loud, "half-gone", delivery=1, seq=1, text="y")
    await put(loud, "half-gone", delivery=1, seq=2, final=True)
    await end(loud, Cancelled(request_id="half-gone", tenant="t", at=1.0, stage="running"))
    async with Client(loud, tenant="t") as client:
        with pytest.raises(TokensExpiredError) as gone:
            await texts(client.handle("all-gone"))
        assert (gone.value.request_id, gone.value.outcome) == ("all-gone", "completed")
        assert "result()" in str(gone.value)
        with pytest.raises(TokensExpiredError) as half:
            await texts(client.handle("half-gone"))
        assert half.value.outcome == "cancelled"
        # The outcome is still there.
        assert (await client.handle("all-gone").result(timeout=5)).text == "xy"


async def test_a_resubmit_while_the_first_handle_waits_resolves_both(tmp_path: Path) -> None:
    async with MockBackend(MockSettings(ttft=0.0, tokens_per_second=50, output_tokens=10)) as mock:
        config = parse_config(
            {
                "nats": {"data_dir": str(tmp_path / "nats"), "port": -1},
                "backends": {"b": {"base_url": mock.url, "model": "m"}},
                "routes": {"chat": {"backends": ["b"]}},
            }
        )
        async with Services(config) as services, Client(services.nc, tenant="t") as client:
            first = await client.submit("once", route="chat", request_id="twice")
            second = await client.submit("once", route="chat", request_id="twice")
            assert second.duplicate
            one = await first.result(timeout=10)
            two = await second.result(timeout=10)
    assert one.text == two.text
    assert mock.stats().requests == 1


async def test_a_handle_on_a_request_submitted_elsewhere_waits_on_the_tap_not_a_poll(
    tmp_path: Path,
) -> None:
    """The gateway joins requests other processes made (idempotency keys, SDK
    retries): ``client.handle(id).result()`` follows them through the
    client's event tap, so the result comes when the request ends rather
    than at the next poll; a handle on a request that has ended reads it from
    the log."""
    async with MockBackend(MockSettings(ttft=0.0, tokens_per_second=20, output_tokens=10)) as mock:
        config = parse_config(
            {
                "nats": {"data_dir": str(tmp_path / "nats"), "port": -1},
                "backends": {"b": {"base_url": mock.url, "model": "m"}},
                "routes": {"chat": {"backends": ["b"]}},
            }
        )
        async with (
            Services(config) as services,
            Client(services.nc, tenant="t") as elsewhere,
            Client(services.nc, tenant="t") as joining,
        ):
            submitted = await elsewhere.submit("slow", route="chat")
            waiting = asyncio.create_task(joining.handle(submitted.id).result(timeout=15))

            async def on_the_tap() -> bool:
                return submitted.id in joining._tap._waiters

            await until(on_the_tap, "the joining handle waits on its client's tap")
            joined = await waiting
            ended = await joining.handle(submitted.id).result(timeout=15)
            assert not joining._tap._waiters  # nothing held once the results are in
            original = await submitted.result(timeout=15)
    assert joined.text == ended.text == original.text


async def test_a_reader_that_stops_reading_holds_a_bounded_queue_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream whose reader stops (a slow HTTP client behind the gateway)
    keeps at most its bound of live chunks; the rest come from the store when
    it reads on, in order, none lost."""
    monkeypatch.setattr("renqueue.client._tokens.LIVE_CHUNKS", 64)
    async with MockBackend(
        MockSettings(ttft=0.0, tokens_per_second=20_000, output_tokens=600)
    ) as mock:
        config = parse_config(
            {
                "nats": {"data_dir": str(tmp_path / "nats"), "port": -1},
                "backends": {"b": {"base_url": mock.url, "model": "m"}},
                "routes": {"chat": {"backends": ["b"]}},
            }
        )
        async with Services(config) as services, Client(services.nc, tenant="t") as client:
            handle = await client.submit("long", route="chat")
            follower = TokenFollower(client, "t", handle.id)
            await follower.start()
            result = await handle.result(timeout=20)  # ended while nobody read
            held = follower._live.qsize()
            texts = []
            while True:
                chunk = await follower.next()
                texts.append(chunk.text)  # the final chunk's too (the last read's)
                if chunk.final:
                    break
            await follower.close()
    assert held <= 64
    assert "".join(texts) == result.text


async def test_a_submit_to_an_unconfigured_level_fails_clearly_after_its_grace(
    streams: tuple[Connection, Connection],
) -> None:
    _deaf, loud = streams
    async with Client(loud, tenant="t") as client:
        client.no_stream_grace = 0.3
        with pytest.raises(UnknownPriorityError, match="urgent"):
            await client.submit("hi", route="chat", priority="urgent")
        # A configured level is stored at once.
        assert not (await client.submit("hi", route="chat", priority="normal")).duplicate


class GatedPublish:
    """A client's JetStream context whose first publish of a request waits at a
    gate, then fails (a publish stuck in a reconnect that times out) or goes
    through: so a resubmit of the same id can run while it is in flight."""

    def __init__(self, js: object, *, fail: bool) -> None:
        self._js = js
        self._fail = fail
        self._first = True
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def publish(self, subject: str, payload: bytes = b"", **kwargs: object) -> object:
        if self._first and subject.startswith("rq.req."):
            self._first = False
            self.entered.set()
            await self.release.wait()
            if self._fail:
                raise NatsTimeoutError("nats: timeout")
        return await self._js.publish(subject, payload, **kwargs)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._js, name)


@pytest.mark.parametrize("first", ["raises", "is a duplicate"])
async def test_a_resubmit_sharing_a_waiter_resolves_whatever_the_first_publish_does(
    tmp_path: Path, first: str
) -> None:
    """Issue #6 item 11, as the chaos cluster run left it: a resubmit while the
    first submit of the id is still publishing shares its waiter; that first
    publish then raised (or was acked as a duplicate) and dropped the waiter,
    and the resubmit's handle never resolved."""
    async with MockBackend(MockSettings(ttft=0.0, tokens_per_second=0, output_tokens=4)) as mock:
        config = parse_config(
            {
                "nats": {"data_dir": str(tmp_path / "nats"), "port": -1},
                "backends": {"b": {"base_url": mock.url, "model": "m"}},
                "routes": {"chat": {"backends": ["b"]}},
            }
        )
        async with Services(config) as services, Client(services.nc, tenant="t") as client:
            if first == "is a duplicate":
                # Stored and ended before this client followed events.
                async with Client(services.nc, tenant="t") as other:
                    done = await other.submit("once", route="chat", request_id="again")
                    await done.result(timeout=10)
            gate = GatedPublish(client.js, fail=first == "raises")
            client.js = gate
            # A publish that times out is published again while the request's
            # time allows (issue #29); here none is left: the submit raises.
            client.submit_patience = 0.0
            original = asyncio.create_task(client.submit("once", route="chat", request_id="again"))
            await gate.entered.wait()
            resubmit = await client.submit("once", route="chat", request_id="again")
            gate.release.set()
            if first == "raises":
                with pytest.raises(NatsTimeoutError):
                    await original
            else:
                assert (await (await original).result(timeout=10)).text
            assert (await resubmit.result(timeout=10)).text
    assert mock.stats().requests == 1


async def test_a_tap_sweep_that_fails_is_retried_until_it_resolves_what_the_tap_missed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue #6 item 11: the tap missed a terminal event (its consumer gone
    meanwhile, as after a server restart); the sweep of the log that follows
    the re-created tap failed once (a direct get timing out while a node is
    down) and was never tried again, because the new tap's heartbeats said all
    was well: the handle never resolved."""
    real = EventLog.terminal_of
    failures: list[str] = []
    armed = asyncio.Event()

    async def flaky(self: EventLog, tenant: str, request_id: str) -> Event | None:
        if armed.is_set() and not failures:
            failures.append(request_id)
            raise NatsTimeoutError("nats: timeout")
        return await real(self, tenant, request_id)

    monkeypatch.setattr(EventLog, "terminal_of", flaky)
    async with MockBackend(MockSettings(ttft=0.0, tokens_per_second=0, output_tokens=4)) as mock:
        config = parse_config(
            {
                "nats": {"data_dir": str(tmp_path / "nats"), "port": -1},
                "backends": {"b": {"base_url": mock.url, "model": "m"}},
                "routes": {"chat": {"backends": ["b"]}},
            }
        )
        async with Services(config, backends=[]) as services:
            client = Client(services.nc, tenant="t")
            client.tap_heartbeat = 30.0  # no silence is noticed until the end is logged
            async with client:
                handle = await client.submit("missed", route="chat")
                # The tap goes away (a server restart loses in-memory consumers).
                for info in await services.js.context.consumers_info(EVENTS_STREAM):
                    if info.name.startswith("rq-tap-t-"):
                        await services.js.delete_consumer(EVENTS_STREAM, info.name)
                workers = msgspec.structs.replace(
                    config, nats=msgspec.structs.replace(config.nats, url=services.url)
                )
                async with Services(workers, routers=0, backends=["b"], projector=False):
                    log = EventLog(services.js)
                    for _ in range(500):
                        if await real(log, "t", handle.id) is not None:
                            break
                        await asyncio.sleep(0.02)  # poll interval, not a synchronisation
                    else:
                        pytest.fail("the request never ended")
                    # The client notices the silence now: it re-creates the tap
                    # and sweeps the log, whose first read fails.
                    armed.set()
                    client.tap_heartbeat = 0.2
                    assert (await handle.result(timeout=15)).text
    assert failures == [handle.id]


@pytest.mark.usefixtures("quiet_follower")
async def test_a_stream_rides_out_a_server_restart_and_ends_from_the_store(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue #6 item 6: a stream waiting for its next chunk while the server
    restarts. Its re-reads of the store fail while the server is away (a
    chaos run's follower raised ``TimeoutError: nats: timeout`` out of
    ``stream()``); they must be retried, and once the server is back the
    final chunk, stored while no live copy reached the follower, ends it."""
    store = tmp_path / "nats"
    server = EmbeddedServer(store, port=-1)
    await server.start()
    port = server.port
    options = {"max_reconnect_attempts": -1, "reconnect_time_wait": 0.1}
    deaf, loud = Connection(), Connection()
    try:
        await deaf.open(5, servers=server.url, no_echo=True, **options)
        await loud.open(5, servers=server.url, **options)
        await provision(loud, parse_config({"routes": {}, "backends": {}}))
        async with Client(deaf, tenant="t") as client:
            client.js = deaf.jetstream(timeout=0.5)  # reads fail fast while it is away
            stream = client.handle("restart").stream(timeout=60)
            await put(loud, "restart", delivery=1, seq=0, text="a")
            assert (await anext(stream)).text == "a"
            rest = asyncio.create_task(anext(stream, None))
            caplog.set_level(logging.WARNING, logger="renqueue.client")
            await server.close()  # the store is kept on disk
            for _ in range(1500):
                if rest.done() or any("stored tokens failed" in r.message for r in caplog.records):
                    break
                await asyncio.sleep(0.02)  # poll interval, not a synchronisation
            assert not rest.done(), rest.exception()  # a failed read did not end the stream
            server = EmbeddedServer(store, port=port)
            await server.start()
            for _ in range(1500):
                if deaf.is_connected and loud.is_connected:
                    break
                await asyncio.sleep(0.02)  # poll interval, not a synchronisation
            # Stored, and through the follower's own connection: no live copy.
            await put(deaf, "restart", delivery=1, seq=1, final=True)
            assert await asyncio.wait_for(rest, 30) is None
    finally:
        await deaf.close()
        await loud.close()
        await server.close()


def test_a_replay_does_not_stop_on_a_create_response_that_counts_deliveries_out() -> None:
    """Issue 30: deliveries begin as soon as a push consumer exists, and a
    create response may count them out of ``num_pending``; its ``0`` alone was
    read as "nothing to wait for". Only nothing pending and nothing delivered
    says so (docs/wire-format.md, *Following tokens*)."""

    def created(pending: int, delivered: int) -> ConsumerInfo:
        return ConsumerInfo(
            name="c",
            stream_name="RQ_TOKENS",
            config=ConsumerConfig(),
            created=datetime.datetime.now(datetime.UTC),
            delivered=SequenceInfo(consumer_seq=delivered, stream_seq=40 + delivered),
            num_pending=pending,
        )

    assert _anything_to_deliver(created(pending=0, delivered=3))  # on their way already
    assert _anything_to_deliver(created(pending=2, delivered=0))
    assert not _anything_to_deliver(created(pending=0, delivered=0))  # aged out since the get


async def test_a_tap_whose_consumers_are_not_all_made_leaves_none_behind(
    streams: tuple[Connection, Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One of the tap's five consumers is refused (here: a consumer of another
    config already has its name): the call that needed the tap fails, and the
    four made with it are deleted rather than left to expire, unread; the
    other consumer, not the tap's, is left alone."""
    _, nc = streams
    js = nc.jetstream()
    fixed = uuid.UUID(int=0xABCDEF)
    monkeypatch.setattr(uuid, "uuid4", lambda: fixed)
    prefix = f"rq-tap-t-{fixed.hex[:16]}"
    await js.add_consumer(
        EVENTS_STREAM, name=f"{prefix}-failed", filter_subject="rq.evt.t.*.failed"
    )  # a pull consumer: not the tap's config
    client = Client(nc, tenant="t")
    with pytest.raises(NatsError):
        await client._tap.ensure()
    names = {info.name for info in await js.context.consumers_info(EVENTS_STREAM)}
    assert names == {f"{prefix}-failed"}, names
    await client.close()


async def test_a_result_that_timed_out_or_was_cancelled_leaves_the_handle_waiting(
    streams: tuple[Connection, Connection],
) -> None:
    """A result() that times out, or whose caller is cancelled, ends only
    that wait: the handle still gets the outcome, as does another wait on it;
    a wait left when the client closes is cancelled."""
    _, loud = streams
    async with Client(loud, tenant="t") as client:
        handle = await client.submit("hi", route="chat", request_id="waited", stream=False)
        with pytest.raises(TimeoutError):
            await handle.result(timeout=0.05)
        with pytest.raises(TimeoutError):
            await handle.result(timeout=0)
        cancelled = asyncio.create_task(handle.result())
        waiting = asyncio.create_task(handle.result(timeout=30))
        await until(_waits_on_tap(client, "waited", 2), "both results wait on the tap")
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert await _waits_on_tap(client, "waited", 1)()  # the other wait stays
        usage = Usage(prompt_tokens=1, completion_tokens=1)
        outcome = Completed(
            request_id="waited", tenant="t", at=1.0, backend="b", attempt=1, delivery=1,
            text="ok", usage=usage, cost=0.0,
        )  # fmt: skip
        await end(loud, outcome)
        assert (await waiting).text == "ok"
        assert (await handle.result(timeout=0)).text == "ok"
        left = await client.submit("hi", route="chat", request_id="left", stream=False)
        pending = asyncio.create_task(left.result())
        await until(_waits_on_tap(client, "left", 1), "the result waits on the tap")
    with pytest.raises(asyncio.CancelledError):
        await pending
    with pytest.raises(asyncio.CancelledError):
        await left.result()


def _waits_on_tap(client: Client, request_id: str, waits: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        waiter = client._tap._waiters.get(request_id)
        return waiter is not None and len(waiter._waiting) == waits

    return check


def _ended(request_id: str) -> Completed:
    usage = Usage(prompt_tokens=1, completion_tokens=1)
    return Completed(
        request_id=request_id, tenant="t", at=1.0, backend="b", attempt=1, delivery=1,
        text="ok", usage=usage, cost=0.0,
    )  # fmt: skip


async def test_an_end_that_comes_as_a_wait_times_out_is_returned_not_a_timeout() -> None:
    """The wait's deadline fires and the tap resolves the request in the same
    turn of the loop, before the waiting task runs again: the end is known,
    so the wait returns it rather than a :class:`TimeoutError`. (The wait is
    stepped by hand, so that turn is exactly what the loop would run.)"""
    waiter = Waiter()
    wait = waiter.wait(timeout=3600)
    pending = wait.send(None)  # the wait's own future, awaited
    assert isinstance(pending, asyncio.Future)
    _time_out(pending)  # its deadline fires...
    waiter.resolve(_ended("raced"))  # ...and the end comes, the same turn
    with pytest.raises(StopIteration) as stopped:
        wait.send(None)
    assert stopped.value.value.text == "ok"


async def test_a_wait_timed_out_and_cancelled_the_same_turn_leaves_no_unretrieved_error() -> None:
    """The deadline fires, then the waiting task is cancelled before it runs
    again: the wait ends cancelled, and nothing is left for the loop to report
    as "exception was never retrieved" (a spurious error log in a client)."""
    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: reported.append(context))
    try:
        waiter = Waiter()
        wait = waiter.wait(timeout=3600)
        pending = wait.send(None)
        _time_out(pending)
        with pytest.raises(asyncio.CancelledError):
            wait.throw(asyncio.CancelledError())
        del pending, wait
        gc.collect()
    finally:
        loop.set_exception_handler(previous)
    assert reported == []
    assert waiter.event is None
    assert not waiter._waiting


async def test_many_waits_that_time_out_or_are_cancelled_leave_nothing_on_the_waiter() -> None:
    """Thousands of result() calls on one handle, each with its own deadline,
    time out or are cancelled: none is left on the waiter (no growth), and a
    wait after them still gets the end."""
    waiter = Waiter()
    waits = [waiter.wait(timeout=3600) for _ in range(3000)]
    futures = [wait.send(None) for wait in waits]
    assert len(waiter._waiting) == 3000
    for n, (wait, future) in enumerate(zip(waits, futures, strict=True)):
        if n % 2:
            _time_out(future)
            with pytest.raises(TimeoutError):
                wait.send(None)
        else:
            with pytest.raises(asyncio.CancelledError):
                wait.throw(asyncio.CancelledError())
    assert not waiter._waiting
    last = asyncio.create_task(waiter.wait(timeout=3600))
    await until(lambda: _has_waits(waiter, 1), "the last wait waits")
    waiter.resolve(_ended("many"))
    assert (await last).text == "ok"
    assert not waiter._waiting


async def _has_waits(waiter: Waiter, waits: int) -> bool:
    return len(waiter._waiting) == waits


async def test_a_timeout_that_is_not_a_number_ends_the_wait_at_once() -> None:
    """``result(timeout=nan)`` is no deadline the loop can keep (a NaN in its
    timer heap misorders every other timer of the loop): it times out at once,
    with no timer, as a timeout of 0 does."""
    waiter = Waiter()
    for timeout in (math.nan, 0, -1.0):
        wait = waiter.wait(timeout=timeout)
        with pytest.raises(TimeoutError):
            wait.send(None)  # ended at its first step: nothing awaited
    assert not waiter._waiting


async def test_a_nan_timeout_of_a_handle_not_from_a_submit_puts_no_nan_in_the_loop(
    streams: tuple[Connection, Connection],
) -> None:
    """``result()`` of a handle made by ``Client.handle`` and ``stream()`` wait with
    ``asyncio.wait_for``: a NaN timeout became a NaN timer in the loop's heap, which
    misorders every other timer of the loop. It times out at once, as ``Waiter``'s does."""
    _, loud = streams
    loop = asyncio.get_running_loop()

    def nan_timers() -> list[asyncio.TimerHandle]:
        return [h for h in loop._scheduled if math.isnan(h.when())]  # type: ignore[attr-defined]

    async with Client(loud, tenant="t") as client:
        for wait in (
            client.handle("ghost").result(timeout=math.nan),
            anext(client.handle("ghost").stream(timeout=math.nan)),
        ):
            task = asyncio.create_task(wait)
            await asyncio.sleep(0)  # one step of the task: its wait_for has begun
            assert nan_timers() == []
            with pytest.raises(TimeoutError):
                await task
    assert nan_timers() == []


async def test_follows_that_time_out_leave_no_waiter_on_the_tap(
    streams: tuple[Connection, Connection],
) -> None:
    """A handle not made by a submit follows its request through the tap:
    hundreds of its result() calls at once, each timing out, leave nothing
    held on the tap, and a later one still gets the end."""
    _, loud = streams
    async with Client(loud, tenant="t") as client:
        handle = client.handle("ghost")
        waits = [handle.result(timeout=0.5) for _ in range(200)]
        outcomes = await asyncio.gather(*waits, return_exceptions=True)
        assert all(isinstance(outcome, TimeoutError) for outcome in outcomes)
        assert "ghost" not in client._tap._waiters
        last = asyncio.create_task(handle.result(timeout=30))
        await until(_waits_on_tap(client, "ghost", 1), "the last result waits on the tap")
        await end(loud, _ended("ghost"))
        assert (await last).text == "ok"
        assert "ghost" not in client._tap._waiters
