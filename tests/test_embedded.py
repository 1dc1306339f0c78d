"""The embedded nats-server: starts with JetStream, advertises its URL, stops cleanly."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import httpx
import pytest

from renqueue.broker import EmbeddedServer, ServerState, connect, resolve_nats_url, url_file
from renqueue.broker._embedded import _REMOVED, LOCK_FILE_NAME, _DataDirLock
from renqueue.config import parse_config
from renqueue.errors import ConnectionFailedError, EmbeddedServerError

REPO = Path(__file__).resolve().parents[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def ports_files(directory: Path) -> list[Path]:
    return list(directory.glob("*.ports"))


def fake_server(
    directory: Path,
    *,
    ready: bool,
    ignore_sigterm: bool = False,
    log_ready: bool = False,
    monitoring: int | None = None,
    ports_in_two_writes: bool = False,
) -> Path:
    """A stand-in binary, then it sleeps: with ``ready``, it writes a ports file
    (client port 4999) where ``--ports_file_dir`` says, as nats-server does.

    ``log_ready`` logs nats-server's own "ready" lines; ``monitoring`` lists a
    monitoring URL, served by the fake itself, whose /healthz answers that
    status; ``ports_in_two_writes`` writes the file half first, as a reader
    may find it mid-write.
    """
    lines = [
        "import http.server, json, os, signal, sys, threading, time",
        "ports_dir = sys.argv[sys.argv.index('--ports_file_dir') + 1]",
        "path = os.path.join(ports_dir, f'fake_{os.getpid()}.ports')",
        "ports = {'nats': ['nats://127.0.0.1:4999']}",
    ]
    if ignore_sigterm:
        lines.append("signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    if log_ready:
        lines += [
            "sys.stderr.write('[1] [INF] Listening for client connections on 127.0.0.1:4999\\n')",
            "sys.stderr.write('[1] [INF] Server is ready\\n')",
        ]
    if monitoring is not None:
        lines += [
            "class Health(http.server.BaseHTTPRequestHandler):",
            "    def do_GET(self):",
            f"        self.send_response({monitoring})",
            "        self.end_headers()",
            '        self.wfile.write(b\'{"status": "fake"}\')',
            "    def log_message(self, *args):",
            "        pass",
            "monitor = http.server.HTTPServer(('127.0.0.1', 0), Health)",
            "threading.Thread(target=monitor.serve_forever, daemon=True).start()",
            "ports['monitoring'] = [f'http://127.0.0.1:{monitor.server_port}']",
        ]
    if ready:
        lines += [
            "text = json.dumps(ports)",
            "with open(path, 'w') as f:",
        ]
        if ports_in_two_writes:
            lines += [
                "    f.write(text[:10])",
                "    f.flush()",
                "    time.sleep(0.2)",
            ]
        lines += [f"    f.write(text[10:] if {ports_in_two_writes!r} else text)"]
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
            info = await nc.jetstream().context.account_info()
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


async def test_the_lock_file_is_removed_on_stop_and_an_empty_one_is_taken(
    tmp_path: Path,
) -> None:
    lock = tmp_path / LOCK_FILE_NAME
    lock.write_text("")  # left by a run that stopped before it recorded a pid
    async with EmbeddedServer(tmp_path, port=-1) as server:
        assert lock.read_text().split() == [str(server.pid)]
    assert not lock.exists()


def test_a_lock_file_removed_by_its_holder_is_not_taken_but_made_anew(tmp_path: Path) -> None:
    # A start that opened the file before its holder removed it must not lock the
    # removed file: another start could lock the new one at the same time.
    first = _DataDirLock.acquire(tmp_path)
    opened_before = os.open(tmp_path / LOCK_FILE_NAME, os.O_RDWR)
    first.release()
    late = _DataDirLock(tmp_path / LOCK_FILE_NAME, opened_before)
    try:
        assert late._take(tmp_path) == _REMOVED
    finally:
        late.close()
    second = _DataDirLock.acquire(tmp_path)
    try:
        third = os.open(tmp_path / LOCK_FILE_NAME, os.O_RDWR)
        assert os.fstat(third).st_ino == os.fstat(second.fd).st_ino
        os.close(third)
        with pytest.raises(EmbeddedServerError, match="in use by another process"):
            _DataDirLock.acquire(tmp_path)
    finally:
        second.release()
    assert not (tmp_path / LOCK_FILE_NAME).exists()


async def test_runs_with_the_repo_embedded_config(tmp_path: Path) -> None:
    config_file = REPO / "nats" / "embedded.conf"
    async with EmbeddedServer(tmp_path, port=-1, config_file=config_file) as server:
        nc = await connect(server.url, name="test")
        try:
            assert nc.client.max_payload == 8 * 1024 * 1024
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
    while server.pid is None:  # noqa: ASYNC110 - spawned: the start is under way (no event for it)
        await asyncio.sleep(0.01)
    pid = server.pid
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
        await js.context.add_stream(name="KEEP", subjects=["keep.>"])
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


async def test_readiness_comes_from_the_ports_file_not_the_log(tmp_path: Path) -> None:
    # Ready lines in the log and no ports file: not ready.
    silent = fake_server(tmp_path, ready=False, log_ready=True)
    server = EmbeddedServer(tmp_path / "a", port=-1, binary=silent, start_timeout=0.5)
    with pytest.raises(EmbeddedServerError, match=r"not ready after 0.5s \(no ports file yet\)"):
        await server.start()
    assert server.state is ServerState.CLOSED
    # A ports file and not a word in the log: ready, on the port the file names.
    (tmp_path / "b").mkdir()
    quiet = fake_server(tmp_path / "b", ready=True)
    async with EmbeddedServer(tmp_path / "b" / "data", port=-1, binary=quiet) as server:
        assert server.url == "nats://127.0.0.1:4999"
        assert server.log_tail == []
        assert server.monitoring_url is None  # the file listed none: no health check


async def test_a_ports_file_read_mid_write_is_read_again(tmp_path: Path) -> None:
    fake = fake_server(tmp_path, ready=True, ports_in_two_writes=True)
    async with EmbeddedServer(tmp_path / "data", port=-1, binary=fake) as server:
        assert server.port == 4999


async def test_readiness_waits_for_healthz_when_there_is_a_monitoring_port(
    tmp_path: Path,
) -> None:
    fake = fake_server(tmp_path, ready=True, monitoring=503)
    server = EmbeddedServer(tmp_path / "data", port=-1, binary=fake, start_timeout=0.5)
    with pytest.raises(
        EmbeddedServerError, match=r"not healthy: HTTP 503 from http://127\.0\.0\.1"
    ):
        await server.start()
    assert server.state is ServerState.CLOSED
    (tmp_path / "ok").mkdir()
    healthy = fake_server(tmp_path / "ok", ready=True, monitoring=200)
    async with EmbeddedServer(tmp_path / "ok" / "data", port=-1, binary=healthy) as server:
        assert server.monitoring_url is not None
        assert server.monitoring_url.startswith("http://127.0.0.1:")


async def test_the_real_server_is_healthy_on_a_loopback_monitoring_port(tmp_path: Path) -> None:
    # Even with clients on every interface, monitoring stays on loopback.
    async with EmbeddedServer(tmp_path, host="0.0.0.0", port=-1) as server:
        assert server.url == f"nats://127.0.0.1:{server.port}"
        assert server.monitoring_url is not None
        assert server.monitoring_url.startswith("http://127.0.0.1:")
        async with httpx.AsyncClient(trust_env=False) as http:
            health = await http.get(server.monitoring_url + "/healthz?js-enabled-only=true")
            varz = (await http.get(server.monitoring_url + "/varz")).json()
        assert health.json() == {"status": "ok"}
        assert varz["http_host"] == "127.0.0.1"
        assert ports_files(tmp_path)  # the server's own, while it runs
    assert not ports_files(tmp_path)  # removed by the server on a clean stop


async def test_a_stale_ports_file_of_a_killed_server_is_not_taken(tmp_path: Path) -> None:
    stale = tmp_path / "nats-server_1.ports"
    stale.write_text('{"nats": ["nats://127.0.0.1:1"]}')
    async with EmbeddedServer(tmp_path, port=-1) as server:
        assert server.port != 1
        assert not stale.exists()
        nc = await connect(server.url, name="test")
        await nc.close()


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
