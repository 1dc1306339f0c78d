"""Quota survives restarts (issue #8 item 6): no burst after a restart, a failover,
or a full cluster restart.

What a backend's windows have used is folded from the log into the projection,
and a binder judges every bind by the projection plus its own reservations not
folded yet (:mod:`renqueue.services.router._ledger`). So a binder that starts
after another was killed, workers restarted mid-window, or a whole deployment
stopped and started again all know what the window has used: the strict mock
(a token bucket of the declared size) answers no 429, and the decisions logged
never put more than the declared count in any window.

Each test uses part of (or all) a window of 6 requests per 6 s, restarts
something abruptly (``kill -9``), then submits more: without the projection the
next binder would send them at once, over the limit.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
from test_restarts import (
    TENANT,
    await_all,
    child_env,
    client_of,
    held,
    router_processes,
    until,
    workers,
)

from renqueue import Client, Services, parse_config
from renqueue.broker import EmbeddedServer, EventLog
from renqueue.config import Config, load_config
from renqueue.coordination import Projector, StateView
from renqueue.coordination._view import PROGRESS_KEY, Progress, encode_view
from renqueue.mock import MockBackend, MockSettings
from renqueue.schema import STATE_BUCKET, Routed

#: The declared limit: LIMIT requests per WINDOW seconds (a minute's limit on a
#: compressed clock), longer than a take-over, so a burst would show.
LIMIT = 6
WINDOW = 6.0
#: The provider: a token bucket of the same size, answering 429 beyond it.
PROVIDER = MockSettings(ttft=0.01, output_tokens=2, concurrency=8, rpm=LIMIT, rate_window=WINDOW)


def limited_config(path: Path, *, nats_url: str, backend_url: str) -> Path:
    """Backend ``b`` (LIMIT per WINDOW declared) behind route ``chat``; short
    lease and ack waits so a killed process's part is taken over quickly."""
    path.write_text(
        f'[nats]\nurl = "{nats_url}"\n'
        f'[router]\nack_wait = "5s"\ncapacity_refresh = "20ms"\n'
        f'[worker]\nack_wait = "2s"\ndrain_timeout = "1s"\n'
        f'[backends.b]\nbase_url = "{backend_url}"\nmodel = "mock"\n'
        f'[backends.b.limits]\nconcurrency = 8\nrequests = ["{LIMIT}/{WINDOW:g}s"]\n'
        f'[routes.chat]\nbackends = ["b"]\n'
    )
    return path


def most_in_any_window(times: list[float], window: float) -> int:
    """The most of ``times`` inside any closed stretch ``[t - window, t]``."""
    ordered = sorted(times)
    most, first = 0, 0
    for last, at in enumerate(ordered):
        while ordered[first] < at - window:
            first += 1
        most = max(most, last - first + 1)
    return most


async def decisions(js: Any, handles: list[Any]) -> list[Routed]:
    log = EventLog(js)
    return [
        event
        for handle in handles
        for event in await log.history(TENANT, handle.id)
        if isinstance(event, Routed)
    ]


def assert_within_the_limit(mock: MockBackend, routed: list[Routed], count: int) -> None:
    """Every request bound once; no window over the limit, by our decisions and at the provider."""
    assert len(routed) == count
    times = [event.at for event in routed if event.backend == "b"]
    assert most_in_any_window(times, WINDOW) <= LIMIT, sorted(t - min(times) for t in times)
    assert mock.stats().rate_limited == 0
    assert mock.stats().completed == count


async def submit(client: Any, prefix: str, count: int) -> list[Any]:
    return [await client.submit(f"{prefix} {n}", route="chat") for n in range(count)]


async def routed_all(js: Any, handles: list[Any]) -> None:
    async def bound() -> bool:
        return len(await decisions(js, handles)) >= len(handles)

    await until(bound, f"{len(handles)} requests are routed", within=10)


class WorkerProcess:
    """``renqueue worker`` in a process of its own, logging to a file."""

    def __init__(self, config: Path, log: Path) -> None:
        self.config = config
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        with self.log.open("wb") as out:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "renqueue", "-c", str(self.config), "--log-json",
                "worker",
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=out, env=child_env(),
            )  # fmt: skip

        async def started() -> bool:
            if self.proc is not None and self.proc.returncode is not None:
                pytest.fail(f"worker process exited; its log:\n{self.text()[-3000:]}")
            return "worker started" in self.text()

        await until(started, "the worker process started")

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    async def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        await asyncio.wait_for(self.proc.wait(), 10)


@asynccontextmanager
async def worker_processes(config: Path, tmp_path: Path) -> AsyncIterator[list[WorkerProcess]]:
    """A list to start worker processes into; any still alive are killed on exit."""
    started: list[WorkerProcess] = []
    try:
        yield started
    finally:
        for worker in started:
            if worker.proc is not None and worker.proc.returncode is None:
                await worker.kill()


async def new_worker(started: list[WorkerProcess], config: Path, tmp_path: Path) -> WorkerProcess:
    worker = WorkerProcess(config, tmp_path / f"worker-{len(started)}.log")
    started.append(worker)
    await worker.start()
    return worker


# ------------------------------------------------------------------ tests


async def test_a_binder_started_after_the_last_was_killed_knows_the_window(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    """The binder (and the projector in its process) is ``kill -9``ed as soon
    as it bound a full window; a fresh router process binds next. The
    requests submitted meanwhile wait for the window, not a moment less."""
    async with MockBackend(PROVIDER) as mock:
        file = limited_config(
            tmp_path / "rq.toml", nats_url=isolated_server.url, backend_url=mock.url
        )
        async with (
            workers(load_config(file, environ={})),
            router_processes(file, tmp_path) as new_router,
            client_of(isolated_server.url) as (client, nc),
        ):
            js = nc.jetstream()
            first = await new_router()
            used = await submit(client, "first", LIMIT)
            await routed_all(js, used)
            await first.kill()
            more = await submit(client, "after the kill", LIMIT)
            await new_router()
            await await_all(client, [*used, *more], within=20)
            routed = await decisions(js, [*used, *more])
    assert_within_the_limit(mock, routed, 2 * LIMIT)


async def test_workers_killed_and_restarted_mid_window_send_nothing_over_the_limit(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    """Two worker processes serve part of a window, are ``kill -9``ed and
    replaced by two fresh ones: what is left of the window is all they get."""
    async with MockBackend(PROVIDER) as mock:
        file = limited_config(
            tmp_path / "rq.toml", nats_url=isolated_server.url, backend_url=mock.url
        )
        async with (
            worker_processes(file, tmp_path) as started,
            router_processes(file, tmp_path) as new_router,
            client_of(isolated_server.url) as (client, nc),
        ):
            js = nc.jetstream()
            await new_router()
            for _ in range(2):
                await new_worker(started, file, tmp_path)
            used = await submit(client, "first", LIMIT - 2)
            await await_all(client, used, within=10)
            for worker in list(started):
                await worker.kill()
            for _ in range(2):
                await new_worker(started, file, tmp_path)
            more = await submit(client, "after the restart", LIMIT)
            await await_all(client, more, within=20)
            routed = await decisions(js, [*used, *more])
    assert_within_the_limit(mock, routed, 2 * LIMIT - 2)


async def test_a_full_restart_mid_window_sends_nothing_over_the_limit(tmp_path: Path) -> None:
    """Router and workers ``kill -9``ed right after binding a full window, the
    nats-server stopped, then everything started again on the same store:
    the window's use comes back with the log and the projection."""
    store = tmp_path / "nats"
    async with MockBackend(PROVIDER) as mock:
        async with EmbeddedServer(store, port=-1) as server:
            file = limited_config(tmp_path / "rq.toml", nats_url=server.url, backend_url=mock.url)
            async with (
                worker_processes(file, tmp_path) as started,
                router_processes(file, tmp_path) as new_router,
                client_of(server.url) as (client, nc),
            ):
                router = await new_router()
                await new_worker(started, file, tmp_path)
                used = await submit(client, "first", LIMIT)
                await routed_all(nc.jetstream(), used)
                await router.kill()
                # (Killed once its calls are done: a call cut short is run
                # again, which the binder did not reserve.)
                await await_all(client, used, within=10)
                await started[0].kill()
        after = tmp_path / "after"
        after.mkdir()
        async with EmbeddedServer(store, port=-1) as server:
            file = limited_config(after / "rq.toml", nats_url=server.url, backend_url=mock.url)
            async with (
                worker_processes(file, after) as started,
                router_processes(file, after) as new_router,
                client_of(server.url) as (client, nc),
            ):
                more = await submit(client, "after the restart", LIMIT)
                await new_worker(started, file, after)
                await new_router()
                await await_all(client, [*used, *more], within=20)
                routed = await decisions(nc.jetstream(), [*used, *more])
    assert_within_the_limit(mock, routed, 2 * LIMIT)


async def test_a_new_binder_binds_only_once_its_view_has_folded_the_log(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    """The stored projection lags the log: its only projector wrote once, at
    its first fold, and not since (as one killed before its next write
    leaves it). A binder that takes over holds what it fetched until its view
    has folded the log as it stood when its term began, so it never binds on
    a view that has not seen its predecessor's last decisions."""
    async with MockBackend(PROVIDER) as mock:
        file = limited_config(
            tmp_path / "rq.toml", nats_url=isolated_server.url, backend_url=mock.url
        )
        config = load_config(file, environ={})
        async with (
            Services(config, routers=0, backends=["b"]) as services,
            Client(services.nc, tenant=TENANT) as client,
        ):
            js = client.js
            # It writes at its first fold, then
            # not for an hour (or until it stops).
            lagging = Projector(js, flush_interval=3600.0)
            await lagging.start()
            try:
                async with Services(config, backends=[], projector=False):
                    used = await submit(client, "first", LIMIT)
                    await await_all(client, used, within=10)
                more = await submit(client, "after the hand-over", LIMIT)
                async with Services(config, backends=[], projector=False):

                    async def held_or_bound() -> bool:
                        return await held(js) == LIMIT or bool(await decisions(js, more))

                    await until(held_or_bound, "the new binder holds (or bound) the requests")
                    await lagging.close()  # its last write: the view catches up
                    await await_all(client, more, within=20)
            finally:
                await lagging.close()
            routed = await decisions(js, [*used, *more])
    assert_within_the_limit(mock, routed, 2 * LIMIT)


def with_open_backend(config: Config, url: str) -> Config:
    """``config`` plus backend ``u`` (no limits at all) behind route ``open``."""
    data = msgspec.to_builtins(config)
    data["backends"]["u"] = {"base_url": url, "model": "mock", "limits": {"concurrency": 4}}
    data["routes"]["open"] = {"backends": ["u"]}
    return parse_config(data)


async def test_a_catching_up_binder_binds_at_once_to_backends_it_judges_no_quota_of(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    """Reproduces the review: a binder catching up held every bind, also to a
    backend with no limits at all (nothing to catch up on), until its view
    caught up or stalled. Only binds to backends its ledger judges wait: the
    requests for the unlimited backend complete while those for the limited
    one are still held."""
    async with (
        MockBackend(PROVIDER) as mock,
        MockBackend(MockSettings(ttft=0.01, output_tokens=2)) as unlimited,
    ):
        file = limited_config(
            tmp_path / "rq.toml", nats_url=isolated_server.url, backend_url=mock.url
        )
        config = with_open_backend(load_config(file, environ={}), unlimited.url)
        async with (
            Services(config, routers=0, backends=["b", "u"]) as services,
            Client(services.nc, tenant=TENANT) as client,
        ):
            js = client.js
            lagging = Projector(js, flush_interval=3600.0)
            await lagging.start()
            try:
                async with Services(config, backends=[], projector=False):
                    used = await submit(client, "first", LIMIT)
                    await await_all(client, used, within=10)
                more = await submit(client, "after the hand-over", LIMIT)
                opened = [await client.submit(f"open {n}", route="open") for n in range(3)]
                async with Services(config, backends=[], projector=False):
                    await await_all(client, opened, within=10)
                    held_back = await decisions(js, more)
                    await lagging.close()  # its last write: the view catches up
                    await await_all(client, more, within=20)
            finally:
                await lagging.close()
            routed = await decisions(js, [*used, *more])
    assert held_back == [], "bound to the limited backend before the view caught up"
    assert unlimited.stats().completed == 3
    assert_within_the_limit(mock, routed, 2 * LIMIT)


async def test_a_catching_up_binder_reads_the_stored_projection_when_its_watch_is_stale(
    tmp_path: Path, isolated_server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reproduces the review: a binder whose view had not moved for 3 s bound
    on it, but a watch can be stale (its consumer lost: StateView re-opens it
    only after up to two of its 5-s checks) while the stored projection is
    current. Here the new binder's watch delivers nothing once it has loaded
    the stored (lagging) projection; the projector then writes it all. On a
    stall the binder reads what is stored, so it knows the window is used:
    no 429, no window over the limit."""
    delivering = True
    real_seen = StateView._seen

    def seen(view: StateView, entry: Any) -> None:
        if delivering:
            real_seen(view, entry)

    monkeypatch.setattr(StateView, "_seen", seen)
    async with MockBackend(PROVIDER) as mock:
        file = limited_config(
            tmp_path / "rq.toml", nats_url=isolated_server.url, backend_url=mock.url
        )
        config = load_config(file, environ={})
        async with (
            Services(config, routers=0, backends=["b"]) as services,
            Client(services.nc, tenant=TENANT) as client,
        ):
            js = client.js
            lagging = Projector(js, flush_interval=3600.0)
            await lagging.start()
            try:
                async with Services(config, backends=[], projector=False):
                    used = await submit(client, "first", LIMIT)
                    await await_all(client, used, within=10)
                more = await submit(client, "after the hand-over", LIMIT)
                async with Services(config, backends=[], projector=False) as binder:
                    assert binder.routers[0].binding
                    delivering = False  # its watch goes stale
                    await lagging.close()  # stored: everything; the watch does not say so
                    await await_all(client, more, within=20)
            finally:
                await lagging.close()
            routed = await decisions(js, [*used, *more])
    assert_within_the_limit(mock, routed, 2 * LIMIT)


async def test_a_catching_up_binder_waits_at_most_ten_seconds_for_a_view_that_keeps_moving(
    tmp_path: Path, isolated_server: EmbeddedServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Reproduces the review: the catch-up had no overall bound, so a view
    that keeps moving but never reaches the log as the term began (a projector
    refolding a long backlog) held every bind for as long. Here the log is
    far ahead of a projection that moves one event every 0.2 s: the binder
    binds after 10 s, and says so."""
    caplog.set_level(logging.WARNING, logger="renqueue")
    async with MockBackend(MockSettings(ttft=0.01, output_tokens=2)) as mock:
        file = limited_config(
            tmp_path / "rq.toml", nats_url=isolated_server.url, backend_url=mock.url
        )
        config = load_config(file, environ={})
        async with (
            Services(config, routers=0, backends=["b"]) as services,
            Client(services.nc, tenant=TENANT) as client,
        ):
            js = client.js
            kv = await js.key_value(STATE_BUCKET)
            for n in range(200):  # the log is far ahead of any projection
                await js.publish(f"rq.evt.filler.f{n}.note", b"{}")

            async def slow_projection() -> None:
                seq = 0
                while True:
                    seq += 1
                    await kv.put(PROGRESS_KEY, encode_view(Progress(last_seq=seq, log_time=0.0)))
                    await asyncio.sleep(0.2)  # the pace of this fake projector

            moving = asyncio.create_task(slow_projection())
            try:
                handle = await client.submit("waits", route="chat")
                began = time.monotonic()
                async with Services(config, backends=[], projector=False):
                    await await_all(client, [handle], within=20)
                waited = time.monotonic() - began
            finally:
                moving.cancel()
                await asyncio.gather(moving, return_exceptions=True)
    gave_up = [r for r in caplog.records if "did not catch up" in r.getMessage()]
    assert len(gave_up) == 1, [r.getMessage() for r in caplog.records]
    assert 9.0 <= waited < 15.0
