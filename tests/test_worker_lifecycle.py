"""The worker's lease, shutdown and work stealing (issue #6 items 3, 9, 13).

- A killed worker's requests come back in seconds: the lease (``ack_wait``)
  is short and renewed while the run is alive.
- ``Worker.close()`` ends even when a run swallows a cancellation.
- Work moved between replicas of a pool more than once is never lost.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from renqueue import Client, Services, load_config, parse_config
from renqueue.backends import make_backend
from renqueue.backends.base import Delta
from renqueue.broker import EventLog
from renqueue.config import Config, WorkerConfig, parse_duration
from renqueue.errors import NatsNoRespondersError, NatsNotFoundError
from renqueue.mock import MockBackend, MockSettings
from renqueue.schema import (
    DISPATCH_STREAM,
    Dispatch,
    Started,
    Stolen,
    dispatch_subject,
    encode,
    kind_of,
    msg_id,
    worker_consumer,
)
from renqueue.services.worker import Worker

TENANT = "t"


async def until(check: Callable[[], Awaitable[bool]], what: str, within: float = 15.0) -> float:
    """Wait until ``check()``; the seconds it took."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    while not await check():
        if loop.time() - began > within:
            pytest.fail(f"timed out after {within} s waiting until {what}")
        await asyncio.sleep(0.02)
    return loop.time() - began


async def started_runs(js: Any, request_id: str) -> list[Started]:
    return [e for e in await EventLog(js).history(TENANT, request_id) if isinstance(e, Started)]


# ------------------------------------------------------------------ item 13


async def test_a_killed_workers_request_is_run_again_within_a_few_default_leases(
    tmp_path: Path, isolated_server: Any
) -> None:
    """kill -9 a worker mid-call: another worker starts the request again within a
    few times the default ``ack_wait``, not after a 30 s lease."""
    lease = parse_duration(WorkerConfig().ack_wait)
    assert lease <= 10, "a worker's lease is a few seconds, renewed while its run is alive"
    # ~6 s of generation: the kill lands mid-call.
    async with MockBackend(MockSettings(tokens_per_second=10, output_tokens=60)) as mock:
        file = tmp_path / "rq.toml"
        # No [worker] section: the default lease is what is tested.
        file.write_text(
            f'[nats]\nurl = "{isolated_server.url}"\n'
            f'[router]\ncapacity_refresh = "20ms"\n'
            f'[backends.b]\nbase_url = "{mock.url}"\nmodel = "mock"\n'
            f"[backends.b.limits]\nconcurrency = 2\n"
            f'[routes.chat]\nbackends = ["b"]\n'
        )
        config = load_config(file, environ={})
        env = {k: v for k, v in os.environ.items() if not k.startswith("RENQUEUE_")}
        async with (
            Services(config, backends=[]) as services,
            Client(services.nc, tenant=TENANT) as client,
        ):
            doomed = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "renqueue", "-c", str(file), "worker", "-b", "b",
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL, env={**env, "PYTHONUNBUFFERED": "1"},
            )  # fmt: skip
            try:
                handle = await client.submit("a long answer", route="chat")
                stream = handle.stream(timeout=20)
                await anext(stream)  # the doomed worker is mid-call
                await stream.aclose()
                async with Services(
                    config, routers=0, backends=["b"], provision_streams=False, name="survivor"
                ):

                    async def rerun() -> bool:
                        return len(await started_runs(services.js, handle.id)) >= 2

                    doomed.send_signal(signal.SIGKILL)
                    await doomed.wait()
                    recovered = await until(
                        rerun, "another worker started the request again", within=3 * lease
                    )
                    mock.update(tokens_per_second=0)  # let the new run finish at once
                    await handle.result(timeout=3 * lease)
            finally:
                if doomed.returncode is None:
                    doomed.kill()
                    await doomed.wait()
            runs = await started_runs(services.js, handle.id)
    print(f"time to recover from a kill -9: {recovered:.2f} s (ack_wait {lease:g} s)")
    assert [run.delivery for run in runs] == [1, 2]
    assert runs[0].worker != runs[1].worker


# ------------------------------------------------------------------ item 9


class SwallowsOneCancellation:
    """A backend whose stream swallows the first cancellation (as nats-py's fetch
    can on Python 3.11, see renqueue.tasks), then waits on."""

    name = "b"

    def __init__(self) -> None:
        self.calling = asyncio.Event()
        self.swallowed = 0

    async def stream(
        self, request: Any, *, priority: int | None = None, traceparent: str | None = None
    ) -> AsyncIterator[Delta]:
        self.calling.set()
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if self.swallowed == 0:
                    self.swallowed += 1
                    asyncio.current_task().uncancel()  # type: ignore[union-attr]
                    continue
                raise
        yield Delta()  # an async generator, as the protocol asks

    async def complete(
        self, request: Any, *, priority: int | None = None, traceparent: str | None = None
    ) -> Any:
        raise NotImplementedError

    async def close(self) -> None:
        return None


def one_backend(tmp_path: Path, url: str) -> Config:
    return parse_config(
        {
            "nats": {"data_dir": str(tmp_path / "nats"), "port": -1},
            "backends": {"b": {"base_url": url, "model": "m", "limits": {"concurrency": 2}}},
            "routes": {"chat": {"backends": ["b"]}},
            "worker": {"drain_timeout": "100ms", "retry_delay": "50ms"},
            "router": {"capacity_refresh": "20ms"},
        }
    )


async def test_stop_ends_even_when_a_run_swallows_a_cancellation(tmp_path: Path) -> None:
    async with MockBackend(MockSettings(output_tokens=4)) as mock:
        config = one_backend(tmp_path, mock.url)
        async with Services(config, backends=[]) as services:
            stubborn = SwallowsOneCancellation()
            worker = Worker(services.nc, services.js, config, "b", stubborn, name="stubborn")
            await worker.start()
            async with Client(services.nc, tenant=TENANT) as client:
                handle = await client.submit("x", route="chat")
                await asyncio.wait_for(stubborn.calling.wait(), 10)
                await asyncio.wait_for(worker.close(), 10)
                assert stubborn.swallowed == 1
                # The run was handed back (nak): a healthy worker completes it.
                adapter = make_backend("b", config.backends["b"])
                healthy = Worker(services.nc, services.js, config, "b", adapter, name="healthy")
                await healthy.start()
                try:
                    await handle.result(timeout=10)
                finally:
                    await healthy.close()
                    await adapter.close()
                runs = await started_runs(services.js, handle.id)
    assert [(run.worker, run.delivery) for run in runs] == [("stubborn", 1), ("healthy", 2)]


# ------------------------------------------------------------------ item 3


def pool(tmp_path: Path, url: str, replicas: list[str]) -> Config:
    return parse_config(
        {
            "nats": {"data_dir": str(tmp_path / "nats"), "port": -1},
            "backends": {
                name: {
                    "base_url": url,
                    "model": "m",
                    "pool": "llama",
                    "limits": {"concurrency": 1},
                }
                for name in replicas
            },
            "routes": {"chat": {"backends": replicas}},
        }
    )


async def queued(js: Any) -> list[str]:
    """The subjects of the dispatches waiting in RQ_DISPATCH, in stream order."""
    state = (await js.stream_info(DISPATCH_STREAM)).state
    subjects = []
    seq = state.first_seq
    while seq <= state.last_seq:
        try:
            raw = await js.get_msg(DISPATCH_STREAM, seq=seq, subject="rq.dispatch.>", next=True)
        except NatsNotFoundError:
            break
        subjects.append(raw.subject)
        seq = raw.seq + 1
    return subjects


async def test_work_moved_around_a_pool_twice_within_the_window_is_never_lost(
    tmp_path: Path,
) -> None:
    """A -> B -> C -> A: every move is stored, every source removed only after."""
    replicas = ["replica-a", "replica-b", "replica-c"]
    async with MockBackend(MockSettings(output_tokens=3)) as mock:
        config = pool(tmp_path, mock.url, replicas)
        async with (
            Services(config, routers=0, backends=[]) as services,
            Client(services.nc, tenant=TENANT) as client,
        ):
            js = services.js
            adapters = {name: make_backend(name, config.backends[name]) for name in replicas}
            # Not started: nothing fetches, so each move is made by steal() alone.
            a, b, c = (
                Worker(services.nc, js, config, name, adapters[name], name=name)
                for name in replicas
            )
            request = client.build_request("move me", route="chat")
            await js.publish(
                dispatch_subject("replica-a"),
                encode(Dispatch(request=request, backend="replica-a")),
                headers={"Nats-Msg-Id": msg_id(TENANT, request.id, "dispatch", 1)},
            )
            handle = client.handle(request.id)
            for thief, holder in ((b, "replica-b"), (c, "replica-c"), (a, "replica-a")):
                assert await thief.steal() == 1
                assert await queued(js) == [dispatch_subject(holder)]
            # Two idle replicas at once on the same queued dispatch: one copy.
            await asyncio.gather(b.steal(), c.steal())
            [where] = await queued(js)
            owner = {b: "replica-b", c: "replica-c"}
            worker = next(w for w, name in owner.items() if dispatch_subject(name) == where)
            await worker.start()
            try:
                result = await handle.result(timeout=10)
            finally:
                await worker.close()
                for adapter in adapters.values():
                    await adapter.close()
            moves = [
                e for e in await EventLog(js).history(TENANT, request.id) if isinstance(e, Stolen)
            ]
    assert result.backend == where.rsplit(".", 1)[-1]
    assert mock.stats().requests == 1
    assert [(m.from_backend, m.to_backend) for m in moves[:3]] == [
        ("replica-a", "replica-b"),
        ("replica-b", "replica-c"),
        ("replica-c", "replica-a"),
    ]
    # Each move has its own source message; the two thieves' race made one move.
    assert len({m.from_seq for m in moves}) == len(moves) >= 4


async def test_a_steal_whose_source_was_taken_meanwhile_is_no_error(tmp_path: Path) -> None:
    """The source of a move is acked (run by its own replica) or moved by another
    thief between the thief's read and its delete: the delete finds nothing, and
    that is not a failure of the steal loop (seen in the chaos run as
    ``sequence N not found``, err_code 10043, restarting the loop)."""
    replicas = ["replica-a", "replica-b"]
    async with MockBackend(MockSettings(output_tokens=3)) as mock:
        config = pool(tmp_path, mock.url, replicas)
        async with (
            Services(config, routers=0, backends=[]) as services,
            Client(services.nc, tenant=TENANT) as client,
        ):
            js = services.js
            adapter = make_backend("replica-b", config.backends["replica-b"])
            thief = Worker(services.nc, js, config, "replica-b", adapter, name="replica-b")
            request = client.build_request("taken meanwhile", route="chat")
            await js.publish(
                dispatch_subject("replica-a"),
                encode(Dispatch(request=request, backend="replica-a")),
                headers={"Nats-Msg-Id": msg_id(TENANT, request.id, "dispatch", 1)},
            )
            raw = await js.get_msg(
                DISPATCH_STREAM, seq=1, subject=dispatch_subject("replica-a"), next=True
            )
            # What the thief read is gone before it deletes it (acked by replica-a).
            await js.delete_msg(DISPATCH_STREAM, raw.seq)
            try:
                assert await thief._steal(raw, "replica-a") is True
            finally:
                await adapter.close()
            # The copy is stored on the thief's subject (its run claim decides
            # which of the two runs calls the backend).
            assert await queued(js) == [dispatch_subject("replica-b")]


async def test_a_stolen_request_whose_original_was_delivered_and_whose_worker_died_still_runs(
    tmp_path: Path,
) -> None:
    """The race seen in a chaos run (1 request lost): replica-a's worker takes
    its queued dispatch at the moment replica-b steals it. replica-a's run
    claims run 1; b's copy steps back. replica-a's worker then dies (kill -9).
    Its message must still be there to be delivered again (the thief must not
    delete a delivered original), and its redelivery must run (not hand over
    to a copy that stepped back): the request completes, with one backend call
    per run that got to call it."""
    replicas = ["replica-a", "replica-b"]
    async with MockBackend(MockSettings(output_tokens=3)) as mock:
        config = pool(tmp_path, mock.url, replicas)
        config = msgspec.structs.replace(
            config, worker=msgspec.structs.replace(config.worker, ack_wait="1s")
        )
        async with (
            Services(config, routers=0, backends=[]) as services,
            Client(services.nc, tenant=TENANT) as client,
        ):
            js = services.js
            request = client.build_request("stolen while delivered", route="chat")
            await js.publish(
                dispatch_subject("replica-a"),
                encode(Dispatch(request=request, backend="replica-a")),
                headers={"Nats-Msg-Id": msg_id(TENANT, request.id, "dispatch", 1)},
            )
            # The thief reads the queued original ...
            raw = await js.get_msg(
                DISPATCH_STREAM, seq=1, subject=dispatch_subject("replica-a"), next=True
            )
            # ... while replica-a's worker takes it and claims its run 1; that
            # worker then dies without acking (its lease runs out in 1 s).
            doomed = await js.pull_subscribe_bind(
                durable=worker_consumer("replica-a"), stream=DISPATCH_STREAM
            )
            [delivered] = await doomed.fetch(1, timeout=5)
            assert delivered.metadata.sequence.stream == raw.seq
            assert await EventLog(js).claim_run(TENANT, request.id, 1, 1)
            await doomed.unsubscribe()
            adapters = {name: make_backend(name, config.backends[name]) for name in replicas}
            thief = Worker(services.nc, js, config, "replica-b", adapters["replica-b"], name="b")
            assert await thief._steal(raw, "replica-a") is True
            owner = Worker(services.nc, js, config, "replica-a", adapters["replica-a"], name="a")
            await thief.start()  # its copy steps back: run 1 is claimed
            await owner.start()  # replica-a's message comes back after its lease
            try:
                result = await client.handle(request.id).result(timeout=15)
            finally:
                await thief.close()
                await owner.close()
                for adapter in adapters.values():
                    await adapter.close()
            runs = await started_runs(js, request.id)
    assert result.backend == "replica-a"
    assert [(run.worker, run.delivery) for run in runs] == [("a", 2)]
    assert mock.stats().requests == 1


async def test_a_request_stolen_there_and_back_whose_first_run_died_still_runs(
    tmp_path: Path,
) -> None:
    """Seen in the chaos cluster-kill9 run (1 request lost): replica-a's worker takes its
    queued dispatch (claiming run 1) as replica-b steals it (a copy on b, the delivered
    original kept); a's run dies (the whole cluster was killed under it). Later a's thief
    steals b's copy back (a second copy, on a). Every copy's first run is run 1, which is
    claimed: each steps back. So the original's redelivery must run, not hand over to
    a copy "moved on": the request completes, one backend call."""
    replicas = ["replica-a", "replica-b"]
    async with MockBackend(MockSettings(output_tokens=3)) as mock:
        config = pool(tmp_path, mock.url, replicas)
        config = msgspec.structs.replace(
            config, worker=msgspec.structs.replace(config.worker, ack_wait="1s")
        )
        async with (
            Services(config, routers=0, backends=[]) as services,
            Client(services.nc, tenant=TENANT) as client,
        ):
            js = services.js
            request = client.build_request("stolen there and back", route="chat")
            await js.publish(
                dispatch_subject("replica-a"),
                encode(Dispatch(request=request, backend="replica-a")),
                headers={"Nats-Msg-Id": msg_id(TENANT, request.id, "dispatch", 1)},
            )
            raw = await js.get_msg(
                DISPATCH_STREAM, seq=1, subject=dispatch_subject("replica-a"), next=True
            )
            doomed = await js.pull_subscribe_bind(
                durable=worker_consumer("replica-a"), stream=DISPATCH_STREAM
            )
            [delivered] = await doomed.fetch(1, timeout=5)
            assert delivered.metadata.sequence.stream == raw.seq
            assert await EventLog(js).claim_run(TENANT, request.id, 1, 1)
            await doomed.unsubscribe()  # its worker dies: redelivered after 1 s
            adapters = {name: make_backend(name, config.backends[name]) for name in replicas}
            b = Worker(services.nc, js, config, "replica-b", adapters["replica-b"], name="b")
            a = Worker(services.nc, js, config, "replica-a", adapters["replica-a"], name="a")
            assert await b._steal(raw, "replica-a") is True  # a copy on b; the original kept
            copy = await js.get_msg(
                DISPATCH_STREAM, seq=1, subject=dispatch_subject("replica-b"), next=True
            )
            assert await a._steal(copy, "replica-b") is True  # and back: a copy on a
            assert sorted(await queued(js)) == [dispatch_subject("replica-a")] * 2
            await a.start()
            try:
                result = await client.handle(request.id).result(timeout=15)
            finally:
                await a.close()
                for adapter in adapters.values():
                    await adapter.close()
            runs = await started_runs(js, request.id)
    assert result.backend == "replica-a"
    assert [(run.worker, run.delivery) for run in runs] == [("a", 2)]
    assert mock.stats().requests == 1


class BrokerSilentTwice:
    """A backend call interrupted twice by a broker that does not answer (as a
    run's publishes are while a stream elects a leader), then answering."""

    name = "b"

    def __init__(self) -> None:
        self.calls = 0

    async def stream(
        self, request: Any, *, priority: int | None = None, traceparent: str | None = None
    ) -> AsyncIterator[Delta]:
        self.calls += 1
        if self.calls <= 2:
            raise NatsNoRespondersError("nats: no response from stream")
        yield Delta(text="answered")

    async def complete(
        self, request: Any, *, priority: int | None = None, traceparent: str | None = None
    ) -> Any:
        raise NotImplementedError

    async def close(self) -> None:
        return None


async def test_a_broker_that_does_not_answer_does_not_use_up_the_retry_budget(
    tmp_path: Path,
) -> None:
    """Seen in the chaos cluster run: while a NATS node was down, runs failing
    with 'no response from stream' were counted as failed runs, used up
    ``worker.max_deliver`` in a second, then the delivery limit (retried every
    200 ms), and ended ``failed`` (``undeliverable``) after ~10 s of leader
    election. The broker's silence is not the request's failure: with a
    retry budget of one run, the request still completes."""
    async with MockBackend(MockSettings(output_tokens=4)) as mock:
        config = one_backend(tmp_path, mock.url)
        config = msgspec.structs.replace(
            config, worker=msgspec.structs.replace(config.worker, max_deliver=1)
        )
        async with Services(config, backends=[]) as services:
            silent = BrokerSilentTwice()
            worker = Worker(services.nc, services.js, config, "b", silent, name="w")
            await worker.start()
            try:
                async with Client(services.nc, tenant=TENANT) as client:
                    handle = await client.submit("x", route="chat")
                    result = await handle.result(timeout=10)
            finally:
                await worker.close()
            retries = [
                e
                for e in await EventLog(services.js).history(TENANT, handle.id)
                if kind_of(e) == "retrying"
            ]
    assert result.text == "answered"
    assert silent.calls == 3
    assert retries == []
