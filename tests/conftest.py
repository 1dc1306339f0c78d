"""Shared fixtures: a real nats-server per session, and one per test that needs a clean broker.

The chain is server -> connection -> JetStream, as in nats.py's own test suite.
Servers listen on a random port (``port=-1``) with a temporary store, and are
declared ready by their own ports file and ``/healthz`` endpoint
(:class:`renqueue.broker.EmbeddedServer`).

Streams are global to a server, so tests that provision or assert on stream
state should use ``isolated_server`` / ``isolated_nc``: a server of their own.
Measured here (2 cores, shared with other suites): a start takes ~32 ms (median
of 40; ~23 ms when readiness was read from the log, ~10 ms of the difference
the /healthz probe) and a stop 2-90 ms (more with streams to flush), so
per-test servers cost little.

Every async test and fixture runs on a :class:`FreshBootLoop`: an event loop
whose clock starts at zero, as a machine's does at boot (issue #25). Code that
takes a loop time of 0.0 for "long ago" misbehaves in the suite on every
machine, not only on one that booted a few minutes before the run.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path

import pytest
import pytest_asyncio

from renqueue.broker import Connection, EmbeddedServer, JetStream, connect

# A suite started in the background of a script (``make test &``, nohup, some
# CI runners) inherits SIGINT ignored, and so would every process a test
# starts: a `renqueue` child sent SIGINT (Ctrl-C) by a test would then never
# stop, and the test time out (issue #25: 4 tests failed so, every run, only
# when the suite ran in the background). An ignored SIGINT is inherited across
# exec, a handler is not: restore Python's own.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


class FreshBootLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` starts at zero when it is made, as on a
    machine that has just booted (asyncio's own reads ``time.monotonic()``:
    seconds since the boot). Everything the loop schedules reads this clock,
    so timers, timeouts and ``loop.time()`` stay consistent."""

    def __init__(self) -> None:
        super().__init__()
        self._boot = time.monotonic()

    def time(self) -> float:
        return time.monotonic() - self._boot


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Every async test and fixture runs on a :class:`FreshBootLoop`."""
    return {"fresh-boot": FreshBootLoop}


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def nats_server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[EmbeddedServer]:
    """One nats-server with JetStream for the whole session (shared: streams persist)."""
    async with EmbeddedServer(tmp_path_factory.mktemp("nats"), port=-1) as server:
        yield server


@pytest.fixture(scope="session")
def nats_url(nats_server: EmbeddedServer) -> str:
    return nats_server.url


@pytest_asyncio.fixture
async def nc(nats_url: str) -> AsyncIterator[Connection]:
    """A client connected to the session server, closed after the test."""
    client = await connect(nats_url, name="test")
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
def js(nc: Connection) -> JetStream:
    return nc.jetstream()


@pytest_asyncio.fixture
async def isolated_server(tmp_path: Path) -> AsyncIterator[EmbeddedServer]:
    """A nats-server of the test's own: no streams, nothing left by other tests."""
    async with EmbeddedServer(tmp_path / "nats", port=-1) as server:
        yield server


@pytest_asyncio.fixture
async def isolated_nc(isolated_server: EmbeddedServer) -> AsyncIterator[Connection]:
    """A client connected to ``isolated_server``, closed after the test."""
    client = await connect(isolated_server.url, name="test-isolated")
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
def isolated_js(isolated_nc: Connection) -> JetStream:
    return isolated_nc.jetstream()


#: The real model's tests (issue #32): skipped, with the reason, without its cached venv.
REAL_MODEL_TESTS = "tests/test_real_model.py"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Says so when the real model's tests were skipped, and why (never silently: a
    plain ``pytest -q`` prints no skip reasons)."""
    skipped = [
        report
        for report in terminalreporter.stats.get("skipped", [])
        if getattr(report, "nodeid", "").startswith(REAL_MODEL_TESTS)
    ]
    if not skipped:
        return
    longrepr = skipped[0].longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    terminalreporter.write_line(
        f"{REAL_MODEL_TESTS}: {len(skipped)} tests skipped: {reason.removeprefix('Skipped: ')}",
        yellow=True,
    )
