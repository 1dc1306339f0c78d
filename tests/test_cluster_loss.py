"""The loss of a whole NATS cluster (issue #30 item 6): every node stopped, or killed
with ``kill -9`` at once, then started again on its store.

A service rides it out by itself (no restart: it reconnects and its consumers and
watchers work again), and a client submitting while the cluster is starting again is
told the broker is not answering, or is stored once it answers, never that its level
does not exist. ``bench/chaos.py --setting cluster-stop`` and ``cluster-kill9`` run the
same under load.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from _waits import until
from test_startup import ServiceProcess, service_config

from renqueue import Client
from renqueue.broker import (
    EmbeddedServer,
    EventLog,
    JetStreamApi,
    connect,
    provision,
)
from renqueue.config import parse_config
from renqueue.errors import NatsError, NatsUnavailableError
from renqueue.mock import MockBackend, MockSettings
from renqueue.schema import CANCELS_STREAM, EVENTS_STREAM, cancel_requested, event_subject


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Cluster:
    """Three JetStream nodes on loopback on fixed ports (so a node started again is
    where its clients look for it), each on its own store."""

    def __init__(self, tmp_path: Path, size: int = 3) -> None:
        routes = [free_port() for _ in range(size)]
        self.ports = [free_port() for _ in range(size)]
        seeds = ", ".join(f'"nats-route://127.0.0.1:{port}"' for port in routes)
        self.dirs = [tmp_path / f"node-{index}" for index in range(size)]
        self.configs = []
        for index, port in enumerate(routes):
            config = tmp_path / f"node-{index}.conf"
            config.write_text(
                f'server_name: "rq-loss-{index}"\n'
                f'cluster {{\n  name: "rq-loss"\n  listen: "127.0.0.1:{port}"\n'
                f"  routes: [{seeds}]\n}}\n"
            )
            self.configs.append(config)
        self.nodes: list[EmbeddedServer | None] = [None] * size

    @property
    def url(self) -> str:
        return ",".join(f"nats://127.0.0.1:{port}" for port in self.ports)

    def node_url(self, index: int) -> str:
        return f"nats://127.0.0.1:{self.ports[index]}"

    async def start(self, *indexes: int) -> None:
        chosen = indexes or tuple(range(len(self.nodes)))
        fresh = [
            EmbeddedServer(self.dirs[i], port=self.ports[i], config_file=self.configs[i])
            for i in chosen
        ]
        await asyncio.gather(*(node.start() for node in fresh))
        for index, node in zip(chosen, fresh, strict=True):
            self.nodes[index] = node

    async def stop(self, *, kill: bool = False) -> None:
        """Every node at once: SIGTERM (a clean stop), or ``kill -9``."""
        running = [node for node in self.nodes if node is not None]
        if kill:
            for node in running:
                if node.pid is not None:
                    os.kill(node.pid, signal.SIGKILL)
        await asyncio.gather(*(node.close() for node in running))
        self.nodes = [None] * len(self.nodes)


@asynccontextmanager
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    nodes = Cluster(tmp_path)
    await nodes.start()
    try:
        yield nodes
    finally:
        await nodes.stop()


async def provisioned(nodes: Cluster) -> None:
    config = parse_config({"nats": {"url": nodes.url, "replicas": 3}})
    nc = await connect(nodes.url, name="provision")
    try:
        await provision(nc, config)
    finally:
        await nc.close()


async def test_a_submit_while_the_cluster_starts_again_is_unavailable_not_an_unknown_level(
    tmp_path: Path,
) -> None:
    """One node of three back after the whole cluster stopped: no stream has a leader
    and JetStream has no meta leader, so a publish finds "no responders" for as long
    as that lasts (longer than the client's grace). That is a broker that does not
    answer (retried, then NatsUnavailableError), not a level that does not exist."""
    async with cluster(tmp_path) as nodes:
        await provisioned(nodes)
        nc = await connect(nodes.node_url(0), name="client")
        try:
            async with Client(nc, tenant="t") as client:
                # The client's event tap is made by its first submit, while all is well.
                await client.submit("before", route="chat")
                await nodes.stop()
                await nodes.start(0)
                client.no_stream_grace = 0.1
                client.submit_patience = 1.5
                with pytest.raises(NatsUnavailableError, match="not answering"):
                    await client.submit("hi", route="chat", priority="normal")
        finally:
            await nc.close()


async def test_a_submit_waiting_for_the_cluster_to_start_again_is_stored_once_it_answers(
    tmp_path: Path,
) -> None:
    """The same, with the other two nodes started while the submit waits: it is stored
    (once) when the stream has a leader again."""
    async with cluster(tmp_path) as nodes:
        await provisioned(nodes)
        nc = await connect(nodes.url, name="client")
        try:
            async with Client(nc, tenant="t") as client:
                await client.submit("before", route="chat")
                await nodes.stop()
                await nodes.start(0)
                client.no_stream_grace = 0.1
                client.submit_patience = 60.0
                request = client.build_request("hi", route="chat")
                submit = asyncio.create_task(client.submit_request(request))
                await nodes.start(1, 2)
                handle = await submit
                assert not handle.duplicate
                again = await client.submit_request(request)
                assert again.duplicate  # stored once, under its id
        finally:
            await nc.close()


@pytest.mark.parametrize("kill", [False, True], ids=["sigterm", "kill-9"])
async def test_a_service_rides_out_the_loss_of_the_whole_cluster_without_a_restart(
    tmp_path: Path, kill: bool
) -> None:
    """``renqueue up`` joined to a 3-node cluster serves a request; every node is
    stopped (or killed) and started again on its store; the same process (it never
    exits) serves the next request: its connection, consumers and watchers came back
    by themselves."""
    async with AsyncExitStack() as stack:
        mock = await stack.enter_async_context(MockBackend(MockSettings(ttft=0.0, output_tokens=3)))
        nodes = await stack.enter_async_context(cluster(tmp_path))
        service = ServiceProcess(tmp_path, service_config(nodes.url, mock.url))
        await service.start()
        stack.push_async_callback(service.stop)
        await service.logged("running; Ctrl-C to stop")
        nc = await connect(nodes.url, name="test-client")
        stack.push_async_callback(nc.close)
        client = await stack.enter_async_context(Client(nc, tenant="t"))
        client.submit_patience = 120.0
        first = await client.submit("before", route="chat")
        assert (await first.result(timeout=30)).backend == "mock"

        await nodes.stop(kill=kill)
        await service.logged("nats disconnected; reconnecting")
        await nodes.start()
        await service.logged("nats reconnected")

        second = await client.submit("after", route="chat")
        assert (await second.result(timeout=90)).backend == "mock"
        assert service.proc is not None
        assert service.proc.returncode is None, service.text()[-3000:]
        assert await service.stop() == 0, service.text()[-3000:]


async def logged_cancellations(nc: Any) -> dict[str, int]:
    """How many copies of each cancellation the log holds (by subject)."""
    reply = await nc.request(
        f"$JS.API.STREAM.INFO.{EVENTS_STREAM}",
        json.dumps({"subjects_filter": event_subject("t", "*", "cancel_requested")}).encode(),
        timeout=5,
    )
    info = json.loads(reply.data)
    if "error" in info:
        raise NatsError(str(info["error"]))
    subjects: dict[str, int] = info["state"].get("subjects") or {}
    return subjects


@pytest.mark.parametrize("kill", [False, True], ids=["sigterm", "kill-9"])
async def test_a_cancellation_acked_before_the_cluster_is_lost_reaches_the_log_once(
    tmp_path: Path, kill: bool
) -> None:
    """With three replicas, RQ_EVENTS sources RQ_CANCELS: a cancellation
    acknowledged by RQ_CANCELS just before every node stops (or is killed) is in
    the log once the cluster is back, and the sourcing, set up again by the
    servers, copies nothing twice (a copy made before the loss is not made again)
    and takes the next cancellation too."""
    async with cluster(tmp_path) as nodes:
        await provisioned(nodes)
        nc = await connect(nodes.url, name="client")
        try:
            log = EventLog(nc.jetstream())
            await log.append(cancel_requested("before", "t", at=time.time()))

            async def copied(*ids: str) -> bool:
                try:
                    have = await logged_cancellations(nc)
                except NatsError:  # RQ_EVENTS has no leader yet
                    return False
                return all(event_subject("t", i, "cancel_requested") in have for i in ids)

            await until(lambda: copied("before"), "the log has the first cancellation")
            await log.append(cancel_requested("at-the-loss", "t", at=time.time()))
            await nodes.stop(kill=kill)
            await nodes.start()
            await until_answers(lambda: log.append(cancel_requested("after", "t", at=time.time())))
            await until(
                lambda: copied("before", "at-the-loss", "after"),
                "the log has every cancellation",
                within=60,
            )
            assert set((await logged_cancellations(nc)).values()) == {1}
        finally:
            await nc.close()


async def until_answers(publish: Callable[[], Awaitable[object]]) -> None:
    """``publish`` once the cluster has a leader for its stream again."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while True:
        try:
            await publish()
        except (NatsUnavailableError, TimeoutError):
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.2)
        else:
            return


async def test_a_replicated_log_from_before_rq_cancels_is_upgraded_in_place(
    tmp_path: Path,
) -> None:
    """`renqueue provision` of this version on a three-replica deployment of the
    previous one (no RQ_CANCELS, a log that sources nothing, holding events):
    RQ_CANCELS is made with three replicas, the log gets its source in place
    keeping every event, and a cancellation then reaches the log once."""
    async with cluster(tmp_path) as nodes:
        config = parse_config({"nats": {"url": nodes.url, "replicas": 3}})
        nc = await connect(nodes.url, name="provision")
        try:
            # As the previous version left it (this one's provisioning refuses a
            # log without the source): no RQ_CANCELS, no source.
            await provision(nc, config)
            api = JetStreamApi(nc)
            old = (await api.call(f"STREAM.INFO.{EVENTS_STREAM}"))["config"]
            old.pop("sources")
            assert "error" not in await api.call(f"STREAM.UPDATE.{EVENTS_STREAM}", old)
            assert "error" not in await api.call(f"STREAM.DELETE.{CANCELS_STREAM}")
            js = nc.jetstream()
            await js.publish(event_subject("t", "older", "cancel_requested"), b"{}")

            report = await provision(nc, config)
            assert CANCELS_STREAM in report.created
            assert EVENTS_STREAM in report.updated
            cancels = (await api.call(f"STREAM.INFO.{CANCELS_STREAM}"))["config"]
            assert cancels["num_replicas"] == 3
            await EventLog(js).append(cancel_requested("newer", "t", at=time.time()))

            async def copied() -> bool:
                have = await logged_cancellations(nc)
                return event_subject("t", "newer", "cancel_requested") in have

            await until(copied, "the log has the new cancellation")
            assert await logged_cancellations(nc) == {
                event_subject("t", "older", "cancel_requested"): 1,
                event_subject("t", "newer", "cancel_requested"): 1,
            }
        finally:
            await nc.close()
