"""The embedded nats-server never outlives the ``renqueue`` process that started it,
and a server left over from an earlier run is reported in one plain line (issue #6
item 26).

Black-box: ``renqueue up`` runs as a user runs it, in a process of its own, and the
server's pid is read from its own log line ("embedded nats-server ready").
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import pytest

from renqueue.broker import find_nats_server

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc; Linux only")

BOUND = 20.0  # seconds any awaited condition gets before the test fails
#: Where the embedded server's pid is kept, in the data dir (docs/architecture.md).
LOCK_FILE_NAME = "nats-server.pid"


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in {"Z", "X"}


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + BOUND
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {BOUND:g}s: {what}")
        time.sleep(0.02)


def _readline(stream: IO[bytes], deadline: float) -> bytes:
    """One line, or b"" at EOF or the deadline. ``stream`` must be unbuffered
    (``bufsize=0``): a buffer would hold lines select() cannot see."""
    remaining = deadline - time.monotonic()
    if remaining <= 0 or not select.select([stream], [], [], remaining)[0]:
        return b""
    return stream.readline()


def _config(tmp_path: Path) -> Path:
    file = tmp_path / "renqueue.toml"
    file.write_text(f'[nats]\ndata_dir = "{tmp_path / "data"}"\nport = -1\n')
    return file


def _up(config: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "renqueue", "-c", str(config), "--log-json", "up"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        bufsize=0,
        env={**os.environ, "RENQUEUE_CONFIG": "", "RENQUEUE_NATS_URL": ""},
    )


def _server_pid_once_running(proc: subprocess.Popen[bytes]) -> int:
    """Read ``renqueue up``'s log until it runs; the embedded server's pid."""
    assert proc.stdout is not None
    deadline = time.monotonic() + BOUND
    pid = None
    seen: list[str] = []
    while line := _readline(proc.stdout, deadline):
        seen.append(line.decode(errors="replace"))
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "embedded nats-server ready":
            pid = int(event["pid"])
        if event.get("event") == "running; Ctrl-C to stop":
            assert pid is not None
            return pid
    pytest.fail("renqueue up did not report running:\n" + "".join(seen))


@contextmanager
def _reaped(proc: subprocess.Popen[bytes]) -> Iterator[subprocess.Popen[bytes]]:
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@contextmanager
def _lingering_server(data_dir: Path) -> Iterator[int]:
    """A nats-server on ``data_dir`` that no renqueue process owns, as after a crash."""
    data_dir.mkdir(parents=True, exist_ok=True)
    server = subprocess.Popen(
        [str(find_nats_server()), "-js", "-sd", str(data_dir), "-a", "127.0.0.1", "-p", "-1"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        bufsize=0,
    )
    try:
        assert server.stderr is not None
        deadline = time.monotonic() + BOUND
        while b"Server is ready" not in (line := _readline(server.stderr, deadline)):
            assert line, "the stand-in leftover server did not start"
        yield server.pid
    finally:
        server.terminate()
        server.wait()
        assert server.stderr is not None
        server.stderr.close()


def test_sigint_after_the_log_reader_went_away_stops_the_server(tmp_path: Path) -> None:
    """`renqueue up 2>&1 | tee up.log`, then Ctrl-C: tee is gone before renqueue logs
    its shutdown. Writing to the dead pipe must not stop renqueue from stopping the
    server."""
    with _reaped(_up(_config(tmp_path))) as proc:
        server = _server_pid_once_running(proc)
        assert proc.stdout is not None
        proc.stdout.close()  # the reader goes away: every later write hits EPIPE
        proc.send_signal(signal.SIGINT)
        assert proc.wait(BOUND) == 0
        _wait_for(lambda: not _alive(server), f"nats-server {server} exits")


def test_the_server_dies_with_a_killed_renqueue(tmp_path: Path) -> None:
    """kill -9 leaves renqueue no chance to stop its server: the server must go
    anyway, and the next `renqueue up` on the same data dir starts."""
    config = _config(tmp_path)
    with _reaped(_up(config)) as proc:
        server = _server_pid_once_running(proc)
        proc.kill()
        proc.wait()
        _wait_for(lambda: not _alive(server), f"nats-server {server} exits")
    with _reaped(_up(config)) as proc:
        _server_pid_once_running(proc)  # the stale lock of the killed run is taken over
        proc.send_signal(signal.SIGINT)
        assert proc.wait(BOUND) == 0


def test_a_server_left_from_an_earlier_run_is_reported_plainly(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with _lingering_server(data_dir) as leftover:
        (data_dir / LOCK_FILE_NAME).write_text(f"{leftover}\n")
        with _reaped(_up(_config(tmp_path))) as proc:
            try:
                out, _ = proc.communicate(timeout=BOUND)
            except subprocess.TimeoutExpired:
                pytest.fail("renqueue up started next to a server already on its data dir")
            err = out.decode()
            assert proc.returncode == 2, err
            assert f"a nats-server from an earlier run is still running, pid {leftover}" in err
            assert f"kill {leftover}" in err  # says what to do
            assert "[INF]" not in err  # and dumps no server log
        assert _alive(leftover)  # left alone: not renqueue's to kill


def test_a_second_up_on_the_same_data_dir_is_refused(tmp_path: Path) -> None:
    config = _config(tmp_path)
    with _reaped(_up(config)) as first:
        server = _server_pid_once_running(first)
        with _reaped(_up(config)) as second:
            try:
                out, _ = second.communicate(timeout=BOUND)
            except subprocess.TimeoutExpired:
                pytest.fail("a second renqueue up started a second server on the same store")
            err = out.decode()
            assert second.returncode == 2, err
            assert f"pid {server}" in err
            assert f"renqueue (pid {first.pid})" in err
        first.send_signal(signal.SIGINT)
        assert first.wait(BOUND) == 0


def test_a_stale_lock_of_a_dead_server_is_taken_over(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    (data_dir / LOCK_FILE_NAME).write_text(f"{dead.pid}\n")
    with _reaped(_up(_config(tmp_path))) as proc:
        server = _server_pid_once_running(proc)
        assert (data_dir / LOCK_FILE_NAME).read_text().split() == [str(server)]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(BOUND) == 0
        _wait_for(lambda: not _alive(server), f"nats-server {server} exits")
