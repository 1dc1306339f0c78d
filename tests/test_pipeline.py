"""End to end: client -> priority subject -> router -> backend subject -> worker -> mock LLM.

Each test runs its own embedded nats-server (started by Services on a free
port in a temp dir) and real mock backends over loopback HTTP.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
import pytest
from _waits import until
from nats.aio.client import Client as NatsClient
from prometheus_client import REGISTRY

from renqueue import (
    Client,
    RequestExpiredError,
    RequestFailedError,
    RequestRejectedError,
    Services,
    parse_config,
)
from renqueue.broker import DeadLetters, EventLog, read_subject
from renqueue.config import Config
from renqueue.errors import NatsNotFoundError, TenantBacklogFullError
from renqueue.mock import MockBackend, MockSettings
from renqueue.schema import (
    DLQ_STREAM,
    EVENT_DECODER,
    EVENTS_STREAM,
    Completed,
    Dispatch,
    Expired,
    Rejected,
    Started,
    dispatch_subject,
    encode,
    kind_of,
    msg_id,
    request_subject,
    routed,
)
from renqueue.services.worker import Worker


def make_config(tmp_path: Path, backends: dict[str, tuple[str, int]], **extra: Any) -> Config:
    """backends: name -> (base_url, concurrency); one route per backend plus 'chat'."""
    raw: dict[str, Any] = {
        "nats": {"data_dir": str(tmp_path / "nats"), "port": -1},
        "backends": {
            name: {"base_url": url, "model": "mock", "limits": {"concurrency": slots}}
            for name, (url, slots) in backends.items()
        },
        "routes": {"chat": {"backends": list(backends)}},
        "worker": {"retry_delay": "100ms", "drain_timeout": "2s"},
        "router": {"capacity_refresh": "20ms"},
    }
    for key, value in extra.items():
        raw[key] = {**raw.get(key, {}), **value}
    return parse_config(raw)


@pytest.fixture
async def mock() -> AsyncIterator[MockBackend]:
    async with MockBackend(MockSettings(ttft=0.0, tokens_per_second=0, output_tokens=8)) as m:
        yield m


@pytest.fixture
async def stack(tmp_path: Path, mock: MockBackend) -> AsyncIterator[Services]:
    config = make_config(tmp_path, {"b1": (mock.url, 4)})
    async with Services(config) as services:
        yield services


@pytest.fixture
async def client(stack: Services) -> AsyncIterator[Client]:
    async with Client(stack.nc, tenant="t1") as c:
        yield c


async def kinds(client: Client, request_id: str) -> list[str]:
    events = await EventLog(client.js).history(client.tenant, request_id)
    return [type(e).__name__.lower() for e in events]


async def test_submit_streams_tokens_and_result_matches(client: Client) -> None:
    handle = await client.submit("hello", route="chat", priority="high")
    chunks = [chunk async for chunk in handle.stream(timeout=10)]
    result = await handle.result(timeout=10)

    assert "".join(c.text for c in chunks) == result.text
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert result.backend == "b1"
    assert result.usage.completion_tokens == 8
    assert await kinds(client, handle.id) == ["submitted", "routed", "started", "completed"]


async def test_late_subscriber_gets_every_token_in_order(client: Client, mock: MockBackend) -> None:
    mock.update(tokens_per_second=200)  # paced: several chunks
    handle = await client.submit("hello", route="chat")
    result = await handle.result(timeout=10)
    # The request is over before anyone subscribes to its tokens.
    chunks = [chunk async for chunk in handle.stream(timeout=10)]
    assert "".join(c.text for c in chunks) == result.text
    # One chunk per network read: a loaded machine may read tokens together.
    assert [c.seq for c in chunks] == list(range(len(chunks)))


async def test_resubmit_with_same_id_creates_nothing_new(client: Client, mock: MockBackend) -> None:
    first = await client.submit("once", route="chat", request_id="same-id-1")
    result = await first.result(timeout=10)
    again = await client.submit("once", route="chat", request_id="same-id-1")

    assert again.duplicate
    assert (await again.result(timeout=10)).text == result.text
    assert mock.stats().requests == 1
    assert (await kinds(client, "same-id-1")).count("submitted") == 1


async def test_malformed_payload_is_rejected_and_router_keeps_serving(client: Client) -> None:
    js = client.js
    await js.publish(
        request_subject("normal", "t1"), b"{not json", headers={"Nats-Msg-Id": "t1:garbage-1"}
    )
    await js.publish(
        request_subject("normal", "t1"), b'{"id": 5}', headers={"Nats-Msg-Id": "t1:garbage-2"}
    )

    for bad in ("garbage-1", "garbage-2"):
        with pytest.raises(RequestRejectedError) as info:
            await client.handle(bad).result(timeout=10)
        assert info.value.error_type == "malformed"
    dead = await js.get_last_msg(DLQ_STREAM, "rq.dlq.requests")
    assert dead.data == b'{"id": 5}'
    # The router is still serving.
    good = await client.submit("still there?", route="chat")
    assert (await good.result(timeout=10)).backend == "b1"


async def test_two_tenants_may_use_the_same_request_id(stack: Services, mock: MockBackend) -> None:
    """Deduplication is scoped by tenant: another tenant's id is not a duplicate."""
    async with Client(stack.nc, tenant="ta") as ta, Client(stack.nc, tenant="tb") as tb:
        first = await ta.submit("from a", route="chat", request_id="shared-id")
        assert (await first.result(timeout=10)).backend == "b1"
        second = await tb.submit("from b", route="chat", request_id="shared-id")
        assert not second.duplicate
        assert (await second.result(timeout=10)).backend == "b1"
    assert mock.stats().requests == 2
    log = EventLog(stack.js)
    for tenant in ("ta", "tb"):
        events = await log.history(tenant, "shared-id")
        assert [type(e).__name__ for e in events] == ["Submitted", "Routed", "Started", "Completed"]


async def test_a_message_id_of_another_scope_is_rejected(client: Client, mock: MockBackend) -> None:
    """A publish whose Nats-Msg-Id is not <subject tenant>:<payload id> is rejected."""
    for index, header in enumerate(["other:wrong-scope-{}", "wrong-scope-{}", None]):
        request = client.build_request("hi", route="chat", request_id=f"wrong-scope-{index}")
        headers = None if header is None else {"Nats-Msg-Id": header.format(index)}
        await client.js.publish(
            request_subject("normal", "t1"), msgspec.json.encode(request), headers=headers
        )
        with pytest.raises(RequestRejectedError, match="Nats-Msg-Id") as info:
            await client.handle(request.id).result(timeout=10)
        assert info.value.error_type == "malformed"
    assert mock.stats().requests == 0


async def test_a_tenant_cannot_forge_a_requeue(client: Client, mock: MockBackend) -> None:
    """Only the services put a request back (on their own requeue subject): a
    tenant setting ``requeues`` ran one request id several times at once and
    was billed for one run. Now it is rejected and never runs."""
    request = client.build_request("hi", route="chat", request_id="amplified")
    for n in (1, 2, 3):
        forged = msgspec.structs.replace(request, requeues=n)
        await client.js.publish(
            request_subject("normal", "t1"),
            msgspec.json.encode(forged),
            headers={"Nats-Msg-Id": msg_id("t1", "amplified", "requeue", n)},
        )
    with pytest.raises(RequestRejectedError, match="set by the services only") as info:
        await client.handle("amplified").result(timeout=10)
    assert info.value.error_type == "malformed"
    assert mock.stats().requests == 0


async def test_unknown_route_gets_a_clear_error_event(client: Client) -> None:
    handle = await client.submit("hi", route="no-such-route")
    with pytest.raises(RequestRejectedError) as info:
        await handle.result(timeout=10)
    assert info.value.error_type == "unknown_route"
    assert "no-such-route" in str(info.value)
    [rejected] = [
        e for e in await EventLog(client.js).history("t1", handle.id) if isinstance(e, Rejected)
    ]
    assert rejected.error_type == "unknown_route"


async def test_payload_naming_another_tenant_is_rejected(client: Client) -> None:
    request = client.build_request("sneaky", route="chat")
    forged = msgspec.structs.replace(request, tenant="other-tenant")
    await client.js.publish(
        request_subject("normal", "t1"),
        msgspec.json.encode(forged),
        headers={"Nats-Msg-Id": msg_id("t1", forged.id)},
    )
    with pytest.raises(RequestRejectedError, match="does not match subject tenant"):
        await client.handle(forged.id).result(timeout=10)


async def test_deadline_passed_while_waiting_expires_without_backend_call(
    client: Client, mock: MockBackend
) -> None:
    request = client.build_request("too late", route="chat", deadline=time.time() - 1)
    handle = await client.submit_request(request)
    with pytest.raises(RequestExpiredError):
        await handle.result(timeout=10)
    assert mock.stats().requests == 0
    assert await kinds(client, handle.id) == ["submitted", "expired"]


async def test_a_dispatch_past_its_deadline_expires_at_its_run_and_its_late_decision_holds_nothing(
    stack: Services, client: Client, mock: MockBackend
) -> None:
    """A rebind logs its decision once the dispatch is stored: the worker can
    end the request first (here its deadline passed before the call). The
    `expired` names the run, and the live projection reserves nothing for the
    decision that lands after it (it used to hold its quota and cost for 6 h)."""
    request = client.build_request("too late", route="chat", deadline=time.time() - 1)
    await client.js.publish(
        dispatch_subject("b1"),
        encode(Dispatch(request=request, backend="b1", attempt=1)),
        headers={"Nats-Msg-Id": msg_id("t1", request.id, "dispatch", 1)},
    )
    log = EventLog(client.js)

    async def ended() -> bool:
        return any(isinstance(e, Expired) for e in await log.history("t1", request.id))

    await until(ended, "the worker ended the dispatch")
    [expired] = [e for e in await log.history("t1", request.id) if isinstance(e, Expired)]
    assert (expired.stage, expired.backend, expired.attempt) == ("queued", "b1", 1)
    late = routed(
        request,
        at=time.time(),
        backend="b1",
        attempt=1,
        priority="normal",
        queue_wait=0.0,
        reserved_tokens=100,
        estimated_cost=0.01,
    )
    assert await log.append(late)
    assert stack.projector is not None
    async with asyncio.timeout(10):
        state = await stack.projector.sync()
    key = msg_id("t1", request.id)
    assert key not in state.reserved
    assert key not in state.ended
    assert state.tenants["t1"].committed == 0.0
    assert mock.stats().requests == 0


async def test_higher_levels_start_first_when_a_slot_frees(tmp_path: Path) -> None:
    async with (
        MockBackend(MockSettings(ttft=0.0, tokens_per_second=0, output_tokens=4)) as fast,
        MockBackend(MockSettings(ttft=0.6, tokens_per_second=0, output_tokens=4)) as slow,
    ):
        config = make_config(tmp_path, {"one": (fast.url, 1)})
        config = msgspec.structs.replace(
            config,
            backends={
                "one": msgspec.structs.replace(config.backends["one"], base_url=slow.url),
            },
        )
        async with Services(config) as services, Client(services.nc, tenant="t1") as client:
            blocker = await client.submit("hold the slot", route="chat", priority="batch")
            await asyncio.sleep(0.2)  # the blocker is running
            levels = ["batch", "low", "normal", "high", "critical"]
            handles = {
                level: await client.submit(level, route="chat", priority=level) for level in levels
            }
            await blocker.result(timeout=20)
            for handle in handles.values():
                await handle.result(timeout=20)
            starts = {}
            for level, handle in handles.items():
                events = await EventLog(client.js).history("t1", handle.id)
                [started] = [e for e in events if isinstance(e, Started)]
                starts[level] = started.at
    assert sorted(levels, key=starts.__getitem__) == list(reversed(levels))


async def test_worker_killed_mid_stream_is_redelivered_and_completes_once(
    tmp_path: Path,
) -> None:
    async with MockBackend(MockSettings(ttft=0.0, tokens_per_second=20, output_tokens=60)) as slow:
        config = make_config(
            tmp_path, {"slow": (slow.url, 2)}, worker={"ack_wait": "1s", "max_deliver": 5}
        )
        # Routers here; the first worker in a separate process we can kill.
        async with Services(config, backends=[]) as services:
            config_file = tmp_path / "renqueue.toml"
            config_file.write_text(
                f'[nats]\nurl = "{services.url}"\n'
                f'[worker]\nack_wait = "1s"\nmax_deliver = 5\nretry_delay = "100ms"\n'
                f'[backends.slow]\nbase_url = "{slow.url}"\nmodel = "mock"\n'
                f"[backends.slow.limits]\nconcurrency = 2\n"
                f'[routes.chat]\nbackends = ["slow"]\n'
            )
            worker = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "renqueue.cli",
                "-c",
                str(config_file),
                "worker",
                "-b",
                "slow",
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
            async with Client(services.nc, tenant="t1") as client:
                handle = await client.submit("a long answer", route="chat")
                chunks = []
                stream = handle.stream(timeout=20)
                async for chunk in stream:
                    chunks.append(chunk)
                    if len(chunks) == 5:
                        worker.send_signal(signal.SIGKILL)
                        await worker.wait()
                        break
                await stream.aclose()
                # A fresh worker (this process) picks the request up after ack_wait.
                replacement = Services(
                    msgspec.structs.replace(
                        config, nats=msgspec.structs.replace(config.nats, url=services.url)
                    ),
                    routers=0,
                    provision_streams=False,
                )
                async with replacement:
                    result = await handle.result(timeout=30)
                    rest = [chunk async for chunk in handle.stream(timeout=20)]
                events = await EventLog(client.js).history("t1", handle.id)

    completions = [e for e in events if isinstance(e, Completed)]
    assert len(completions) == 1
    assert [e.delivery for e in events if isinstance(e, Started)] == [1, 2]
    assert completions[0].delivery == 2
    # The second run announces itself, then streams the whole answer again.
    restarted = [c for c in rest if c.delivery == 2]
    assert restarted[0].restart
    assert "".join(c.text for c in restarted) == result.text


async def test_subscriber_joining_mid_stream_gets_stored_then_live_chunks_once(
    client: Client, mock: MockBackend
) -> None:
    """A second subscriber, joining after the first has read a few chunks,
    gets every chunk once: the stored ones, then the live ones, no gap, no
    repeat. How many chunks the answer's 16 tokens make depends on the
    machine's pace (the worker sends what has arrived as one chunk), so the
    test counts them rather than expecting 16."""
    mock.update(tokens_per_second=40, output_tokens=16)  # ~0.4 s of generation
    handle = await client.submit("hello", route="chat")
    first = handle.stream(timeout=10)
    early = [await anext(first) for _ in range(3)]  # chunks are stored: join now
    late = [chunk async for chunk in handle.stream(timeout=10)]
    early += [chunk async for chunk in first]
    result = await handle.result(timeout=10)

    assert [c.seq for c in late] == list(range(len(late)))
    assert [c.seq for c in early] == [c.seq for c in late]
    assert "".join(c.text for c in late) == result.text
    assert "".join(c.text for c in early) == result.text
    assert len(late) > 3


async def test_router_skips_a_backend_the_log_shows_failing(tmp_path: Path) -> None:
    async with (
        MockBackend(MockSettings(failure_rate=1.0)) as broken,
        MockBackend(MockSettings(output_tokens=3)) as healthy,
    ):
        config = make_config(
            tmp_path,
            {"broken": (broken.url, 4), "healthy": (healthy.url, 4)},
            worker={"max_deliver": 2, "retry_delay": "50ms"},
        )
        # Its circuit opens after 3 faults in a row (the default is 5).
        broken_backend = config.backends["broken"]
        config = msgspec.structs.replace(
            config,
            backends={
                **config.backends,
                "broken": msgspec.structs.replace(
                    broken_backend,
                    circuit=msgspec.structs.replace(broken_backend.circuit, failures=3),
                ),
            },
        )
        async with Services(config) as services, Client(services.nc, tenant="t1") as client:
            # Each request bound to the broken backend fails there twice (a
            # retry, then it falls back to the healthy one, which answers):
            # two requests make the three faults that mark it down.
            for _ in range(2):
                handle = await client.submit("x", route="chat")
                fell_back = await handle.result(timeout=10)
                assert fell_back.backend == "healthy"
            assert services.projector is not None
            await asyncio.wait_for(services.projector.sync(), 10)
            await asyncio.sleep(0.3)  # the routers' state view follows the KV bucket
            result = await (await client.submit("y", route="chat")).result(timeout=10)
    assert result.backend == "healthy"
    assert broken.stats().requests == 4


class BrokenBackend:
    """A backend adapter with a bug: it raises something that is not a BackendError."""

    name = "b1"

    async def stream(
        self, request: Any, *, priority: int | None = None, traceparent: str | None = None
    ) -> AsyncIterator[Any]:
        raise RuntimeError("adapter bug")
        yield  # an async generator, as the protocol asks

    async def complete(
        self, request: Any, *, priority: int | None = None, traceparent: str | None = None
    ) -> Any:
        raise RuntimeError("adapter bug")

    async def close(self) -> None:
        return None


async def test_a_worker_bug_fails_the_request_on_its_last_delivery_not_never(
    tmp_path: Path, mock: MockBackend
) -> None:
    config = make_config(
        tmp_path, {"b1": (mock.url, 2)}, worker={"max_deliver": 2, "retry_delay": "50ms"}
    )
    async with Services(config, backends=[]) as services:
        worker = Worker(services.nc, services.js, config, "b1", BrokenBackend())
        await worker.start()
        try:
            async with Client(services.nc, tenant="t1") as client:
                handle = await client.submit("x", route="chat")
                with pytest.raises(RequestFailedError) as info:
                    await handle.result(timeout=10)
                events = await EventLog(client.js).history("t1", handle.id)
        finally:
            await worker.close()
    assert info.value.error_type == "internal"
    assert [e.delivery for e in events if isinstance(e, Started)] == [1, 2]


async def test_requests_no_backend_can_serve_are_rejected_not_held(
    tmp_path: Path, mock: MockBackend
) -> None:
    """A complexity above every backend's tier is rejected at once: held, such
    requests waited forever and, a few of them, filled the level's hold so
    that no other tenant's request at that level was ever fetched."""
    config = make_config(tmp_path, {"b1": (mock.url, 4)}, router={"hold_limit": 2})
    async with (
        Services(config) as services,
        Client(services.nc, tenant="ta") as ta,
        Client(services.nc, tenant="tb") as tb,
    ):
        impossible = [await ta.submit("hard", route="chat", complexity=9) for _ in range(3)]
        assert (await (await tb.submit("easy", route="chat")).result(timeout=20)).backend == "b1"
        for handle in impossible:
            with pytest.raises(RequestRejectedError, match="highest tier there is 1") as info:
                await handle.result(timeout=10)
            assert info.value.error_type == "no_capable_backend"
    assert mock.stats().requests == 1


async def test_a_rejected_request_sent_again_under_its_id_is_refused_not_routed(
    client: Client, mock: MockBackend
) -> None:
    """Issue 30: a request rejected for its old-style ``Nats-Msg-Id`` (no tenant)
    and sent again with the right header was stored (another message id),
    admitted and routed, and the worker then dropped it ("request already
    ended"): a routing decision and a backend slot spent on nothing, while the
    client only ever saw the rejection. A request id has one outcome: the
    router now refuses the copy at admission, with a dead letter that says so."""
    request = client.build_request("hi", route="chat", request_id="fixed-header")
    data = msgspec.json.encode(request)
    subject = request_subject("normal", "t1")
    await client.js.publish(subject, data, headers={"Nats-Msg-Id": request.id})
    with pytest.raises(RequestRejectedError, match="Nats-Msg-Id"):
        await client.handle(request.id).result(timeout=10)
    refused = REGISTRY.get_sample_value("renqueue_ended_resubmits_total", {"priority": "normal"})

    ack = await client.js.publish(subject, data, headers={"Nats-Msg-Id": msg_id("t1", request.id)})
    assert not ack.duplicate  # another message id: stored
    log = EventLog(client.js)

    async def read() -> bool:
        # Whichever comes first: the refusal's dead letter, or a routing decision.
        dead = await client.js.get_last_msg(DLQ_STREAM, "rq.dlq.requests")
        reason = (dead.headers or {}).get("Rq-Reason", "")
        return reason.startswith("already_ended") or bool(
            await log.history("t1", request.id, kind="routed")
        )

    await until(read, "the router read the copy sent again")
    assert await kinds(client, request.id) == ["rejected"]  # not submitted, not routed
    dead = await client.js.get_last_msg(DLQ_STREAM, "rq.dlq.requests")
    headers = dead.headers or {}
    assert headers["Rq-Reason"].startswith(
        "already_ended: request fixed-header already ended (rejected)"
    )
    assert headers["Rq-Request-Id"] == request.id
    assert headers["Nats-Msg-Id"] == f"t1:fixed-header:dlq:requests:again-{ack.seq}"
    assert dead.data == data
    after = REGISTRY.get_sample_value("renqueue_ended_resubmits_total", {"priority": "normal"})
    assert (after or 0) == (refused or 0) + 1
    with pytest.raises(RequestRejectedError, match="Nats-Msg-Id"):  # the one outcome stands
        await client.handle(request.id).result(timeout=10)
    assert mock.stats().requests == 0
    # The dead letter is how the corrected request runs: requeued, under a new id.
    dead_letters = DeadLetters(client.js)
    again = await dead_letters.requeue(await dead_letters.get(dead.seq))
    assert (await client.handle(again.new_id).result(timeout=10)).backend == "b1"


async def test_a_malformed_copy_of_a_running_request_does_not_end_it(tmp_path: Path) -> None:
    """Issue 30 (found by ``make fuzz``): a valid request sent with its header, the
    same again (a duplicate, not stored), then the same body without the header
    (stored: no message id to deduplicate it). The third is malformed, and its
    rejection, recorded under the body's id, claimed the terminal of the request
    while it ran: the worker's completion (the backend already called) was
    dropped and the request ended ``rejected``. A copy of a request admitted
    from another message is now dead-lettered on its own (``Nats-Msg-Id``
    ``<tenant>:<id>:dlq:requests:rejected-<seq>``) and ends nothing."""
    settings = MockSettings(ttft=2.0, tokens_per_second=0, output_tokens=8)
    async with (
        MockBackend(settings) as slow,
        Services(make_config(tmp_path, {"b1": (slow.url, 4)})) as services,
        Client(services.nc, tenant="t1") as client,
    ):
        request = client.build_request("hi", route="chat", request_id="running-one")
        data = msgspec.json.encode(request)
        js, subject = client.js, request_subject("normal", "t1")
        header = {"Nats-Msg-Id": msg_id("t1", request.id)}
        assert not (await js.publish(subject, data, headers=header)).duplicate
        assert (await js.publish(subject, data, headers=header)).duplicate
        log = EventLog(js)

        async def started() -> bool:
            return bool(await log.history("t1", request.id, kind="started"))

        await until(started, "the request runs")
        copy = await js.publish(subject, data)  # no header: malformed
        assert not copy.duplicate

        async def copy_read() -> bool:
            # Whichever comes first: the copy's dead letter, or any end of the request.
            if await log.history("t1", request.id, kind="rejected"):
                return True
            try:
                await js.get_last_msg(DLQ_STREAM, "rq.dlq.requests")
            except NatsNotFoundError:
                return False
            return True

        await until(copy_read, "the router read the malformed copy")
        result = await client.handle(request.id).result(timeout=20)
        assert result.backend == "b1"
        assert await kinds(client, request.id) == ["submitted", "routed", "started", "completed"]
        dead = await js.get_last_msg(DLQ_STREAM, "rq.dlq.requests")
        headers = dead.headers or {}
        assert headers["Nats-Msg-Id"] == f"t1:running-one:dlq:requests:rejected-{copy.seq}"
        assert headers["Rq-Request-Id"] == request.id
        assert headers["Rq-Reason"].startswith("malformed: ")
        assert "does not end it" in headers["Rq-Reason"]
        assert dead.data == data
        assert slow.stats().requests == 1


async def test_a_rejection_is_named_by_the_payload_id_else_the_header_id_else_the_sequence(
    client: Client,
) -> None:
    """Issue 30 (docs/wire-format.md, *Which request a rejection names*): the
    payload's id when the payload decodes; else the id of a ``Nats-Msg-Id`` of
    the subject's tenant; else ``invalid-<its RQ_REQUESTS sequence>``. Its dead
    letter's ``Nats-Msg-Id`` is ``<tenant>:<id>:dlq:requests``."""
    js, subject = client.js, request_subject("normal", "t1")
    decodes = client.build_request("hi", route="chat", request_id="named-in-body")
    await js.publish(subject, msgspec.json.encode(decodes), headers={"Nats-Msg-Id": "t1:hdr-1"})
    broken = {**msgspec.to_builtins(decodes), "id": "not-read", "messages": "not a list"}
    await js.publish(subject, msgspec.json.encode(broken), headers={"Nats-Msg-Id": "t1:hdr-2"})
    ack = await js.publish(subject, b"{not json", headers={"Nats-Msg-Id": "other:hdr-3"})

    for request_id in ("named-in-body", "hdr-2", f"invalid-{ack.seq}"):
        with pytest.raises(RequestRejectedError) as info:
            await client.handle(request_id).result(timeout=10)
        assert info.value.error_type == "malformed"
    # A request rejected when read has no `submitted` event: its log is the rejection.
    assert await kinds(client, "named-in-body") == ["rejected"]
    log = EventLog(js)
    for unnamed in ("hdr-1", "not-read", "hdr-3"):
        assert await log.history("t1", unnamed) == []
    # A batch's rejections are recorded at once: their dead letters in any order.
    info = await js.stream_info(DLQ_STREAM)
    dead_letters = [
        await js.get_msg(DLQ_STREAM, seq=seq)
        for seq in range(info.state.first_seq, info.state.last_seq + 1)
    ]
    junk = [dead for dead in dead_letters if dead.data == b"{not json"]
    assert len(junk) == 1
    assert (junk[0].headers or {})["Nats-Msg-Id"] == f"t1:invalid-{ack.seq}:dlq:requests"


async def test_a_level_not_configured_gets_no_responders_status_503(stack: Services) -> None:
    """docs/wire-format.md: no stream listens on an unconfigured level's subject,
    so a JetStream publish there gets the server's 503 "no responders"; nats.py
    names it ``NoStreamResponseError`` (``js.publish``) and ``NoRespondersError``
    (a plain request), nats.js ``JetStreamNotEnabled`` (code 503)."""
    nc = NatsClient()
    await nc.connect(stack.url)
    try:
        subject = request_subject("urgent", "t1")
        with pytest.raises(nats.js.errors.NoStreamResponseError):
            await nc.jetstream().publish(subject, b"{}", headers={"Nats-Msg-Id": "t1:x"})
        with pytest.raises(nats.errors.NoRespondersError):
            await nc.request(subject, b"{}", timeout=5)
    finally:
        await nc.close()


async def test_a_tenant_over_its_backlog_at_a_level_is_refused_and_others_are_not(
    tmp_path: Path,
) -> None:
    """Issue 30 (``make fuzz``: one tenant's flood slowed every tenant's requests,
    which waited behind it in the level's queue). ``router.tenant_backlog`` caps
    the requests one tenant may have waiting at one level (the requests stream's
    ``max_msgs_per_subject``: a level's subject is the tenant's own): past it the
    broker refuses the submit, typed, and another tenant's submits are stored."""
    config = make_config(tmp_path, {"b1": ("http://127.0.0.1:9", 1)}, router={"tenant_backlog": 2})
    async with (
        Services(config, routers=0, backends=[], projector=False) as services,
        Client(services.nc, tenant="flood") as flood,
        Client(services.nc, tenant="calm") as calm,
    ):
        for i in range(2):
            await flood.submit("x", route="chat", request_id=f"f{i}")
        with pytest.raises(TenantBacklogFullError, match=r"router\.tenant_backlog") as info:
            await flood.submit("x", route="chat", request_id="f2")
        assert info.value.code == "tenant_backlog_full"
        # What the submitter reads: which request and what to do, not the
        # broker's codes (kept in the error's fields).
        assert "err_code" not in str(info.value), str(info.value)
        assert (info.value.status, info.value.err_code) == (503, 10077)
        await flood.submit("x", route="chat", priority="high", request_id="f3")  # another level
        await calm.submit("x", route="chat", request_id="c0")
        stored = await services.js.stream_info("RQ_REQUESTS")
        assert stored.state.messages == 4


async def test_a_batchs_good_requests_are_taken_before_its_rejections(tmp_path: Path) -> None:
    """Issue 30 (``make fuzz``: one tenant's bad requests, rejected one at a time
    in the level every tenant's requests wait in, slowed everyone): a fetched
    batch's good requests are taken first, and its rejections recorded after,
    all at once. Twenty bad requests, then a good one, all waiting before the
    router starts: the good one's ``submitted`` is logged before any rejection."""
    config = make_config(tmp_path, {"b1": ("http://127.0.0.1:9", 1)})
    async with (
        Services(config, routers=0, backends=[], projector=False) as services,
        Client(services.nc, tenant="bad") as bad,
        Client(services.nc, tenant="good") as good,
    ):
        for i in range(20):
            request = bad.build_request("x", route="chat", request_id=f"bad-{i}")
            await bad.js.publish(request_subject("normal", "bad"), msgspec.json.encode(request))
        await good.submit("x", route="chat", request_id="good-0")
    async with Services(config, backends=[]) as services:
        assert services.js is not None
        log = EventLog(services.js)

        async def all_read() -> bool:
            return all([await log.history("bad", f"bad-{i}") for i in range(20)]) and bool(
                await log.history("good", "good-0", kind="submitted")
            )

        await until(all_read, "the router read every request")
        seqs = await read_subject(services.nc, services.js, EVENTS_STREAM, "rq.evt.*.*.*")
        order = [
            (event.tenant, kind_of(event))
            for _, data in seqs
            if kind_of(event := EVENT_DECODER.decode(data)) in ("submitted", "rejected")
        ]
    assert order[0] == ("good", "submitted")
    assert sorted(order[1:]) == [("bad", "rejected")] * 20
