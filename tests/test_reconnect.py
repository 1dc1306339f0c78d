"""Given a URL, Ren-Queue uses that server and rides out its restarts."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import warnings
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from test_wire_v2_hostile import config_of

from renqueue import Client, Services, parse_config
from renqueue.broker import Connection, EmbeddedServer, connect, provision
from renqueue.errors import NatsTimeoutError, NatsUnavailableError
from renqueue.logs import EVENT_ATTRIBUTE
from renqueue.mock import MockBackend, MockSettings
from renqueue.schema import is_terminal, kind_of
from renqueue.services.worker._call import settle


async def test_services_reconnect_after_the_server_restarts(tmp_path: Path) -> None:
    store = tmp_path / "nats"
    server = EmbeddedServer(store, port=-1)
    await server.start()
    port = server.port
    async with MockBackend(MockSettings(output_tokens=4)) as mock:
        config = config_of(mock.url, nats_url=server.url)
        try:
            async with Services(config) as services, Client(services.nc, tenant="t") as client:
                before = await (await client.submit("one", route="chat")).result(timeout=10)

                await server.close()  # the broker goes away, store intact ...
                await asyncio.sleep(1.0)
                server = EmbeddedServer(store, port=port)
                await server.start()  # ... and comes back on the same address

                # The first publish may land while the client is still reconnecting.
                handle = None
                for _ in range(50):
                    try:
                        handle = await client.submit("two", route="chat", request_id="after-1")
                        break
                    except Exception:  # retry with the same id: submits are idempotent
                        await asyncio.sleep(0.2)
                assert handle is not None
                after = await handle.result(timeout=10)
        finally:
            await server.close()
    assert before.backend == after.backend == "b"
    assert msgspec.structs.asdict(after.usage)["completion_tokens"] == 4


class LogWatch(logging.Handler):
    """Records ``renqueue`` log lines and lets a test wait for one: the event
    that matters, not a sleep."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._changed = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self._changed.set()

    async def wait_for(self, message: str) -> logging.LogRecord:
        while True:
            found = [r for r in self.records if r.getMessage().startswith(message)]
            if found:
                return found[0]
            self._changed.clear()
            await self._changed.wait()


@pytest.fixture
def log_watch() -> Iterator[LogWatch]:
    watch = LogWatch()
    logger = logging.getLogger("renqueue")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(watch)
    try:
        yield watch
    finally:
        logger.removeHandler(watch)
        logger.setLevel(level)


def kill_9(server: EmbeddedServer) -> None:
    """``kill -9`` the server: no goodbye to its clients, nothing flushed."""
    assert server.pid is not None
    os.kill(server.pid, signal.SIGKILL)


async def test_a_run_whose_broker_is_killed_mid_stream_is_handed_back_at_once(
    tmp_path: Path, log_watch: LogWatch
) -> None:
    """Issue #29: a request streaming when nats-server was killed with
    ``kill -9`` waited 30 s for its chunks' acks before it ran again. The
    run now gives up waiting as soon as it sees the connection down: the
    server stays down here until the worker says so, then comes back on the
    same store, and the request completes once, its second run whole."""
    store = tmp_path / "nats"
    server = EmbeddedServer(store, port=-1)
    await server.start()
    port = server.port
    # 20 tokens over about 2 s: the run is still streaming when the server dies.
    async with MockBackend(MockSettings(output_tokens=20, tokens_per_second=10)) as mock:
        config = config_of(mock.url, nats_url=server.url)
        try:
            async with Services(config) as services, Client(services.nc, tenant="t") as client:
                handle = await client.submit("long", route="chat", request_id="killed-mid-run")
                chunks = handle.stream(timeout=10)
                first = await anext(chunks)
                await chunks.aclose()
                assert first.delivery == 1
                loop = asyncio.get_running_loop()
                kill_9(server)
                killed = loop.time()
                await server.close()  # reaps it; the store is as the kill left it

                # The run ends its wait for the lost acks once it sees the
                # connection down, not 30 s later (2 s of stream left, then at once).
                handed_back = await asyncio.wait_for(
                    log_watch.wait_for("the broker did not answer mid-run"), 15
                )
                stalled = loop.time() - killed
                error = getattr(handed_back, EVENT_ATTRIBUTE)["error"]
                assert "NatsUnavailableError" in error, error
                assert "connection to the broker is down" in error, error

                server = EmbeddedServer(store, port=port)
                await server.start()
                result = await handle.result(timeout=60)
                events = await handle.events()
        finally:
            await server.close()
    assert stalled < 15, stalled
    assert result.text == " ".join(f"tok{n}" for n in range(20))
    kinds = [kind_of(event) for event in events]
    assert kinds.count("completed") == 1, kinds
    assert sum(is_terminal(event) for event in events) == 1, kinds
    assert kinds.count("started") == 2, kinds  # the killed run, then the one that finished


async def stopped(pid: int) -> None:
    """Wait until every thread of ``pid`` is stopped: a SIGSTOP reaches a Go
    program's threads a moment after ``kill`` returns, and one still running
    may answer a publish sent meanwhile."""

    def states() -> set[str]:
        found = set()
        for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
            with contextlib.suppress(OSError):  # a thread that just ended
                found.add(stat.read_text().rpartition(")")[2].split()[0])
        return found

    while states() - {"T", "t"}:  # noqa: ASYNC110 - no event says a process stopped
        await asyncio.sleep(0.01)


async def test_a_runs_wait_for_its_acks_is_bounded_by_the_connection(
    isolated_server: EmbeddedServer, isolated_nc: Connection
) -> None:
    """The two ways a run's wait for its acks ends early (issue #29): a broker
    that keeps the connection but never answers (frozen here) is given
    ``within`` seconds; a connection that goes down is given up at once."""
    js = isolated_nc.jetstream()
    await js.context.add_stream(name="S", subjects=["s"])
    await settle([await js.publish_async("s", b"stored")], isolated_nc)  # answered: no error
    assert isolated_server.pid is not None
    pid = isolated_server.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        await stopped(pid)
        pending = [await js.publish_async("s", b"never acked")]
        with pytest.raises(NatsTimeoutError, match="1 of 1 publishes unacknowledged after"):
            await settle(pending, isolated_nc, within=0.5)
        assert pending[0].cancelled()  # given up: nats-py's pending slot is freed

        pending = [await js.publish_async("s", b"lost with the server")]
        waiting = asyncio.create_task(settle(pending, isolated_nc, within=600))
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(NatsUnavailableError, match="connection to the broker is down") as lost:
            await asyncio.wait_for(waiting, 15)  # not the 600 s it was given
        assert not isinstance(lost.value, NatsTimeoutError)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


async def test_a_submit_made_while_the_server_is_down_is_stored_once_when_it_is_back(
    tmp_path: Path, log_watch: LogWatch
) -> None:
    """Issue #29: a submit whose publish got no answer raised NatsTimeoutError
    after 5 s and every caller had to retry it. The client publishes again
    under the same id: the server is stopped, the submit begins, the server
    comes back on the same store once the client has had to retry, and the
    submit returns a handle on a request stored once, not a duplicate of
    someone else's, which completes."""
    store = tmp_path / "nats"
    server = EmbeddedServer(store, port=-1)
    await server.start()
    port = server.port
    async with MockBackend(MockSettings(output_tokens=4)) as mock:
        config = config_of(mock.url, nats_url=server.url)
        try:
            async with Services(config) as services, Client(services.nc, tenant="t") as client:
                await (await client.submit("warm", route="chat")).result(timeout=10)  # tap on
                await server.close()
                submitting = asyncio.create_task(
                    client.submit("while down", route="chat", request_id="in-the-outage")
                )
                retried = await asyncio.wait_for(
                    log_watch.wait_for("the broker did not answer a submit"), 15
                )
                assert not submitting.done()
                server = EmbeddedServer(store, port=port)
                await server.start()
                handle = await asyncio.wait_for(submitting, 30)
                result = await handle.result(timeout=30)
                events = await handle.events()
                # A resubmit by the caller is a duplicate, as ever.
                again = await client.submit("while down", route="chat", request_id="in-the-outage")
        finally:
            await server.close()
    fields = getattr(retried, EVENT_ATTRIBUTE)
    assert fields["request_id"] == "in-the-outage"
    assert "NatsTimeoutError" in fields["error"]
    # Stored once whatever number of tries reached the server. nats-py keeps
    # what is published while it reconnects and sends it once it has: the
    # first try is stored then, and the retry that finds it is no duplicate of
    # anybody's (it is said the retry found it).
    assert not handle.duplicate
    assert handle.found_on_retry
    assert again.duplicate
    assert not again.found_on_retry
    assert result.usage.completion_tokens == 4
    kinds = [kind_of(event) for event in events]
    assert kinds.count("submitted") == 1, kinds
    assert kinds.count("completed") == 1, kinds


@pytest.mark.parametrize("bound", ["deadline", "patience"])
async def test_a_submit_gives_up_at_its_deadline_or_the_clients_patience(
    tmp_path: Path, log_watch: LogWatch, bound: str
) -> None:
    """The retries of a publish nobody answers end with the request's
    deadline or the client's patience, whichever comes first: the last error
    is raised then, not sooner (the first try alone waits 5 s) and not later
    than a try past the bound. A deadline an hour on is retried for the
    patience only (past the broker's duplicate window a retry could store a
    second copy: the review of issue #29)."""
    server = EmbeddedServer(tmp_path / "nats", port=-1)
    await server.start()
    nc = await connect(server.url, name="test-deadline")
    try:
        config = parse_config(
            {
                "backends": {"b": {"base_url": "http://127.0.0.1:9/v1", "model": "m"}},
                "routes": {"chat": {"backends": ["b"]}},
            }
        )
        await provision(nc, config)
        client = Client(nc, tenant="t")
        # The bound that is not under test is out of the way.
        client.submit_patience = 8.0 if bound == "patience" else 600.0
        await client.submit("before", route="chat")  # stored: the client follows events
        await server.close()  # the connection stays open, reconnecting
        loop = asyncio.get_running_loop()
        began = loop.time()
        timeout = 8.0 if bound == "deadline" else 3600.0  # else submit_patience
        with pytest.raises(NatsTimeoutError):
            await client.submit("late", route="chat", timeout=timeout)
        took = loop.time() - began
    finally:
        await nc.close()
        await server.close()
    retries = [
        r for r in log_watch.records if r.getMessage().startswith("the broker did not answer")
    ]
    assert retries, "retried at least once after the first try's 5 s"
    assert 5.0 <= took < 8.0 + 5.0, took  # past the first try; bounded by the deadline


async def test_a_failed_reconnect_attempt_leaves_no_socket_open(tmp_path: Path) -> None:
    """While its server is down, a connection tries every URL it has; one node accepts
    the TCP connection but hangs up before its INFO (a node shutting down or starting,
    as through a whole-cluster restart). nats-py reuses its transport and overwrites
    the attempt's stream writer, leaving that socket open until garbage collection.
    Every failed attempt's socket must be closed when it fails."""
    hung_up = 0
    enough = asyncio.Event()

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal hung_up
        writer.close()
        await writer.wait_closed()
        hung_up += 1
        if hung_up >= 6:
            enough.set()

    fake = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    fake_url = f"nats://127.0.0.1:{fake.sockets[0].getsockname()[1]}"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            async with EmbeddedServer(tmp_path / "nats", port=-1) as server:
                nc = await connect(f"{server.url},{fake_url}", name="test", timeout=10)
            try:
                hung_up = 0
                enough.clear()
                await asyncio.wait_for(enough.wait(), 30)  # reconnect attempts, server down
            finally:
                await nc.close()
            gc.collect()
    finally:
        fake.close()
        await fake.wait_closed()
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert unclosed == []
