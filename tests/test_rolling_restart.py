"""A rolling restart (an upgrade) loses no request: docs/operations.md#upgrade.

A deployment of separate processes, as an operator runs one: a ``renqueue router`` and a
``renqueue worker -b b`` process on one nats-server, with a mock backend over loopback.
Under a steady load, each process in turn is replaced, the way docs/operations.md says
to upgrade: its replacement is started (a second router stands by for the binder's
lease; a second worker shares the backend's consumer), and once it runs, the old one
gets SIGTERM (its graceful stop: a router hands back the requests it holds and gives up
the lease, a worker finishes its in-flight calls within ``worker.drain_timeout`` and
hands back the rest) and must exit 0. Every request must then end in exactly one
terminal event, a completion, and nothing may be left waiting or dead-lettered.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

from test_restarts import (
    LEVELS,
    TENANT,
    RouterProcess,
    assert_nothing_left,
    await_all,
    client_of,
    describe,
    until,
    write_config,
)

from renqueue.broker import EmbeddedServer, EventLog
from renqueue.mock import MockBackend, MockSettings
from renqueue.schema import Completed, is_terminal, kind_of


async def submit_until(client: Any, stop: asyncio.Event, handles: list[Any]) -> None:
    """Requests over the five levels, one every 100 ms (well within the backend's pace),
    until ``stop``."""
    index = 0
    while not stop.is_set():
        handles.append(
            await client.submit(
                f"request {index}",
                route="chat",
                priority=LEVELS[index % len(LEVELS)],
                request_id=f"roll-{index:04d}",
            )
        )
        index += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.1)


async def test_restarting_every_process_one_at_a_time_under_load_ends_each_request_once(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    slots = 4
    settings = MockSettings(ttft=0.03, output_tokens=8, tokens_per_second=200, concurrency=slots)
    async with MockBackend(settings) as mock:
        config = write_config(
            tmp_path / "rq.toml", nats_url=isolated_server.url, backend_url=mock.url, slots=slots
        )
        fleet = [
            RouterProcess(config, tmp_path / "router.log"),
            RouterProcess(config, tmp_path / "worker.log", role="worker", args=("-b", "b")),
        ]
        started = list(fleet)
        try:
            for process in fleet:
                await process.start()
            async with client_of(isolated_server.url) as (client, nc):
                handles: list[Any] = []
                stop = asyncio.Event()
                load = asyncio.create_task(submit_until(client, stop, handles))
                try:
                    for old in fleet:
                        before = mock.stats().completed

                        async def served(before: int = before) -> bool:
                            return mock.stats().completed >= before + 3

                        # Each process is replaced while requests are being served.
                        await until(served, f"requests complete before the {old.role} restarts")
                        new = RouterProcess(
                            config,
                            tmp_path / f"{old.role}-new.log",
                            role=old.role,
                            args=old.args,
                        )
                        started.append(new)
                        await new.start()
                        assert await old.terminate() == 0, old.text()[-3000:]
                    await until(served, "requests complete after the last restart")
                finally:
                    stop.set()
                    await load
                assert len(handles) >= 20
                await await_all(client, handles, within=30)
                log = EventLog(nc.jetstream())
                problems = []
                for handle in handles:
                    events = await log.history(TENANT, handle.id)
                    terminals = [e for e in events if is_terminal(e)]
                    kinds = [kind_of(e) for e in events]
                    if not (
                        len(terminals) == 1
                        and isinstance(terminals[0], Completed)
                        and kinds.count("submitted") == 1
                    ):
                        problems.append(f"{handle.id}: {describe(events)}")
                assert not problems, "not exactly one completion:\n" + "\n".join(problems)
                await assert_nothing_left(nc.jetstream())
        finally:
            for process in started:
                process.cleanup()
            for process in started:
                if process.proc is not None:
                    await asyncio.wait_for(process.proc.wait(), 10)
