"""Closing a connection ends it in bounded time, whatever the server is doing:
gone, stopped (``SIGSTOP``), or hanging up on every reconnect attempt.

After :meth:`Connection.close` returns, the client is closed, none of
nats-py's tasks runs on (no reconnect attempt goes on), and its socket is
closed. Every close here is itself bounded by a generous ``asyncio.wait_for``,
so a close that hangs fails its test instead of hanging the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from _waits import until
from test_cluster_loss import cluster
from test_reconnect import stopped

from renqueue.broker import Connection, EmbeddedServer, Message, connect
from renqueue.broker import _nats as nats_boundary
from renqueue.config import NatsConfig
from renqueue.errors import NatsClosedError, NatsUnavailableError

#: Far more than a close takes; reached only by a close that hangs.
HANGS: float = 60.0


class Node:
    """A TCP front for a real nats-server on loopback: while up it forwards each
    connection to the server; while down it hangs up on each as it comes (a
    node shutting down or starting, as through a whole-cluster restart)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.up = True
        self.hung_up = asyncio.Event()
        self.listening = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._pipes: set[asyncio.Task[None]] = set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.up:
            writer.close()
            self.hung_up.set()
            return
        upstream_reader, upstream = await asyncio.open_connection("127.0.0.1", self.port)
        self._writers |= {writer, upstream}
        for source, sink in ((reader, upstream), (upstream_reader, writer)):
            pipe = asyncio.create_task(self._pipe(source, sink))
            self._pipes.add(pipe)
            pipe.add_done_callback(self._pipes.discard)

    @staticmethod
    async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
        sink.close()

    def go_down(self) -> None:
        """Drop every forwarded connection at once; hang up on every new one."""
        self.up = False
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()


@contextlib.asynccontextmanager
async def node_for(nats_url: str) -> AsyncIterator[tuple[Node, str]]:
    node = Node(int(nats_url.rsplit(":", 1)[1]))
    server = await asyncio.start_server(node._accept, "127.0.0.1", 0)
    node.listening = server.sockets[0].getsockname()[1]
    try:
        yield node, f"nats://127.0.0.1:{node.listening}"
    finally:
        node.go_down()
        server.close()
        await server.wait_closed()
        for pipe in list(node._pipes):
            pipe.cancel()
        await asyncio.gather(*node._pipes, return_exceptions=True)


def sockets_to(port: int) -> set[str]:
    """This process's open TCP sockets to 127.0.0.1:``port`` (their inodes):
    a socket nobody closed is open until the garbage collector finds it, then a
    ``ResourceWarning`` in whichever test runs at that moment."""
    peer = f"0100007F:{port:04X}"
    inodes = set()
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            if fields[2] == peer and fields[3] != "0A":  # not a listener
                inodes.add(fields[9])
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                mine.add(link[len("socket:[") : -1])
    return inodes & mine


def nothing_left(nc: Connection) -> None:
    """Assert the client is closed, none of its tasks runs, its socket is closed."""
    client = nc.client
    assert nc.is_closed
    tasks = [
        client._reconnection_task,
        client._reading_task,
        client._ping_interval_task,
        client._flusher_task,
    ]
    assert [task for task in tasks if task is not None and not task.done()] == []
    writer = client._transport._io_writer
    assert writer.transport.is_closing()
    socket = writer.get_extra_info("socket")
    assert socket is None or socket.fileno() == -1, socket


@pytest.mark.parametrize("turns", range(8))
async def test_a_close_while_reconnecting_to_a_node_that_hangs_up_stops_reconnecting(
    nats_url: str, turns: int
) -> None:
    """nats-py's close cancelled its reconnecting task once; an attempt that
    ended (the node hung up) as the cancellation came swallowed it (Python
    3.11's ``asyncio.wait_for``), and the task went on reconnecting after the
    close, for good: the event loop's shutdown then waited for it, for good.
    The close comes a few turns of the event loop after a hang-up, so that
    one of them lands as an attempt ends."""
    async with node_for(nats_url) as (node, url):
        nc = await connect(url, name="test-close-hang-up", timeout=10)
        node.go_down()
        await asyncio.wait_for(node.hung_up.wait(), HANGS)  # it is reconnecting

        async def close_after_turns() -> None:
            for _ in range(turns):
                await asyncio.sleep(0)
            await nc.close()

        await asyncio.wait_for(close_after_turns(), HANGS)
        # No attempt's socket left open (test_exactly_once failed under load with
        # an unclosed transport: the socket of an attempt a close had raced, at
        # test_reconnect's hang-up node, found by the garbage collector later).
        assert sockets_to(node.listening) == set()
        nothing_left(nc)


@contextlib.asynccontextmanager
async def frozen(server: EmbeddedServer) -> AsyncIterator[None]:
    """The server stopped (``SIGSTOP``) for the block: its sockets take nothing."""
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    try:
        await stopped(server.pid)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.pid, signal.SIGCONT)


async def fill(nc: Connection, until: Callable[[], bool]) -> None:
    """Publish 10 KB messages until ``until()`` (or nats-py refuses more)."""
    with contextlib.suppress(Exception):
        while not until():
            await asyncio.wait_for(nc.publish("test.close.fill", b"x" * 10_000), 5)


async def test_a_close_while_connected_to_a_stopped_server_with_a_full_socket_returns(
    isolated_server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nats-py's close flushed what was left to send to a server that takes
    nothing, and waited for it for good. It is given ``CLOSE_WAIT``, then the
    socket is let go."""
    monkeypatch.setattr(nats_boundary, "CLOSE_WAIT", 0.5)
    nc = await connect(isolated_server.url, name="test-close-frozen")
    async with frozen(isolated_server):
        client = nc.client
        # Past the socket's buffers: what nats-py holds waits for a flush that cannot end.
        await fill(nc, lambda: client._pending_data_size > 0 or not nc.is_connected)
        assert nc.is_connected  # long before the pings say the server is gone
        await asyncio.wait_for(nc.close(), HANGS)
        nothing_left(nc)


async def test_a_close_while_reconnecting_with_publishes_held_returns(
    isolated_server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reconnecting, nats-py's close wrote what was published meanwhile into
    the last attempt's socket and waited to flush it: for good to a stopped
    server (here the old socket, full, still closing), or it raised
    ``ConnectionResetError`` (a socket already closed) and skipped the rest of
    its close. What is held while reconnecting is dropped: no server gets it."""
    monkeypatch.setattr(nats_boundary, "CLOSE_WAIT", 0.5)
    # Pings every 0.2 s: nats-py gives the stopped server up after three unanswered.
    config = NatsConfig(ping_interval="200ms")
    nc = await connect(isolated_server.url, name="test-close-frozen-reconnecting", config=config)
    async with frozen(isolated_server):
        client = nc.client
        # Until nats-py's flush times out and it reconnects, holding what is published.
        await fill(nc, lambda: not nc.is_connected)
        assert client.is_reconnecting
        await asyncio.wait_for(nc.close(), HANGS)
        nothing_left(nc)


async def test_a_close_while_the_server_is_gone_with_publishes_held_returns(
    isolated_server: EmbeddedServer,
) -> None:
    nc = await connect(isolated_server.url, name="test-close-gone")
    await isolated_server.close()

    async def reconnecting() -> bool:
        return nc.client.is_reconnecting

    await until(reconnecting, "the connection reconnecting", within=HANGS)
    await nc.publish("test.close.held", b"held while reconnecting")
    assert nc.client._pending_data_size > 0
    await asyncio.wait_for(nc.close(), HANGS)  # no ConnectionResetError
    nothing_left(nc)


async def test_a_drain_while_reconnecting_is_refused_but_ends_closed(
    isolated_server: EmbeddedServer,
) -> None:
    """nats-py refuses a drain while reconnecting; the services log that and
    stop, and the connection went on reconnecting after them, for good."""
    nc = await connect(isolated_server.url, name="test-drain-gone")
    await isolated_server.close()

    async def reconnecting() -> bool:
        return nc.client.is_reconnecting

    await until(reconnecting, "the connection reconnecting", within=HANGS)
    with pytest.raises(NatsUnavailableError, match="reconnecting"):
        await asyncio.wait_for(nc.drain(), HANGS)
    nothing_left(nc)


#: Well below the ~20 s nats-py's drain waited out against a stopped server (two
#: 10 s flushes): a drain that reaches it did not give up, whatever the machine's load.
DRAIN_GAVE_UP: float = 10.0


async def test_a_drain_to_a_stopped_server_gives_up_when_it_does_not_answer(
    isolated_server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A service shutting down after its server stopped answering (``SIGSTOP``)
    drained for about 20 s: nats-py's drain flushes twice, each waiting 10 s
    for a pong. The drain pings as it begins and gives up, closed, when that
    ping goes unanswered for ``DRAIN_ANSWER`` (here 1 s: the real 10 s would
    reach ``DRAIN_GAVE_UP``; a server paused for less is not given up, below)."""
    monkeypatch.setattr(nats_boundary, "CLOSE_WAIT", 0.5)
    monkeypatch.setattr(nats_boundary, "DRAIN_ANSWER", 1)
    nc = await connect(isolated_server.url, name="test-drain-frozen")

    async def ignore(_: Message) -> None:
        return None

    await nc.subscribe("test.drain.frozen", ignore)  # a subscription to drain
    await nc.flush()
    async with frozen(isolated_server):
        with pytest.raises(NatsUnavailableError, match="did not answer"):
            await asyncio.wait_for(nc.drain(), DRAIN_GAVE_UP)
        nothing_left(nc)


async def test_a_drain_to_a_live_server_still_waits_for_its_handlers(
    isolated_server: EmbeddedServer,
) -> None:
    """The drain's ping answered, nothing is given up: a handler still busy
    with a delivered message, and the message queued behind it, are handled
    before the drain ends (here the handler is held past the ping's answer)."""
    nc = await connect(isolated_server.url, name="test-drain-live")
    handled: list[bytes] = []
    began = asyncio.Event()
    release = asyncio.Event()

    async def slow(msg: Message) -> None:
        began.set()
        await release.wait()
        handled.append(msg.data)

    await nc.subscribe("test.drain.live", slow)
    await nc.publish("test.drain.live", b"1")
    await nc.publish("test.drain.live", b"2")
    await asyncio.wait_for(began.wait(), HANGS)
    pongs = nc.client._pongs_received
    draining = asyncio.ensure_future(nc.drain())

    async def answered() -> bool:
        return nc.client._pongs_received > pongs

    try:
        await until(answered, "the drain's ping answered", within=HANGS)
        release.set()
        await asyncio.wait_for(draining, HANGS)
    finally:
        draining.cancel()
    assert handled == [b"1", b"2"]
    nothing_left(nc)


#: How long the server is paused (``SIGSTOP``) while a drain waits for its
#: answer: a loaded machine's scheduler, not a synchronisation. Longer than the
#: 2 s the drain gave up after; well below its ``DRAIN_ANSWER``.
PAUSED: float = 3.0


async def test_a_drain_to_a_server_paused_for_seconds_still_waits_for_its_handlers(
    isolated_server: EmbeddedServer,
) -> None:
    """A live server slow to answer the drain's ping (a loaded machine: the CI
    runs on 2 cores) is not gone. Regression: the drain gave up when the ping
    was not answered within 2 s, raised ``NatsUnavailableError`` from a
    graceful close (``renqueue provision`` then exited non-zero, a client's
    ``close`` raised) and cancelled the handler still busy with a delivered
    message and the message queued behind it: neither was handled."""
    nc = await connect(isolated_server.url, name="test-drain-paused")
    handled: list[bytes] = []
    began = asyncio.Event()
    release = asyncio.Event()

    async def slow(msg: Message) -> None:
        began.set()
        await release.wait()
        handled.append(msg.data)

    await nc.subscribe("test.drain.paused", slow)
    await nc.publish("test.drain.paused", b"1")
    await nc.publish("test.drain.paused", b"2")
    await asyncio.wait_for(began.wait(), HANGS)
    async with frozen(isolated_server):
        draining = asyncio.ensure_future(nc.drain())
        await asyncio.sleep(PAUSED)  # the server's pause (the fault injected)
    try:
        release.set()
        await asyncio.wait_for(draining, HANGS)
    finally:
        draining.cancel()
    assert handled == [b"1", b"2"]
    nothing_left(nc)


async def test_a_drain_as_the_server_is_killed_gives_up_when_the_connection_is_lost(
    isolated_server: EmbeddedServer,
) -> None:
    """The server killed just before a drain, the client not yet aware: nats-py
    began the drain, saw the connection lost and started reconnecting, and its
    drain still waited 10 s for a pong no server would send. The drain gives
    up as soon as nats-py reconnects, and ends closed."""
    nc = await connect(isolated_server.url, name="test-drain-killed")

    async def ignore(_: Message) -> None:
        return None

    await nc.subscribe("test.drain.killed", ignore)
    await nc.flush()
    assert isolated_server.pid is not None
    os.kill(isolated_server.pid, signal.SIGKILL)
    assert nc.is_connected  # no await since the kill: the client has not seen it yet
    with pytest.raises(NatsUnavailableError, match="lost"):
        await asyncio.wait_for(nc.drain(), DRAIN_GAVE_UP)
    nothing_left(nc)


async def test_a_close_while_the_whole_cluster_is_gone_returns(tmp_path: Path) -> None:
    """Every node of a three-node cluster killed: the connection tries each
    URL in turn, each refused; a close stops that and leaves no socket."""
    async with cluster(tmp_path) as nodes:
        nc = await connect(nodes.url, name="test-close-cluster-gone", timeout=10)
        await nodes.stop(kill=True)

        async def reconnecting() -> bool:
            return nc.client.is_reconnecting

        await until(reconnecting, "the connection reconnecting", within=HANGS)
        await asyncio.wait_for(nc.close(), HANGS)
        nothing_left(nc)
        assert [sockets_to(port) for port in nodes.ports] == [set()] * len(nodes.ports)


async def test_a_second_close_waits_for_the_first(
    isolated_server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close while another is under way (a process's shutdown and a keeper,
    a drain and a close) found the client closed already and let its socket
    go at once, under the first close still flushing (workers' acks among what
    it writes, to a server that is slow, not gone), and returned before it:
    after a close returns, no close goes on."""
    monkeypatch.setattr(nats_boundary, "CLOSE_WAIT", 0.5)
    nc = await connect(isolated_server.url, name="test-close-twice")
    async with frozen(isolated_server):
        client = nc.client
        await fill(nc, lambda: client._pending_data_size > 0 or not nc.is_connected)
        assert nc.is_connected
        first = asyncio.ensure_future(nc.close())

        async def under_way() -> bool:
            return client.is_closed

        await until(under_way, "the first close under way", within=HANGS)
        await asyncio.wait_for(nc.close(), HANGS)
        assert first.done()
        await first
        nothing_left(nc)


@contextlib.asynccontextmanager
async def silent(nats_url: str, subject: str) -> AsyncIterator[None]:
    """A subscriber on ``subject`` that never answers: a request to it waits."""
    listener = await connect(nats_url, name="test-close-silent")

    async def ignore(_: Message) -> None:
        return None

    try:
        await listener.subscribe(subject, ignore)
        await listener.flush()
        yield
    finally:
        await listener.close()


async def test_an_ack_awaited_when_the_connection_closes_fails_closed(
    isolated_server: EmbeddedServer,
) -> None:
    """A ``publish_async`` whose ack had not come when the connection closed:
    its future waited for good (nothing reads an ack after a close)."""
    async with silent(isolated_server.url, "test.close.silent"):
        nc = await connect(isolated_server.url, name="test-close-ack")
        future = await nc.jetstream().publish_async("test.close.silent", b"x")
        await asyncio.wait_for(nc.close(), HANGS)
        with pytest.raises(NatsClosedError):
            await asyncio.wait_for(future, HANGS)


async def test_a_publish_waiting_for_its_ack_when_the_connection_closes_fails_closed(
    isolated_server: EmbeddedServer,
) -> None:
    """A JetStream publish (a submit's) waiting for its ack as the connection
    closes fails as closed: before, it waited out its whole timeout and then
    said the broker did not answer (a reason to try again)."""
    async with silent(isolated_server.url, "test.close.silent"):
        nc = await connect(isolated_server.url, name="test-close-request")
        publishing = asyncio.ensure_future(
            nc.jetstream().publish("test.close.silent", b"x", timeout=HANGS)
        )

        async def waiting() -> bool:
            return bool(nc.client._resp_map) and nc.client._pending_data_size == 0

        try:
            await until(waiting, "the publish sent, waiting for its ack", within=HANGS)
            await asyncio.wait_for(nc.close(), HANGS)
            with pytest.raises(NatsClosedError):
                await asyncio.wait_for(publishing, HANGS / 2)
        finally:
            publishing.cancel()


async def test_a_task_that_went_on_after_a_cancellation_still_connects(
    isolated_server: EmbeddedServer,
) -> None:
    """An attempt stops in a task asked to stop; a task that was asked once,
    caught the cancellation and went on (without ``uncancel()``: a cancel
    that Python 3.11's ``asyncio.wait_for`` swallowed, a loop that carries on)
    is not asked again: its connect connected. Counted from the connect's
    start, as ``asyncio.timeout`` counts."""
    task = asyncio.current_task()
    assert task is not None
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(0)
    assert task.cancelling() == 1
    # In this task (not under asyncio.wait_for, whose own task starts at no cancellation).
    nc = await connect(isolated_server.url, name="test-close-went-on", timeout=HANGS)
    try:
        assert nc.is_connected
    finally:
        await nc.close()
        task.uncancel()


async def test_a_connect_that_timed_out_leaves_the_task_free_to_connect(
    nats_url: str,
) -> None:
    """``asyncio.timeout`` cancels a connect, then takes its cancellation back:
    the same task's next connect is not taken for one asked to stop."""
    async with node_for(nats_url) as (node, url):
        node.up = False  # each attempt hung up on: the connect goes on retrying
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await connect(url, name="test-close-timed-out", timeout=HANGS)
        nc = await asyncio.wait_for(connect(nats_url, name="test-close-after"), HANGS)
        await nc.close()


@pytest.mark.parametrize("turns", range(5))
async def test_a_close_cancelled_twice_still_leaves_nothing(
    isolated_server: EmbeddedServer, turns: int
) -> None:
    """A close whose task is cancelled (a shutdown's timeout), and cancelled
    again as it ends nats-py's close (a second timeout, the event loop's
    shutdown): the cancellation cut the close short before it let the socket
    go (left open until the garbage collector found it). Whatever the await
    a cancellation lands on, the close ends what it can without waiting."""
    nc = await connect(isolated_server.url, name="test-close-cancelled")
    async with frozen(isolated_server):
        client = nc.client
        await fill(nc, lambda: client._pending_data_size > 0 or not nc.is_connected)
        closer = asyncio.ensure_future(nc.close())

        async def under_way() -> bool:
            return client.is_closed

        await until(under_way, "the close under way", within=HANGS)
        closer.cancel()
        for _ in range(turns):
            await asyncio.sleep(0)
        closer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(closer, HANGS)
        nothing_left(nc)


async def test_a_publish_held_while_reconnecting_fails_closed_at_a_close(
    isolated_server: EmbeddedServer,
) -> None:
    """A JetStream publish (a submit's) made while reconnecting is held, then
    dropped by a close: it fails as closed, never reports it stored, and does
    not wait out its timeout."""
    nc = await connect(isolated_server.url, name="test-close-held-publish")
    await isolated_server.close()

    async def reconnecting() -> bool:
        return nc.client.is_reconnecting

    await until(reconnecting, "the connection reconnecting", within=HANGS)
    publishing = asyncio.ensure_future(
        nc.jetstream().publish("test.close.held", b"x", timeout=HANGS)
    )

    async def held() -> bool:
        return nc.client._pending_data_size > 0

    try:
        await until(held, "the publish held", within=HANGS)
        await asyncio.wait_for(nc.close(), HANGS)
        with pytest.raises(NatsClosedError):
            await asyncio.wait_for(publishing, HANGS / 2)
        nothing_left(nc)
    finally:
        publishing.cancel()


async def test_a_fetch_waiting_when_a_close_lets_the_socket_go_fails_closed(
    isolated_server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nats-py's close ends the waits of its subscriptions (a pull's fetch)
    after its flush: a close that lets the socket go (a stopped server) ended
    nats-py's before that, and a fetch waited out its whole timeout."""
    monkeypatch.setattr(nats_boundary, "CLOSE_WAIT", 0.5)
    nc = await connect(isolated_server.url, name="test-close-fetch")
    js = nc.jetstream()
    await js.context.add_stream(name="CLOSE", subjects=["test.close.stream.>"])
    psub = await js.pull_subscribe("test.close.stream.>", durable="waiter", stream="CLOSE")
    waiting = asyncio.ensure_future(psub.fetch(1, timeout=HANGS))
    calls = psub._sub._sub._pending_next_msgs_calls

    async def fetch_waits() -> bool:
        return bool(calls)

    try:
        await until(fetch_waits, "the fetch waiting", within=HANGS)
        async with frozen(isolated_server):
            client = nc.client
            await fill(nc, lambda: client._pending_data_size > 0 or not nc.is_connected)
            await asyncio.wait_for(nc.close(), HANGS)
            with pytest.raises(NatsClosedError):
                await asyncio.wait_for(waiting, HANGS / 2)
            nothing_left(nc)
    finally:
        waiting.cancel()


async def test_an_ack_awaited_when_the_server_closes_the_connection_fails_closed(
    isolated_server: EmbeddedServer,
) -> None:
    """The server closes a connection (a message over its max_payload, headers
    counted: nats-py does not reconnect then): a ``publish_async`` whose ack
    had not come waited for good, a request for its timeout."""
    async with silent(isolated_server.url, "test.close.silent"):
        nc = await connect(isolated_server.url, name="test-close-by-server")
        future = await nc.jetstream().publish_async("test.close.silent", b"x")
        asking = asyncio.ensure_future(nc.request("test.close.silent", b"x", timeout=HANGS))

        async def asked() -> bool:
            return bool(nc.client._resp_map) and nc.client._pending_data_size == 0

        try:
            await until(asked, "the request sent", within=HANGS)
            # nats-py checks the payload alone; the server counts the headers too.
            over = b"x" * (nc.max_payload - 10)
            await nc.client.publish("test.close.over", over, headers={"Pad": "y" * 100})
            await asyncio.wait_for(nc.lost.wait(), HANGS)
            with pytest.raises(NatsClosedError):
                await asyncio.wait_for(future, HANGS / 2)
            with pytest.raises(NatsClosedError):
                await asyncio.wait_for(asking, HANGS / 2)
        finally:
            asking.cancel()
            await nc.close()
