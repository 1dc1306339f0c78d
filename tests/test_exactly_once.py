"""Exactly one terminal event, whatever the duplicate window (issue #6 items 4, 5).

The terminal claim (a create in the services-only ``rq-terminal`` KV bucket)
decides a request's one outcome, and every run checks it before it calls the
backend. These tests run with a duplicate window of one second and let it pass
(checked, not slept: a probe publish is re-sent until JetStream stores it
again), then deliver the same work again: as a second dispatch of the same
attempt, and as a zombie worker that finishes after someone else did.

Requests whose messages run out of deliveries end ``failed`` (``undeliverable``)
with a dead-letter copy (the advisory reader), and graceful worker restarts do
not use up a request's retry budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
from _waits import until

from renqueue import Client, RequestFailedError, RequestRejectedError, Services, load_config
from renqueue.broker import EventLog, JetStreamApi, connect, provision, read_subject, reply_error
from renqueue.config import Config
from renqueue.errors import NatsTimeoutError
from renqueue.mock import MockBackend, MockSettings
from renqueue.policy import expired_waiting
from renqueue.schema import (
    DISPATCH_DECODER,
    DISPATCH_STREAM,
    DLQ_STREAM,
    REQUESTS_STREAM,
    ROUTER_DELIVERY_BACKSTOP,
    TERMINAL_BUCKET,
    TOKEN_DECODER,
    TOKENS_STREAM,
    Completed,
    Dispatch,
    Started,
    Submitted,
    TerminalClaim,
    TokenChunk,
    Usage,
    dispatch_subject,
    dlq_subject,
    encode,
    is_terminal,
    kind_of,
    msg_id,
    request_subject,
    router_consumer,
    terminal_key,
    token_subject,
    worker_consumer,
)

TENANT = "t"


def write_config(path: Path, *, nats_url: str, backend_url: str, extra: str = "") -> Config:
    """Backend ``b`` behind route ``chat``; a one-second duplicate window."""
    path.write_text(
        f'[nats]\nurl = "{nats_url}"\nduplicate_window = "1s"\n'
        f'[router]\ncapacity_refresh = "20ms"\n'
        f'[worker]\nack_wait = "1s"\nretry_delay = "50ms"\ndrain_timeout = "100ms"\n{extra}'
        f'[backends.b]\nbase_url = "{backend_url}"\nmodel = "mock"\n'
        f"[backends.b.limits]\nconcurrency = 2\n"
        f'[routes.chat]\nbackends = ["b"]\n'
    )
    return load_config(path, environ={})


async def window_passed(js: Any) -> None:
    """Wait until the duplicate window of everything published so far has passed:
    a probe published now is stored again once its own window is over."""
    subject = dispatch_subject("probe-nobody-serves")
    probe = f"probe-{os.urandom(4).hex()}"
    await js.publish(subject, b"probe", headers={"Nats-Msg-Id": probe})

    async def stored_again() -> bool:
        ack = await js.publish(subject, b"probe", headers={"Nats-Msg-Id": probe})
        return not ack.duplicate

    await until(stored_again, "the duplicate window has passed", within=10)


async def histories(js: Any, request_id: str) -> list[Any]:
    return await EventLog(js).history(TENANT, request_id)


def describe(events: list[Any]) -> str:
    return ", ".join(kind_of(e) for e in events)


@asynccontextmanager
async def routers_only(config: Config) -> AsyncIterator[tuple[Services, Client]]:
    async with (
        Services(config, backends=[]) as services,
        Client(services.nc, tenant=TENANT) as client,
    ):
        yield services, client


def worker_only(config: Config, name: str) -> Services:
    return Services(config, routers=0, backends=["b"], provision_streams=False, name=name)


async def test_a_second_dispatch_after_the_duplicate_window_neither_calls_nor_ends_again(
    tmp_path: Path, isolated_server: Any
) -> None:
    async with MockBackend(MockSettings(output_tokens=4)) as mock:
        config = write_config(
            tmp_path / "rq.toml", nats_url=isolated_server.url, backend_url=mock.url
        )
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            js = services.js
            handle = await client.submit("once", route="chat")
            first = await handle.result(timeout=10)
            [submitted] = [e for e in await histories(js, handle.id) if isinstance(e, Submitted)]
            await window_passed(js)
            # The same routing decision again (a router that resumed with a
            # stale hold, or a resubmit): stored, as its id is out of the window.
            again = Dispatch(request=submitted.request, backend="b", attempt=1)
            ack = await js.publish(
                dispatch_subject("b"),
                encode(again),
                headers={"Nats-Msg-Id": msg_id(TENANT, handle.id, "dispatch", 1)},
            )
            assert not ack.duplicate

            async def handled() -> bool:
                info = await js.consumer_info(DISPATCH_STREAM, worker_consumer("b"))
                return info.num_pending == 0 and info.num_ack_pending == 0

            await until(handled, "the second dispatch is taken and acked")
            events = await histories(js, handle.id)
    assert mock.stats().requests == 1, describe(events)
    terminals = [e for e in events if is_terminal(e)]
    assert len(terminals) == 1, describe(events)
    assert isinstance(terminals[0], Completed)
    assert terminals[0].text == first.text
    assert sum(isinstance(e, Started) for e in events) == 1


async def test_a_resubmit_after_the_duplicate_window_is_not_routed_again(
    tmp_path: Path, isolated_server: Any
) -> None:
    """Issue 30: past the duplicate window a resubmit is stored again; it used
    to get a second ``submitted`` and ``routed`` event and a dispatch the
    worker dropped. A request id that ended is not admitted again."""
    async with MockBackend(MockSettings(output_tokens=4)) as mock:
        config = write_config(
            tmp_path / "rq.toml", nats_url=isolated_server.url, backend_url=mock.url
        )
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            js = services.js
            handle = await client.submit("once", route="chat")
            await handle.result(timeout=10)
            await window_passed(js)
            again = await client.submit("once", route="chat", request_id=handle.id)
            assert not again.duplicate  # stored: out of the window

            async def read() -> bool:
                info = await js.stream_info(REQUESTS_STREAM)
                return info.state.messages == 0  # a work queue: acked once read

            await until(read, "a router read the resubmit")
            events = await histories(js, handle.id)
    assert [kind_of(e) for e in events] == ["submitted", "routed", "started", "completed"]
    assert mock.stats().requests == 1


class WorkerProcess:
    """``renqueue worker -b b`` in a process of its own (to freeze and resume)."""

    def __init__(self, config: Path, log: Path) -> None:
        self.config = config
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RENQUEUE_")}
        with self.log.open("wb") as out:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "renqueue", "-c", str(self.config), "--log-json",
                "worker", "-b", "b",
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=out, env={**env, "PYTHONUNBUFFERED": "1"},
            )  # fmt: skip

        async def started() -> bool:
            assert self.proc is not None
            if self.proc.returncode is not None:
                pytest.fail(f"worker process exited; its log:\n{self.text()[-3000:]}")
            return "worker started" in self.text()

        await until(started, "the worker process started", within=20)

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGKILL)
            await asyncio.wait_for(self.proc.wait(), 10)


async def test_a_zombie_worker_finishing_after_the_duplicate_window_records_no_second_end(
    tmp_path: Path, isolated_server: Any
) -> None:
    # ~1.5 s of generation: frozen mid-call, the run outlives its lease.
    settings = MockSettings(tokens_per_second=20, output_tokens=30)
    async with MockBackend(settings) as mock:
        file = tmp_path / "rq.toml"
        config = write_config(file, nats_url=isolated_server.url, backend_url=mock.url)
        zombie = WorkerProcess(file, tmp_path / "zombie.log")
        try:
            async with routers_only(config) as (services, client):
                js = services.js
                await zombie.start()
                handle = await client.submit("a long answer", route="chat")
                stream = handle.stream(timeout=10)
                await anext(stream)  # the zombie-to-be is mid-call
                await stream.aclose()
                zombie.signal(signal.SIGSTOP)
                async with worker_only(config, "replacement"):
                    await handle.result(timeout=15)
                await window_passed(js)
                zombie.signal(signal.SIGCONT)  # it finishes its call, late

                async def zombie_done() -> bool:
                    ends = [e for e in await histories(js, handle.id) if is_terminal(e)]
                    return len(ends) > 1 or "duplicate terminal event dropped" in zombie.text()

                await until(zombie_done, "the zombie finished its run")
                events = await histories(js, handle.id)
        finally:
            await zombie.kill()
    terminals = [e for e in events if is_terminal(e)]
    assert len(terminals) == 1, describe(events)
    assert isinstance(terminals[0], Completed)
    assert terminals[0].delivery > 1  # the replacement's run
    assert mock.stats().requests == 2  # both runs called the backend; one outcome counts


async def test_a_claim_whose_event_is_missing_is_published_by_the_next_run(
    tmp_path: Path, isolated_server: Any
) -> None:
    """A crash between the claim and the publish leaves a claim without its event:
    the request's next run publishes the claimed event instead of calling the backend."""
    async with MockBackend(MockSettings(output_tokens=4)) as mock:
        config = write_config(
            tmp_path / "rq.toml", nats_url=isolated_server.url, backend_url=mock.url
        )
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            request = client.build_request("claimed", route="chat")
            claimed = Completed(
                request_id=request.id,
                tenant=TENANT,
                at=1.0,
                backend="b",
                attempt=1,
                delivery=1,
                text="from the claim",
                usage=Usage(),
                cost=0.0,
            )
            await services.js.publish(
                f"$KV.{TERMINAL_BUCKET}.{terminal_key(TENANT, request.id)}",
                encode(TerminalClaim(event=claimed, delivery=1, seq=0)),
            )
            handle = await client.submit_request(request)
            result = await handle.result(timeout=10)

            async def closed() -> bool:
                # Read from the store: a live follower can miss a chunk that is
                # published while it subscribes (issue #6 item 6, the client's).
                raws = await read_subject(
                    client.nc, client.js, TOKENS_STREAM, token_subject(TENANT, request.id)
                )
                return [TOKEN_DECODER.decode(data) for _, data in raws] == [
                    # Closed with the claimed answer's finish reason and usage.
                    TokenChunk(request_id=request.id, delivery=1, seq=0, final=True, usage=Usage())
                ]

            await until(closed, "the claim's final chunk is stored", within=5)
            events = await histories(services.js, request.id)
    assert result.text == "from the claim"
    assert mock.stats().requests == 0
    assert [e for e in events if is_terminal(e)] == [claimed]


async def pull_and_nak(js: Any, stream: str, consumer: str, times: int) -> None:
    """Play a consumer that takes a message and never finishes it, ``times`` times."""
    psub = await js.pull_subscribe_bind(durable=consumer, stream=stream)
    try:
        for _ in range(times):
            [msg] = await psub.fetch(batch=1, timeout=10)
            await msg.nak()
        # The consumer looks for more: the server gives up on the message
        # (that is when it announces it) and has nothing to deliver.
        with pytest.raises(NatsTimeoutError):
            await psub.fetch(batch=1, timeout=1)
    finally:
        await psub.unsubscribe()


async def assert_failed_undeliverable(client: Client, handle: Any, stage: str) -> None:
    with pytest.raises(RequestFailedError) as info:
        await handle.result(timeout=15)
    assert info.value.error_type == "undeliverable"
    js = client.js
    dead = await js.get_last_msg(DLQ_STREAM, dlq_subject(stage))
    assert dead.headers is not None
    assert dead.headers["Rq-Request-Id"] == handle.id
    assert dead.headers["Rq-Reason"].startswith("undeliverable:")
    for name in (REQUESTS_STREAM, DISPATCH_STREAM):
        assert (await js.stream_info(name)).state.messages == 0


async def test_a_dispatch_that_runs_out_of_deliveries_fails_undeliverable_with_a_dead_letter(
    tmp_path: Path, isolated_server: Any
) -> None:
    async with MockBackend(MockSettings(output_tokens=4)) as mock:
        config = write_config(
            tmp_path / "rq.toml",
            nats_url=isolated_server.url,
            backend_url=mock.url,
            extra="max_deliver = 1\ndelivery_limit = 2\n",
        )
        # Routers (and the advisory reader) here; no worker: the test plays one
        # that takes the dispatch twice and never finishes it.
        async with routers_only(config) as (services, client):
            handle = await client.submit("doomed", route="chat")
            await pull_and_nak(services.js, DISPATCH_STREAM, worker_consumer("b"), times=2)
            await assert_failed_undeliverable(client, handle, "dispatch")
            events = await histories(services.js, handle.id)
    assert [kind_of(e) for e in events] == ["submitted", "routed", "failed"]
    assert mock.stats().requests == 0


@pytest.mark.parametrize("how", ["submitted", "requeued"])
async def test_a_request_that_runs_out_of_router_deliveries_fails_undeliverable(
    tmp_path: Path, isolated_server: Any, how: str
) -> None:
    async with MockBackend(MockSettings(output_tokens=4)) as mock:
        path = tmp_path / "rq.toml"
        write_config(path, nats_url=isolated_server.url, backend_url=mock.url)
        path.write_text(path.read_text().replace("[router]\n", "[router]\nmax_deliver = 2\n"))
        config = load_config(path, environ={})
        # A worker process (which runs the advisory reader) and no router: the
        # test plays a router that takes the request and never routes it, until
        # the router consumers' backstop (a router's own nak, as when it stops,
        # does not count against router.max_deliver: only failed dispatches do).
        async with (
            Services(config, routers=0, backends=["b"]) as services,
            Client(services.nc, tenant=TENANT) as client,
        ):
            if how == "submitted":
                handle = await client.submit("doomed", route="chat", priority="normal")
            else:
                # Put back by the services (five subject tokens): still its tenant's.
                request = client.build_request("doomed", route="chat", priority="normal")
                again = msgspec.structs.replace(request, requeues=1)
                await services.js.publish(
                    request_subject("normal", TENANT, requeue=True),
                    encode(again),
                    headers={"Nats-Msg-Id": msg_id(TENANT, again.id, "requeue", 1)},
                )
                handle = client.handle(again.id)
            await pull_and_nak(
                services.js,
                REQUESTS_STREAM,
                router_consumer("normal"),
                2 * ROUTER_DELIVERY_BACKSTOP,
            )
            await assert_failed_undeliverable(client, handle, "requests")
    assert mock.stats().requests == 0


async def test_graceful_worker_restarts_do_not_use_up_a_requests_retry_budget(
    tmp_path: Path, isolated_server: Any
) -> None:
    # ~4 s a call: each restart hands the run back mid-call.
    async with MockBackend(MockSettings(tokens_per_second=10, output_tokens=40)) as mock:
        config = write_config(
            tmp_path / "rq.toml",
            nats_url=isolated_server.url,
            backend_url=mock.url,
            extra="max_deliver = 1\n",
        )
        restarts = 2  # > max_deliver
        async with routers_only(config) as (services, client):
            js = services.js
            handle = await client.submit("survive the restarts", route="chat")
            for run in range(1, restarts + 1):
                async with worker_only(config, f"restart-{run}"):

                    async def running(run: int = run) -> bool:
                        return any(
                            isinstance(e, Started) and e.delivery == run
                            for e in await histories(js, handle.id)
                        )

                    await until(running, f"run {run} started")
                # Closed: its run was cancelled and handed back (nak).
            mock.update(tokens_per_second=0)
            async with worker_only(config, "last"):
                await handle.result(timeout=15)
            events = await histories(js, handle.id)
    [end] = [e for e in events if is_terminal(e)]
    assert isinstance(end, Completed)
    assert end.delivery == restarts + 1
    assert [e.delivery for e in events if isinstance(e, Started)] == [1, 2, 3]


async def test_another_tenant_cannot_pre_occupy_a_requests_outcome_or_run(
    tmp_path: Path, isolated_server: Any
) -> None:
    """Tenants may publish into RQ_EVENTS (their own ``cancel_requested`` subjects)
    with any ``Nats-Msg-Id``: ids naming another tenant's terminal event or run
    must not keep that request from running or ending."""
    async with MockBackend(MockSettings(output_tokens=4)) as mock:
        path = tmp_path / "rq.toml"
        write_config(path, nats_url=isolated_server.url, backend_url=mock.url)
        # In a pool: its runs are claimed (a stolen copy may race the original).
        path.write_text(
            path.read_text().replace('model = "mock"\n', 'model = "mock"\npool = "p"\n')
        )
        config = load_config(path, environ={})
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            request = client.build_request("mine", route="chat")
            for forged in ("terminal", "started:1:1", "final"):
                await services.js.publish(
                    "rq.evt.mallory.x.cancel_requested",
                    b"{}",
                    headers={"Nats-Msg-Id": msg_id(TENANT, request.id, *forged.split(":"))},
                )
            handle = await client.submit_request(request)
            result = await handle.result(timeout=10)
            events = await histories(services.js, request.id)
    assert result.text
    assert [kind_of(e) for e in events] == ["submitted", "routed", "started", "completed"]
    assert mock.stats().requests == 1


async def test_followers_of_a_leader_that_runs_out_of_deliveries_run_on_their_own(
    tmp_path: Path, isolated_server: Any
) -> None:
    """Seen in a chaos run (1 request lost): a coalescing leader ended ``failed``
    (``undeliverable``) by the advisory reader left its follower waiting on it
    forever. Its followers run on their own, as for any leader that ends for a
    reason of its own: each is routed again, and ends."""
    async with MockBackend(MockSettings(output_tokens=4)) as mock:
        config = write_config(
            tmp_path / "rq.toml",
            nats_url=isolated_server.url,
            backend_url=mock.url,
            extra="max_deliver = 1\ndelivery_limit = 2\n",
        )
        async with routers_only(config) as (services, client):
            js = services.js
            leader = await client.submit("the same question", route="chat", coalesce=True)

            async def routed(request_id: str) -> bool:
                return any(kind_of(e) == "routed" for e in await histories(js, request_id))

            await until(lambda: routed(leader.id), "the leader is routed")
            follower = await client.submit("the same question", route="chat", coalesce=True)

            async def coalesced() -> bool:
                return any(kind_of(e) == "coalesced" for e in await histories(js, follower.id))

            await until(coalesced, "the second request follows the first")
            # No worker: the test plays one that takes every dispatch and never
            # finishes it (each runs out after two deliveries).
            psub = await js.pull_subscribe_bind(
                durable=worker_consumer("b"), stream=DISPATCH_STREAM
            )
            taken: list[str] = []

            async def take_and_nak() -> None:
                while True:
                    with contextlib.suppress(NatsTimeoutError):
                        for msg in await psub.fetch(batch=1, timeout=0.5):
                            taken.append(DISPATCH_DECODER.decode(msg.data).request.id)
                            await msg.nak()

            playing = asyncio.create_task(take_and_nak())
            try:
                outcomes = await asyncio.gather(
                    leader.result(timeout=20), follower.result(timeout=20), return_exceptions=True
                )
            finally:
                playing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await playing
                await psub.unsubscribe()
            events = await histories(js, follower.id)
    assert [getattr(o, "error_type", o) for o in outcomes] == ["undeliverable", "undeliverable"]
    # The follower was routed on its own (its own dispatch), once its leader failed.
    assert taken == [leader.id, leader.id, follower.id, follower.id]
    assert [kind_of(e) for e in events if is_terminal(e)] == ["failed"]


async def test_a_rejected_copy_and_its_correction_in_one_batch_run_the_correction_once(
    tmp_path: Path, isolated_server: Any
) -> None:
    """Review of issue 30's fix: a request rejected for its old-style
    ``Nats-Msg-Id`` and sent again with the right header, both read in one
    fetch, was admitted, routed and dropped by the worker (the claims of a
    batch are looked up once, before the rejection was written). A batch's
    good requests are now taken before its rejections (``make fuzz``), so the
    correction is admitted first and runs once, to its own end; the bad copy
    is then a copy of an admitted request: dead-lettered on its own, ending
    nothing. Nothing is routed that a worker drops."""
    async with MockBackend(MockSettings(output_tokens=4)) as mock:
        config = write_config(
            tmp_path / "rq.toml", nats_url=isolated_server.url, backend_url=mock.url
        )
        nc = await connect(isolated_server.url, name="before-the-router")
        try:
            await provision(nc, config)
            js = nc.jetstream()
            request = Client(nc, tenant=TENANT).build_request(
                "hi", route="chat", request_id="same-batch"
            )
            data, subject = msgspec.json.encode(request), request_subject("normal", TENANT)
            await js.publish(subject, data, headers={"Nats-Msg-Id": request.id})  # no tenant
            await js.publish(subject, data, headers={"Nats-Msg-Id": msg_id(TENANT, request.id)})
        finally:
            await nc.close()
        async with Services(config) as services:
            js = services.js

            async def read() -> bool:
                info = await js.stream_info(REQUESTS_STREAM)
                return info.state.messages == 0  # a work queue: acked once read

            await until(read, "a router read both copies")

            async def ended() -> bool:
                return "completed" in [kind_of(e) for e in await histories(js, request.id)]

            await until(ended, "the correction completed")
            events = await histories(js, request.id)
            dead = await js.get_last_msg(DLQ_STREAM, dlq_subject("requests"))
    assert [kind_of(e) for e in events] == ["submitted", "routed", "started", "completed"], (
        describe(events)
    )
    # The bad copy's dead letter is its own, and says it ended nothing.
    reason = (dead.headers or {})["Rq-Reason"]
    assert reason.startswith("malformed"), dead.headers
    assert "this copy was not run and does not end it" in reason
    assert dead.seq == 1
    assert mock.stats().requests == 1


async def test_the_message_that_ended_a_request_read_again_by_a_new_binder_is_no_dead_letter(
    tmp_path: Path, isolated_server: Any
) -> None:
    """Review of issue 30's fix: a router that ended a request when it read it
    (expired here) and stopped before acking its message leaves the message to
    the next binder, which re-creates the router consumers
    (``renew_router_consumers``): the message comes again as delivery 1. It
    is the message that ended the request, not a resubmit: acked without an
    ``already_ended`` dead letter (docs/wire-format.md, *One outcome per
    request id*), which ``renqueue dlq requeue`` would have run again."""
    async with MockBackend(MockSettings(output_tokens=4)) as mock:
        config = write_config(
            tmp_path / "rq.toml", nats_url=isolated_server.url, backend_url=mock.url
        )
        nc = await connect(isolated_server.url, name="the-router-that-stopped")
        try:
            await provision(nc, config)
            js = nc.jetstream()
            request = Client(nc, tenant=TENANT).build_request(
                "hi", route="chat", request_id="ended-then-stopped"
            )
            subject = request_subject("normal", TENANT)
            headers = {"Nats-Msg-Id": msg_id(TENANT, request.id)}
            await js.publish(subject, msgspec.json.encode(request), headers=headers)
            # What that router recorded before it stopped: the outcome, no ack.
            assert await EventLog(js).finish(expired_waiting(request, time.time()))
        finally:
            await nc.close()
        async with Services(config) as services:
            js = services.js

            async def read() -> bool:
                info = await js.stream_info(REQUESTS_STREAM)
                return info.state.messages == 0  # a work queue: acked once read

            await until(read, "the new binder read the message")
            events = await histories(js, request.id)
            dead = (await js.stream_info(DLQ_STREAM)).state.messages
    assert [kind_of(e) for e in events] == ["expired"], describe(events)
    assert dead == 0
    assert mock.stats().requests == 0


async def test_a_refused_copy_whose_dead_letter_failed_gets_it_when_delivered_again(
    tmp_path: Path, isolated_server: Any
) -> None:
    """Review of issue 30's fix: the ``already_ended`` dead letter was written
    on a copy's first delivery only; one that failed (the DLQ stream
    unreachable) naks the copy, and its next delivery was acked without one,
    so the copy docs/wire-format.md promises in ``RQ_DLQ`` was never kept."""
    async with MockBackend(MockSettings(output_tokens=4)) as mock:
        config = write_config(
            tmp_path / "rq.toml", nats_url=isolated_server.url, backend_url=mock.url
        )
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            js = services.js
            request = client.build_request("hi", route="chat", request_id="dlq-away")
            data, subject = msgspec.json.encode(request), request_subject("normal", TENANT)
            await js.publish(subject, data, headers={"Nats-Msg-Id": request.id})  # no tenant
            with pytest.raises(RequestRejectedError):
                await client.handle(request.id).result(timeout=10)
            # The dead letters cannot be written now.
            assert reply_error(await JetStreamApi(js).call(f"STREAM.DELETE.{DLQ_STREAM}")) is None
            await js.publish(subject, data, headers={"Nats-Msg-Id": msg_id(TENANT, request.id)})

            async def tried_twice() -> bool:
                info = await js.consumer_info(REQUESTS_STREAM, router_consumer("normal"))
                return info.num_redelivered > 0

            await until(tried_twice, "the copy was refused and delivered again")
            await provision(services.nc, config)  # the DLQ stream back

            async def read() -> bool:
                info = await js.stream_info(REQUESTS_STREAM)
                return info.state.messages == 0  # a work queue: acked once read

            await until(read, "a router refused the copy")
            dead = await js.get_last_msg(DLQ_STREAM, dlq_subject("requests"))
            events = await histories(js, request.id)
    assert (dead.headers or {})["Rq-Reason"].startswith("already_ended"), dead.headers
    assert dead.data == data
    assert [kind_of(e) for e in events] == ["rejected"], describe(events)
    assert mock.stats().requests == 0
