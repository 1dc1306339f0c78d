"""The embedded nats-server: starts with JetStream, advertises its URL, stops cleanly."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from renqueue.config import parse_config
from renqueue.connection import connect, resolve_nats_url
from renqueue.embedded import EmbeddedServer, ServerState, url_file
from renqueue.errors import ConnectionFailedError, EmbeddedServerError

REPO = Path(__file__).resolve().parents[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def fake_server(directory: Path, *, ready: bool, ignore_sigterm: bool = False) -> Path:
    """A stand-in binary that logs like nats-server (or never gets ready), then sleeps."""
    lines = ["import signal, sys, time"]
    if ignore_sigterm:
        lines.append("signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    if ready:
        lines += [
            "sys.stderr.write('[1] [INF] Listening for client connections on 127.0.0.1:4999\\n')",
            "sys.stderr.write('[1] [INF] Server is ready\\n')",
        ]
    lines += ["sys.stderr.flush()", "time.sleep(60)"]
    fake = directory / "fake-nats-server"
    fake.write_text(f"#!{sys.executable}\n" + "\n".join(lines) + "\n")
    fake.chmod(0o755)
    return fake


async def test_random_port_server_serves_jetstream_and_stops(tmp_path: Path) -> None:
    server = EmbeddedServer(tmp_path, port=-1)
    assert server.state is ServerState.UNOPENED
    started = time.perf_counter()
    async with server:
        elapsed = time.perf_counter() - started
        assert server.state is ServerState.RUNNING
        assert server.port > 0
        assert server.url == f"nats://127.0.0.1:{server.port}"
        nc = await connect(server.url, name="test")
        try:
            info = await nc.jetstream().account_info()
            assert info.limits is not None  # JetStream answers
        finally:
            await nc.close()
        pid = server.pid
        assert pid is not None
    assert server.state is ServerState.CLOSED
    assert not _alive(pid)
    assert (tmp_path / "jetstream").is_dir()  # the store is <data_dir>/jetstream
    assert elapsed < 5


async def test_url_file_is_written_while_running_and_removed_on_stop(tmp_path: Path) -> None:
    async with EmbeddedServer(tmp_path, port=-1) as server:
        assert url_file(tmp_path).read_text().strip() == server.url
    assert not url_file(tmp_path).exists()


async def test_runs_with_the_repo_embedded_config(tmp_path: Path) -> None:
    config_file = REPO / "nats" / "embedded.conf"
    async with EmbeddedServer(tmp_path, port=-1, config_file=config_file) as server:
        nc = await connect(server.url, name="test")
        try:
            assert nc.max_payload == 8 * 1024 * 1024
        finally:
            await nc.close()


async def test_bad_config_file_raises_with_the_server_message(tmp_path: Path) -> None:
    config_file = tmp_path / "bad.conf"
    config_file.write_text("jetstream { store_dir: elsewhere }\n")  # clashes with -sd
    with pytest.raises(EmbeddedServerError, match="Duplicate 'store_dir'"):
        await EmbeddedServer(tmp_path / "data", port=-1, config_file=config_file).start()


async def test_close_is_idempotent_and_a_closed_server_cannot_restart(tmp_path: Path) -> None:
    server = EmbeddedServer(tmp_path, port=-1)
    await server.start()
    await server.close()
    await server.close()
    with pytest.raises(EmbeddedServerError, match="closed"):
        await server.start()
    with pytest.raises(EmbeddedServerError, match="closed"):
        _ = server.url


async def test_port_in_use_raises_with_the_server_log(tmp_path: Path) -> None:
    async with EmbeddedServer(tmp_path / "a", port=-1) as first:
        second = EmbeddedServer(tmp_path / "b", port=first.port)
        with pytest.raises(EmbeddedServerError, match="address already in use"):
            await second.start()
        assert second.state is ServerState.CLOSED
        assert not url_file(tmp_path / "b").exists()
        # The failed start did not disturb the running server's advertisement.
        assert url_file(tmp_path / "a").read_text().strip() == first.url


async def test_missing_binary_raises(tmp_path: Path) -> None:
    server = EmbeddedServer(tmp_path, port=-1, binary=tmp_path / "no-such-nats-server")
    with pytest.raises(EmbeddedServerError, match="cannot run"):
        await server.start()
    assert server.state is ServerState.CLOSED


async def test_cancelled_start_leaves_no_process(tmp_path: Path) -> None:
    # A stand-in binary that never becomes ready, so the cancel lands mid-start.
    fake = fake_server(tmp_path, ready=False)
    server = EmbeddedServer(tmp_path / "data", port=-1, binary=fake)
    task = asyncio.create_task(server.start())
    await asyncio.sleep(0.3)
    pid = server.pid
    assert pid is not None
    assert _alive(pid)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert server.state is ServerState.CLOSED
    assert not _alive(pid)


async def test_jetstream_data_survives_a_restart_on_the_same_dir(tmp_path: Path) -> None:
    async with EmbeddedServer(tmp_path, port=-1) as server:
        nc = await connect(server.url, name="test")
        js = nc.jetstream()
        await js.add_stream(name="KEEP", subjects=["keep.>"])
        await js.publish("keep.one", b"x")
        await nc.close()
    async with EmbeddedServer(tmp_path, port=-1) as server:
        nc = await connect(server.url, name="test")
        info = await nc.jetstream().stream_info("KEEP")
        await nc.close()
    assert info.state.messages == 1


async def test_server_ignoring_sigterm_is_killed_after_the_bound(tmp_path: Path) -> None:
    fake = fake_server(tmp_path, ready=True, ignore_sigterm=True)
    server = EmbeddedServer(tmp_path / "data", port=-1, binary=fake, stop_timeout=0.3)
    await server.start()
    assert server.url == "nats://127.0.0.1:4999"
    pid = server.pid
    assert pid is not None
    started = time.perf_counter()
    await server.close()
    assert time.perf_counter() - started < 3
    assert not _alive(pid)


async def test_resolve_prefers_configured_url_then_running_embedded_server(
    tmp_path: Path,
) -> None:
    embedded_only = parse_config({"nats": {"data_dir": str(tmp_path)}})
    assert resolve_nats_url(embedded_only) is None  # nothing running: start one
    async with EmbeddedServer(tmp_path, port=-1) as server:
        assert resolve_nats_url(embedded_only) == server.url
        explicit = parse_config(
            {"nats": {"data_dir": str(tmp_path), "url": "nats://elsewhere:4222"}}
        )
        assert resolve_nats_url(explicit) == "nats://elsewhere:4222"
    assert resolve_nats_url(embedded_only) is None


async def test_connecting_to_a_dead_url_fails_clearly(tmp_path: Path) -> None:
    async with EmbeddedServer(tmp_path, port=-1) as server:
        url = server.url
    with pytest.raises(ConnectionFailedError, match=url):
        await connect(url, name="test", timeout=0.5)
