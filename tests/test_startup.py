"""Start-up waits for JetStream (issue #6 item 12), and still fails fast when waiting cannot help.

A service started while its cluster cannot answer (one node of three up: no
quorum, no JetStream leader) logs that it is waiting and retries; once the other
nodes join it provisions and serves. A permissions violation or a stream NATS
cannot change still ends start-up at once with a clear message.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import pytest

from renqueue import Client
from renqueue.broker import EmbeddedServer, connect, provision
from renqueue.broker._nats import JetStreamApi
from renqueue.broker._provision import (
    _answered,
    _drop_other_router_consumers,
    _has_group_consumers,
)
from renqueue.config import parse_config
from renqueue.errors import ConnectionFailedError, NatsUnavailableError
from renqueue.mock import MockBackend, MockSettings
from renqueue.schema import REQUESTS_STREAM

RETRYING = "jetstream unavailable; retrying"


def child_env() -> dict[str, str]:
    """The test's environment without settings that would override the config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RENQUEUE_")}
    return {**env, "PYTHONUNBUFFERED": "1"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def cluster_nodes(tmp_path: Path, size: int = 3) -> list[EmbeddedServer]:
    """A ``size``-node JetStream cluster on loopback, not started. Client ports are
    random; route ports are picked free up front, since every node lists them all."""
    routes = [free_port() for _ in range(size)]
    seeds = ", ".join(f'"nats-route://127.0.0.1:{port}"' for port in routes)
    nodes = []
    for index, port in enumerate(routes):
        config = tmp_path / f"node-{index}.conf"
        config.write_text(
            f'server_name: "rq-test-{index}"\n'
            f'cluster {{\n  name: "rq-test"\n  listen: "127.0.0.1:{port}"\n'
            f"  routes: [{seeds}]\n}}\n"
        )
        nodes.append(EmbeddedServer(tmp_path / f"node-{index}", port=-1, config_file=config))
    return nodes


@asynccontextmanager
async def running(*nodes: EmbeddedServer) -> AsyncIterator[None]:
    async with AsyncExitStack() as stack:
        await asyncio.gather(*(stack.enter_async_context(node) for node in nodes))
        yield


class ServiceProcess:
    """``renqueue up`` joining a server, its JSON log lines in a file."""

    def __init__(self, tmp_path: Path, config: str) -> None:
        self.config = tmp_path / "renqueue.toml"
        self.config.write_text(config)
        self.log = tmp_path / "service.log"
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        with self.log.open("wb") as out:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "renqueue", "-c", str(self.config), "--log-json", "up",
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=out, env=child_env(),
            )  # fmt: skip

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    async def logged(self, words: str, *, within: float = 60.0) -> None:
        """Wait until the log shows ``words``; fail at once if the process exits first."""
        assert self.proc is not None
        deadline = asyncio.get_running_loop().time() + within
        while words not in self.text():
            if self.proc.returncode is not None:
                pytest.fail(
                    f"the service exited ({self.proc.returncode}) before logging {words!r}:\n"
                    f"{self.text()[-3000:]}"
                )
            if asyncio.get_running_loop().time() > deadline:
                pytest.fail(f"the service did not log {words!r}:\n{self.text()[-3000:]}")
            await asyncio.sleep(0.05)

    async def stop(self) -> int:
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(self.proc.wait(), 30)


def service_config(nats_url: str, backend_url: str, *, replicas: int = 3) -> str:
    return (
        f'[nats]\nurl = "{nats_url}"\nreplicas = {replicas}\n'
        f'[worker]\nack_wait = "5s"\ndrain_timeout = "500ms"\n'
        f'[backends.mock]\nbase_url = "{backend_url}"\nmodel = "mock"\n'
        f'[routes.chat]\nbackends = ["mock"]\n'
    )


async def test_service_started_before_the_cluster_has_a_quorum_waits_then_serves(
    tmp_path: Path,
) -> None:
    """One node of three up: JetStream cannot answer (no quorum, no leader). The
    service must log that it waits and keep retrying, not exit; once the other
    two nodes join, it provisions R3 streams and serves a request end to end."""
    first, *others = cluster_nodes(tmp_path)
    async with MockBackend(MockSettings(ttft=0.0, output_tokens=3)) as mock, running(first):
        service = ServiceProcess(tmp_path, service_config(first.url, mock.url))
        await service.start()
        try:
            await service.logged(RETRYING)
            async with running(*others):
                await service.logged("running; Ctrl-C to stop")
                nc = await connect(first.url, name="test-client")
                try:
                    async with Client(nc, tenant="t") as client:
                        handle = await client.submit("hello", route="chat")
                        result = await handle.result(timeout=30)
                    assert result.backend == "mock"
                    info = await nc.jetstream().stream_info(REQUESTS_STREAM)
                    assert info.config.num_replicas == 3
                finally:
                    await nc.close()
                assert await service.stop() == 0, service.text()[-3000:]
        finally:
            await service.stop()


async def test_a_signal_stops_a_service_waiting_for_the_cluster(tmp_path: Path) -> None:
    """Waiting may last long; SIGTERM must end it cleanly, not be ignored."""
    first, *_ = cluster_nodes(tmp_path)
    async with running(first):
        service = ServiceProcess(tmp_path, service_config(first.url, "http://127.0.0.1:9"))
        await service.start()
        try:
            await service.logged(RETRYING)
        finally:
            code = await service.stop()
        assert code == 0, service.text()[-3000:]
        assert "signal received while starting" in service.text()


async def test_startup_wait_bounds_the_wait(tmp_path: Path) -> None:
    """With ``nats.startup_wait`` set, start-up gives up after it, naming the setting."""
    first, *_ = cluster_nodes(tmp_path)
    async with running(first):
        config = parse_config({"nats": {"url": first.url, "replicas": 3, "startup_wait": "1s"}})
        nc = await connect(first.url, name="test")
        try:
            with pytest.raises(ConnectionFailedError, match=r"nats.startup_wait \(1s\)"):
                await provision(nc, config)
        finally:
            await nc.close()


async def test_permission_denied_fails_fast_instead_of_waiting(tmp_path: Path) -> None:
    """A user the server forbids the JetStream API: its requests are dropped and
    look like timeouts, but waiting cannot fix that; start-up must end with a
    message naming the violation (and never the password)."""
    conf = tmp_path / "auth.conf"
    conf.write_text(
        "authorization {\n  users: [\n"
        '    {user: svc, password: "s3cret-pw", permissions: {publish: {deny: ["$JS.API.>"]}}}\n'
        "  ]\n}\n"
    )
    async with EmbeddedServer(tmp_path / "nats", port=-1, config_file=conf) as server:
        url = server.url.replace("nats://", "nats://svc:s3cret-pw@")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "renqueue", "--nats", url, "provision",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=child_env(),
        )  # fmt: skip
        _out, err = await asyncio.wait_for(proc.communicate(), 30)
    text = err.decode()
    assert proc.returncode == 2, text
    last = text.strip().splitlines()[-1]
    assert last.startswith("renqueue: stream RQ_REQUESTS: JetStream did not answer"), text
    assert "permissions violation for publish to" in last.lower()
    assert RETRYING not in text
    assert "s3cret-pw" not in text


async def test_a_stream_nats_cannot_change_fails_fast(isolated_server: EmbeddedServer) -> None:
    """A refused config is not unavailability: no retry, the ProvisionError at once."""
    nc = await connect(isolated_server.url, name="test")
    try:
        await nc.jetstream().context.add_stream(
            name=REQUESTS_STREAM, subjects=["rq.req.>"], storage="memory"
        )
    finally:
        await nc.close()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "renqueue", "--nats", isolated_server.url, "provision",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=child_env(),
    )  # fmt: skip
    _out, err = await asyncio.wait_for(proc.communicate(), 30)
    text = err.decode()
    assert proc.returncode == 2, text
    assert "NATS cannot change storage" in text
    assert RETRYING not in text


async def test_the_router_consumer_checks_wait_for_jetstream_like_every_step(
    tmp_path: Path,
) -> None:
    """Provisioning asks whether binding is split in groups (the forwarding
    consumer) and may drop router consumers; both are JetStream API calls. With
    JetStream unable to answer (one node of three), they wait as every other
    step does, up to ``nats.startup_wait``, instead of failing at once: a worker
    started while a node was down exited with "JetStream did not answer
    $JS.API.CONSUMER.INFO.RQ_REQUESTS.router-forward" (chaos, cluster setting)."""
    first, *_ = cluster_nodes(tmp_path)
    async with running(first):
        nc = await connect(first.url, name="test")
        try:
            api = JetStreamApi(nc, patience=1.0)
            with pytest.raises(NatsUnavailableError):
                await _has_group_consumers(api)  # the bare call cannot wait
            with pytest.raises(ConnectionFailedError, match=r"nats.startup_wait \(1s\)"):
                await _answered(api, "the forwarding consumer", lambda: _has_group_consumers(api))
            with pytest.raises(ConnectionFailedError, match=r"nats.startup_wait \(1s\)"):
                await _answered(
                    api, "the router consumers", lambda: _drop_other_router_consumers(api, ())
                )
        finally:
            await nc.close()
